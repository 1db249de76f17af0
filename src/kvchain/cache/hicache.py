"""The host tier: `HiCacheController` backs up prefix-tree nodes to host pools and loads them back on
a match; `HiRadixCache` is the prefix tree that calls it.

What the host holds is indexed page by page by a digest of the whole prefix through that page, so
a page's host copy serves any later request with the same tokens before it, whatever the tree's
nodes look like by then. A record holds the page's owner (full-attention) copy, each window's row
where the device had one, and the recurrent state at the page's end where the tree had a state
there: a host hit restores the state too, not only attention.

Ordering (the design's HiCache section):
* a backup's copy stream waits the forward stream, and the schedule stream, before it copies
  (HIC-1); the copy is a reader in the ledger (`COPY_READ`, HIC-2), so the evicted pages' next
  writer waits it on a stream;
* a load takes its device pages under load reservations (`KVStorage.alloc_load`, HIC-4/5), the tree
  binds them and names the window rows by owner ids at once (HIC-6); at submission
  (`start_loading`) the ids are translated (HIC-7), the copy is recorded as a writer (`COPY_WRITE`)
  and the reservations left end with no gap between the two (HIC-8), and the copy stream waits the
  forward stream first (HIC-9). The forward stream then waits the copy: the next forward reads the
  loaded pages.
All host copies run on the device's one copy stream, in order, so a host page freed and reused by a
later backup is written only after every earlier copy that read it."""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..advance import window_keep_from
from ..alloc.page_usage import PageUse
from ..alloc.signals import HostTransfer
from ..capacity import evict_until_fits
from ..device.base import Event, PageAccess
from ..errors import CapacityError, InputError, InvariantError
from ..memory.host import HostPool, HostPools
from ..plan import KVStoragePlan, PoolKind
from ..storage import KVStorage
from .radix import (
    CheckpointStrategy,
    Evicted,
    InsertResult,
    MatchResult,
    TreeNode,
    UnifiedRadixCache,
    _first_bound_of_suffix,
)


def load_ids_short(storage: KVStorage, n_pages: int, n_slots: int) -> bool:
    """Whether some stage lacks the owner virtual ids or state slot ids a load binds: asked of
    every stage under pipeline parallelism (PP-7), of this chain's free ids otherwise."""
    chain = storage.allocator
    if chain.stage_capacity is not None:
        return chain.stage_capacity.ids_fit(n_pages, n_slots) is not None
    return n_pages > len(chain.virtual_free) or n_slots > len(chain.slot_free)


def take_load_pages(storage: KVStorage, demand: list[int]) -> dict[str, tuple[np.ndarray, PageUse]] | None:
    """The load-back's physical-take scope (PP-12, PP-13): every sub-pool's pages of the load
    (`demand`, per sub-pool in chain order) are asked of every stage's snapshot as one demand, and
    the real layout is made to serve them all (`ensure_capacity`, a relief at most), before any of
    them is taken; then each sub-pool's pages are taken under a load reservation (HIC-4/5), in
    place. None, with nothing taken on any stage, when some stage cannot serve the whole load: a
    sub-pool taken on its own first would stay fixed on every stage while a later one is refused.
    The owner's pages are always taken (an empty array for a state-only load)."""
    chain = storage.allocator
    if not chain.ensure_capacity(demand):
        return None
    taken: dict[str, tuple[np.ndarray, PageUse]] = {}
    for pool, k in zip(storage.plan.sub_pools, demand):
        if k or pool is storage.plan.owner:
            try:
                taken[pool.name] = storage.alloc_load(pool.name, k)
            except CapacityError as e:  # a yes from ensure_capacity is followed by a take (CAP-11)
                raise InvariantError("hicache.load_take_scope",
                                     f"{pool.name}: the load's layout did not serve its take: {e}") from e
    return taken


class WritePolicy(enum.Enum):
    """When a node reaches the host."""

    WRITE_THROUGH = "write_through"  # at every insert: an eviction then copies nothing
    WRITE_BACK = "write_back"  # when the tree evicts it, right before its pages are freed


@dataclass
class HostRecord:
    """The host copy of one page of a prefix: host page ids per sub-pool (the owner always, a window
    where the device bound its row) and the state after the page's last token (-1: none)."""

    depth: int  # pages from the root through this one
    pages: dict[str, int] = field(default_factory=dict)
    state: int = -1
    used: int = 0
    pins: int = 0


@dataclass
class PendingLoad:
    """A load queued for submission: the ids it writes (owner virtual pages, window rows named by
    owner ids, state slot ids), the host pages it reads, and the reservations still left."""

    name: str
    virtual: dict[str, np.ndarray]
    host: dict[str, np.ndarray]
    reservations: dict[str, PageUse]
    node: TreeNode
    records: list[HostRecord]
    serves_from: int  # a match longer than this many tokens uses what the load brings


@dataclass(frozen=True)
class LoadPlan:
    """A load-back as `load_back` would make it, before anything is taken: pages `d` to `end` of
    the prompt come from the host `run`, each window's rows from `lows`; `pages` is what it takes
    per sub-pool (chain order) and `tokens_served` the match it lets the request find."""

    path: list
    d: int
    end: int
    run: list[HostRecord]
    lows: list[int]
    pages: tuple[int, ...]
    tokens_served: int


@dataclass
class CopyJob:
    kind: str  # "backup" or "load"
    name: str
    done: Event
    transfer: HostTransfer
    pages: int


def prefix_digests(tokens: np.ndarray, page_size: int, n_pages: int) -> list[bytes]:
    """The digest of every prefix of whole pages of `tokens`, 1..n_pages pages."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    out, h = [], b""
    for p in range(n_pages):
        h = hashlib.blake2b(h + tokens[p * page_size : (p + 1) * page_size].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def _runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs consecutive on both sides, sorted by source."""
    if not len(src):
        return []
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], cut])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist()))


def copy_pages(dst: torch.Tensor, dst_ids: np.ndarray, src: torch.Tensor, src_ids: np.ndarray) -> None:
    """`dst[dst_ids] = src[src_ids]`, page rows, queued on the current stream. Within one memory: one
    gather and one scatter. Between a device and pinned host memory, asynchronous: the device side
    is gathered (or scattered) on the device and crosses in one copy when the host side is one run
    of pages, else one copy per run consecutive on both sides."""
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    if not len(src_ids):
        return
    wide = dst.shape[1] % 8 == 0  # through int64 words: a byte-wide gather runs several times slower
    if dst.device.type == "cpu" and src.device.type == "cpu":
        # one numpy gather-scatter on the calling thread: a torch op on a busy CPU enters an OpenMP
        # region that waits for every torch thread (as `memory/copy.py` found for page moves)
        d, s = (dst.view(torch.int64), src.view(torch.int64)) if wide else (dst, src)
        d.numpy()[dst_ids] = s.numpy()[src_ids]
        return
    if dst.device == src.device:
        d, s = (dst.view(torch.int64), src.view(torch.int64)) if wide else (dst, src)
        d.index_copy_(0, torch.from_numpy(dst_ids).to(dst.device), s.index_select(0, torch.from_numpy(src_ids).to(src.device)))
        return
    host, host_ids = (dst, dst_ids) if dst.device.type == "cpu" else (src, src_ids)
    # asynchronous only from and to pinned rows that are contiguous (a shared backing's smaller
    # envelope is a column slice: torch would stage it through memory the copy does not own)
    non_blocking = host.is_pinned() and host.is_contiguous()
    if len(host_ids) > 1 and (np.diff(host_ids) == 1).all():
        h = slice(int(host_ids[0]), int(host_ids[0]) + len(host_ids))
        if dst.device.type == "cpu":  # device to host: gather on the device, one copy across
            dst[h].copy_(src.index_select(0, torch.from_numpy(src_ids).to(src.device)), non_blocking=non_blocking)
        else:  # host to device: one copy across, scatter on the device
            dst.index_copy_(0, torch.from_numpy(dst_ids).to(dst.device), src[h].to(dst.device, non_blocking=non_blocking))
        return
    for s, d, n in _runs(src_ids, dst_ids):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)


class HiCacheController:
    """Backups and loads between a storage's arena and its host pools, for one prefix tree."""

    def __init__(self, storage: KVStorage, tree: UnifiedRadixCache, host: HostPools,
                 policy: WritePolicy = WritePolicy.WRITE_BACK) -> None:
        if host.plan is not storage.plan:
            raise InputError("the host pools were sized for another plan")
        if not isinstance(policy, WritePolicy):
            raise InputError(f"a write policy is one of {[p.value for p in WritePolicy]}, got {policy!r}")
        self.storage = storage
        self.tree = tree
        self.host = host
        self.policy = policy
        self.plan = storage.plan
        self.ps = storage.page_size
        self.owner = self.plan.owner.name
        self.windows = [p for p in self.plan.sub_pools if p.kind is PoolKind.WINDOW]
        self.state = self.plan.state
        self.records: dict[bytes, HostRecord] = {}
        self.queue: list[PendingLoad] = []
        self.jobs: list[CopyJob] = []
        #: end every copy whenever copies are collected, waiting on the host for the ones still
        #: running: what is pending then never depends on when a copy ran, so processes that must
        #: decide alike (tensor-parallel ranks, `tp_engine`) do
        self.lockstep = False
        self._clock = itertools.count(1)
        self._names = itertools.count(1)
        self.stats = {"backups": 0, "backup_pages": 0, "backup_states": 0, "backup_skips": 0, "loads": 0,
                      "load_pages": 0, "load_states": 0, "load_skips": 0, "loads_declined": 0, "host_hits": 0, "host_evictions": 0}

    # -- copies ------------------------------------------------------------------------------------

    def _order_copy_stream(self) -> None:
        """The copy stream waits the forward stream (HIC-1, HIC-9) and the schedule stream, where the
        pool queued the takes' clearance waits, zeroing and moves."""
        device = self.storage.device
        copy = device.copy_stream
        device.stream_wait(copy, device.record(device.forward_stream, "forwards before a host copy"))
        device.stream_wait(copy, device.record(device.schedule_stream, "schedule before a host copy"))

    def _launch(self, name: str, to_host: bool, physical: dict[str, np.ndarray], host_ids: dict[str, np.ndarray]) -> Event:
        storage = self.storage
        device = storage.device
        plan = []
        for sub_pool, ids in physical.items():
            pool = self.plan.by_name(sub_pool)
            dev = storage.arena.page_bytes_view(pool.index)
            hst = self.host.pages(sub_pool)
            plan.append((hst, host_ids[sub_pool], dev, ids) if to_host else (dev, ids, hst, host_ids[sub_pool]))

        def run() -> None:
            for dst, dst_ids, src, src_ids in plan:
                copy_pages(dst, dst_ids, src, src_ids)

        accesses = [PageAccess(self.plan.by_name(n).index, ids) for n, ids in physical.items()]
        self._order_copy_stream()
        copy = device.copy_stream
        if to_host:
            device.launch(copy, run, reads=accesses, label=name)
        else:
            device.launch(copy, run, writes=accesses, label=name)
        return device.record(copy, f"{name} done")

    def collect(self, wait: bool = False) -> int:
        """End the copies that finished (every one with `wait`, blocking the host for them): each
        leaves the ledger. Returns how many ended. Ending a copy only drops stream waits its pages'
        next writers would queue; no capacity decision reads it."""
        device = self.storage.device
        done = 0
        wait = wait or self.lockstep
        for job in list(self.jobs):
            if wait:
                device.host_wait(job.done)
            elif not device.query(job.done):
                continue
            self.storage.end_host_transfer(job.transfer)
            self.jobs.remove(job)
            done += 1
        return done

    # -- the host index ------------------------------------------------------------------------------

    def _path_tokens(self, node: TreeNode) -> np.ndarray:
        keys = []
        walker = node
        while walker is not None and walker is not self.tree.root:
            keys.append(walker.key)
            walker = walker.parent
        return np.concatenate(keys[::-1]) if keys else np.empty(0, dtype=np.int32)

    def _free_record(self, digest: bytes) -> None:
        record = self.records.pop(digest)
        for sub_pool, hid in record.pages.items():
            self.host.pool(sub_pool).free(np.array([hid]))
        if record.state >= 0:
            self.host.pool(self.state.name).free(np.array([record.state]))
        self.stats["host_evictions"] += 1

    def _make_host_room(self, need: dict[int, tuple[HostPool, int]]) -> bool:
        """Free least recently used, unpinned host records (deepest first among equals) until every
        backing in `need` has its pages free. A state backing short of slots drops states only."""
        def short() -> list[HostPool]:
            return [pool for pool, n in need.values() if pool.n_free < n]

        if not short():
            return True
        state_pool = self.host.pool(self.state.name) if self.state is not None else None
        victims = sorted(((r.used, -r.depth, d) for d, r in self.records.items() if not r.pins))
        for _used, _depth, digest in victims:
            lacking = short()
            if not lacking:
                return True
            record = self.records[digest]
            if all(p is state_pool for p in lacking):
                if record.state >= 0:
                    state_pool.free(np.array([record.state]))
                    record.state = -1
                    self.stats["host_evictions"] += 1
                continue
            self._free_record(digest)
        return not short()

    # -- backups -------------------------------------------------------------------------------------

    def backup_node(self, node: TreeNode) -> int:
        """Copy to the host what `node` holds on the device and the host lacks: its owner pages, the
        window rows still bound, the state at its end. All of it or nothing (host pools too small
        even after evicting older records); returns the pages copied (state slots included)."""
        self.collect()
        if node is self.tree.root or node.n_pages == 0:
            return 0
        ps = self.ps
        tokens = self._path_tokens(node)
        first = node.start // ps
        digests = prefix_digests(tokens, ps, first + node.n_pages)[first:]
        existing = [self.records.get(d) for d in digests]
        wants: dict[str, list[int]] = {}  # sub-pool -> page indexes within the node to copy
        for j, rec in enumerate(existing):
            if rec is None or self.owner not in rec.pages:
                wants.setdefault(self.owner, []).append(j)
        for w, pool in enumerate(self.windows):
            for j in range(int(node.window_lo[w]), node.n_pages):
                rec = existing[j]
                if rec is None or pool.name not in rec.pages:
                    wants.setdefault(pool.name, []).append(j)
        state_wanted = node.state_slot >= 0 and (existing[-1] is None or existing[-1].state < 0)
        stamp = next(self._clock)
        for rec in existing:
            if rec is not None:
                rec.used = stamp
        if not wants and not state_wanted:
            return 0
        need: dict[int, tuple[HostPool, int]] = {}
        for sub_pool, js in wants.items():
            pool = self.host.pool(sub_pool)
            need[id(pool)] = (pool, need.get(id(pool), (pool, 0))[1] + len(js))
        if state_wanted:
            pool = self.host.pool(self.state.name)
            need[id(pool)] = (pool, need.get(id(pool), (pool, 0))[1] + 1)
        for rec in existing:
            if rec is not None:
                rec.pins += 1
        try:
            room = self._make_host_room(need)
        finally:
            for rec in existing:
                if rec is not None:
                    rec.pins -= 1
        if not room:
            self.stats["backup_skips"] += 1
            return 0
        physical, host_ids = {}, {}
        for sub_pool, js in wants.items():
            js = np.asarray(js, dtype=np.int64)
            physical[sub_pool] = self.storage.physical_pages(sub_pool, node.vpages[js])
            host_ids[sub_pool] = self.host.pool(sub_pool).alloc(len(js))
        if state_wanted:
            physical[self.state.name] = self.storage.physical_pages(self.state.name, np.array([node.state_slot]))
            host_ids[self.state.name] = self.host.pool(self.state.name).alloc(1)
        name = f"backup{next(self._names)}"
        done = self._launch(name, True, physical, host_ids)
        transfer = self.storage.record_host_transfer(name, False, physical, done)  # COPY_READ (HIC-2)
        for sub_pool, js in wants.items():
            for j, hid in zip(js, host_ids[sub_pool].tolist()):
                rec = existing[j]
                if rec is None:
                    rec = existing[j] = self.records[digests[j]] = HostRecord(first + j + 1, used=stamp)
                rec.pages[sub_pool] = hid
        if state_wanted:
            rec = existing[-1]
            if rec is None:
                rec = existing[-1] = self.records[digests[-1]] = HostRecord(first + node.n_pages, used=stamp)
            rec.state = int(host_ids[self.state.name][0])
        n = sum(len(v) for v in host_ids.values())
        self.jobs.append(CopyJob("backup", name, done, transfer, n))
        self.stats["backups"] += 1
        self.stats["backup_pages"] += sum(len(js) for js in wants.values())
        self.stats["backup_states"] += int(state_wanted)
        return n

    # -- loads ----------------------------------------------------------------------------------------

    def load_back(self, tokens: np.ndarray, wanted: Callable[[LoadPlan], bool] | None = None) -> PendingLoad | None:
        """Queue a load of what the host holds of `tokens` past what the device tree holds
        (`plan_load`). Takes the device pages (HIC-4/5), binds them into the tree and names the
        window rows by owner ids (HIC-6); the copy waits for `start_loading`. `wanted`, when given,
        is asked first whether the request would use the load (admission's answer: a request it
        would abort with the match, or start over without it, would leave the load unread). None
        when the host has nothing useful, the load is not wanted or the device cannot make room;
        nothing is changed then."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        plan = self.plan_load(tokens)
        if plan is None:
            return None
        if wanted is not None and not wanted(plan):
            self.stats["loads_declined"] += 1
            return None
        return self._take_and_bind(tokens, plan)

    def plan_load(self, tokens: np.ndarray) -> LoadPlan | None:
        """The load of what the host holds of `tokens` past what the device tree holds: the longest
        run of host pages past the tree's deepest page on their path (for a model with state, up to
        the deepest host state in it, or a host state at a node end the device lost its state at),
        ending where a match can use it. None when the host has nothing useful. Takes nothing."""
        self.collect()
        tree, ps = self.tree, self.ps
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        n_tok = len(tokens) // ps
        if not self.records or not n_tok:
            return None
        path = tree._walk(tokens)
        d = sum(k for _n, k in path)
        digests = prefix_digests(tokens, ps, n_tok)
        run: list[HostRecord] = []
        for p in range(d, n_tok):
            rec = self.records.get(digests[p])
            if rec is None or self.owner not in rec.pages:
                break
            run.append(rec)
        ends = list(range(d + 1, d + len(run) + 1))
        if self.state is not None:
            ends = [d + i + 1 for i, r in enumerate(run) if r.state >= 0]
            if not ends:
                return self._plan_state_only(path, digests)
        servable = self._servable_end(path, run, d, ends)
        if servable is None:
            self.stats["load_skips"] += 1
            return None
        end, lows = servable
        return self._load_plan(path, d, end, run[: end - d], lows)

    def _load_plan(self, path, d: int, end: int, run: list[HostRecord], lows: list[int]) -> LoadPlan:
        pages = []
        for pool in self.plan.sub_pools:
            if pool.kind is PoolKind.STATE:
                pages.append(1)
            elif pool.kind is PoolKind.WINDOW:
                pages.append(end - lows[self.windows.index(pool)])
            else:
                pages.append(end - d)
        return LoadPlan(path, d, end, run, lows, tuple(pages), end * self.ps)

    def _servable_end(self, path, run: list[HostRecord], d: int, ends: list[int]) -> tuple[int, list[int]] | None:
        """The deepest of `ends` (page counts past which the host `run`, from page `d` on, could be
        loaded) that a match can reach, with each window's first loaded row: a match there reads
        each window's rows of its last window of tokens, from the host past `d` and from the device
        tree's `path` below it, so together they must hold them back to there. A run whose window
        rows were lost (retired on the device before the backup, or evicted from the tree since) is
        loaded only as far as a match can use it; loaded further, its pages came back and no match
        read them. None when no end serves."""
        ps = self.ps
        bound = []
        for w, pool in enumerate(self.windows):
            device = [np.arange(k) >= node.window_lo[w] for node, k in path]
            host = np.array([pool.name in r.pages for r in run], dtype=bool)
            bound.append(np.concatenate([*device, host]) if device else host)
        covered = self.tree._covered_ends(bound, d + len(run))  # where `match_prefix` may end
        for end in sorted(ends, reverse=True):
            if covered[end]:
                return end, [int(max(_first_bound_of_suffix(rows[:end]), need_from, d)) for rows, need_from in
                             zip(bound, (window_keep_from(end * ps, w.window, w.lifetime.chunked) // ps
                                         for w in self.windows))]
        return None

    def _plan_state_only(self, path, digests: list[bytes]) -> LoadPlan | None:
        """A host state at the end of a device node that lost its own (a `state` eviction)."""
        offset = 0
        best = None
        for node, k in path:
            offset += k
            if k == node.n_pages and node.state_slot < 0:
                rec = self.records.get(digests[offset - 1])
                if rec is not None and rec.state >= 0:
                    best = (offset, [rec])
        if best is None:
            return None
        end, run = best
        return self._load_plan(path, end, end, run, [end] * len(self.windows))

    def _take_and_bind(self, tokens, plan: LoadPlan) -> PendingLoad | None:
        tree, storage, ps = self.tree, self.storage, self.ps
        path, d, end, run, lows = plan.path, plan.d, plan.end, plan.run, plan.lows
        n = end - d
        with_state = self.state is not None
        demand = list(plan.pages)
        if load_ids_short(storage, n, int(with_state)):
            self.stats["load_skips"] += 1
            return None
        anchor = path[-1][0] if path else None
        window_lock = None
        if anchor is not None:
            tree.lock(anchor)
            if self.windows:
                # the device rows below `d` a match at `end` reads stay while the load makes room
                # (the lock splits the node the windows begin in, so the path is walked again)
                window_lock = tree.lock_window(anchor, end * ps)
                path = tree._walk(tokens[: d * ps])
        for rec in run:
            rec.pins += 1
        try:
            taken = take_load_pages(storage, demand) if evict_until_fits(storage, tree, demand) else None
        finally:
            if anchor is not None:
                tree.unlock_window(window_lock)
                tree.unlock(anchor)
        if taken is None:
            for rec in run:
                rec.pins -= 1
            self.stats["load_skips"] += 1
            return None
        vpages = storage.bind_loaded(self.owner, taken[self.owner][0])
        slot = int(storage.bind_loaded(self.state.name, taken[self.state.name][0])[0]) if with_state else -1
        prefix = np.concatenate([node.vpages[:k] for node, k in path]) if path else np.empty(0, dtype=np.int64)
        prefix = prefix[:d]
        window_lo = np.array(lows, dtype=np.int64)
        result: InsertResult = UnifiedRadixCache.insert(tree, tokens[: end * ps], np.concatenate([prefix, vpages]),
                                                        window_lo, slot)
        assert result.new_pages == n and not len(result.duplicates) and result.state_taken == with_state
        virtual = {self.owner: vpages}
        host = {self.owner: np.array([r.pages[self.owner] for r in run[:n]], dtype=np.int64)}
        for w, pool in enumerate(self.windows):
            lo = lows[w]
            if lo < end:
                rows = vpages[lo - d :]
                tree.name_loaded_window_rows_by_owner(pool.name, taken[pool.name][1], rows)  # HIC-6
                virtual[pool.name] = rows
                host[pool.name] = np.array([r.pages[pool.name] for r in run[lo - d : n]], dtype=np.int64)
        reservations = {self.owner: taken[self.owner][1]}
        if with_state:
            virtual[self.state.name] = np.array([slot], dtype=np.int64)
            host[self.state.name] = np.array([run[-1].state], dtype=np.int64)
            reservations[self.state.name] = taken[self.state.name][1]
        tree.lock(result.node)  # nothing evicts the node before its copy is submitted
        stamp = next(self._clock)
        for rec in run:
            rec.used = stamp
        load = PendingLoad(f"load{next(self._names)}", virtual, host, reservations, result.node, run,
                           d * ps if n else end * ps - 1)
        self.queue.append(load)
        return load

    def start_loading(self) -> list[CopyJob]:
        """Submit every queued load: translate its ids now (HIC-7), launch the copy on the copy
        stream after the forward stream (HIC-9), record it as a writer and end the reservations
        left, the record first so no instant leaves the pages covered by neither (HIC-8). The
        forward stream then waits the copy, so the next forward reads the loaded bytes."""
        storage = self.storage
        device = storage.device
        started = []
        queue, self.queue = self.queue, []
        for load in queue:
            physical = {name: storage.physical_pages(name, ids) for name, ids in load.virtual.items()}
            done = self._launch(load.name, False, physical, load.host)
            transfer = storage.record_host_transfer(load.name, True, physical, done)  # COPY_WRITE
            for name, reservation in load.reservations.items():
                storage.end_load_reservations(name, reservation)
            device.stream_wait(device.forward_stream, done)
            for rec in load.records:
                rec.pins -= 1
            self.tree.unlock(load.node)
            n_pages = len(load.virtual[self.owner])
            job = CopyJob("load", load.name, done, transfer, sum(len(v) for v in load.virtual.values()))
            self.jobs.append(job)
            started.append(job)
            self.stats["loads"] += 1
            self.stats["load_pages"] += n_pages
            self.stats["load_states"] += int(self.state is not None and self.state.name in load.virtual)
        return started

    def drop_host(self) -> int:
        """Free every host record no queued load reads (a host-tier reset); returns how many."""
        gone = [d for d, r in self.records.items() if not r.pins]
        for digest in gone:
            self._free_record(digest)
        return len(gone)

    # -- inspection ----------------------------------------------------------------------------------

    def host_pages_used(self) -> dict[str, int]:
        """Host pages per sub-pool the records hold (state: slots)."""
        out = {p.name: 0 for p in self.plan.sub_pools}
        for rec in self.records.values():
            for name in rec.pages:
                out[name] += 1
            if rec.state >= 0:
                out[self.state.name] += 1
        return out

    def verify(self) -> None:
        """Every host page is held by one record or free, in every backing."""
        counts: dict[int, int] = {}
        for rec in self.records.values():
            for name in rec.pages:
                key = id(self.host.pool(name))
                counts[key] = counts.get(key, 0) + 1
            if rec.state >= 0:
                key = id(self.host.pool(self.state.name))
                counts[key] = counts.get(key, 0) + 1
        for backing in self.host.backings:
            held = counts.get(id(backing), 0)
            if held + backing.n_free != backing.n_pages:
                raise CapacityError(f"host pool {backing.layout.sub_pools}: {held} held + {backing.n_free} free "
                                    f"!= {backing.n_pages} pages")


class HiRadixCache(UnifiedRadixCache):
    """The prefix tree with a host tier: evicted nodes are backed up first (write-back), or every
    insert is (write-through); a match first loads back what the host holds past the device tree."""

    def __init__(self, storage: KVStorage, host: HostPools, strategy: CheckpointStrategy = CheckpointStrategy.EXTRA_BUFFER,
                 checkpoint_interval: int | None = None, policy: WritePolicy = WritePolicy.WRITE_BACK) -> None:
        super().__init__(storage, strategy, checkpoint_interval)
        self.hicache = HiCacheController(storage, self, host, policy)

    def _evict(self, kind: str, node: TreeNode, freed: Evicted) -> None:
        self.hicache.backup_node(node)
        super()._evict(kind, node, freed)

    def insert(self, tokens: np.ndarray, vpages: np.ndarray, window_lo: np.ndarray, state_slot: int = -1) -> InsertResult:
        result = super().insert(tokens, vpages, window_lo, state_slot)
        if self.hicache.policy is WritePolicy.WRITE_THROUGH:
            self.hicache.backup_node(result.node)
        return result

    def match_prefix(self, tokens: np.ndarray, wanted: Callable[[LoadPlan], bool] | None = None) -> MatchResult:
        """The device tree's match after loading back what the host holds past it (`load_back`;
        `wanted`: whether the request would use that load)."""
        load = self.hicache.load_back(tokens, wanted)
        self.hicache.start_loading()
        match = super().match_prefix(tokens)
        if load is not None and match.length > load.serves_from:
            self.hicache.stats["host_hits"] += 1
        return match


def host_pages_per_state(plan: KVStoragePlan, checkpoint_interval: int | None) -> int:
    """Token pages per host state slot: one checkpoint interval, so a backed-up prefix finds a host
    state at each of its checkpoints."""
    if plan.state is None or not checkpoint_interval:
        return 1
    return max(1, checkpoint_interval // plan.page_size)


__all__ = ["CopyJob", "HiCacheController", "HiRadixCache", "HostRecord", "LoadPlan", "PendingLoad", "WritePolicy",
           "copy_pages", "host_pages_per_state", "prefix_digests"]
