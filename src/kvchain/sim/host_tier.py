"""The host tier in the simulator (`kvchain simulate --host-budget BYTES`): a host pool of that
many bytes behind a pool's prefix tree, as a hierarchical cache (HiCache) keeps one.

* **Backup** (write-back): what the device tree evicts is copied to the host first: a leaf's
  full-attention pages and the window rows it still binds, a node's window rows, a state slot
  (a checkpoint or a sequence end). Each is a host entry named by the token prefix it ends (a
  chained hash of whole pages), least recently used out first when the host is full.
* **Load-back on a match**: before a waiting request is admitted, the longest prefix the device
  and the host hold together (attention pages behind it, every window's rows behind its end, and
  on a model with state a state at exactly that end) is loaded into the device tree when it is
  longer than what the device alone matches; the request then matches it as a hit. Tokens it
  gets that way are host hits (`host_hit_tokens`, beside the device's).
* **Swap of retracted requests**: a retracted request's pages and state go to the host (reserved
  there, never evicted) instead of being dropped; when it is admitted again it gets them back
  (its computed tokens less what the device tree still matches come from the host), so it
  recomputes at most the one token every admission computes instead of its whole length. When
  the host cannot hold it, it recomputes as without a host tier.

Every copy, either way, is counted in bytes (`copied_bytes`); the step-time model charges them
at its host bandwidth (`StepTimeModel.per_host_byte_ps`). Steps do not: a copy overlaps no
compute in steps, which only count the scheduler's loop. No bytes exist in the simulator (a
`meta` arena), so a copy is bookkeeping: the device pages are allocated and entered in the
tree and the request table as a real copy's would be."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..advance import window_keep_from
from ..capacity import reclaimable_pages
from ..engine.pool import KVChainPool
from ..engine.request import ScheduledRequest
from ..errors import CapacityError, InputError
from ..plan import PoolKind
from ..prefill_budget import Admission, ChainPrefillBudget, Decision
from ..requests import NO_SLOT
from ..sizing import pages_for


def page_hashes(tokens: np.ndarray, page_size: int) -> list[int]:
    """Chained hash per whole page: entry k names the prefix of pages 0..k (as engines name KV
    blocks), so equal keys mean equal prefixes."""
    tokens = np.asarray(tokens, dtype=np.int32)
    out = []
    h = 0
    for k in range(len(tokens) // page_size):
        h = hash((h, tokens[k * page_size:(k + 1) * page_size].tobytes()))
        out.append(h)
    return out


class HostTier:
    """A host pool of `capacity` bytes: cached entries (least recently used first out) and swap
    reservations of retracted requests (never evicted)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise InputError(f"host tier: capacity must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[tuple, int] = OrderedDict()
        self.cached_bytes = 0
        self.swap_bytes = 0
        self.version = 0  # moves whenever an entry comes or goes
        self.stats = {"backed_up_bytes": 0, "host_evicted_bytes": 0, "backup_refused": 0}

    @property
    def used(self) -> int:
        return self.cached_bytes + self.swap_bytes

    def _room(self, nbytes: int) -> bool:
        """Evict cached entries, least recently used first, until `nbytes` more fit."""
        if nbytes > self.capacity - self.swap_bytes:
            return False
        while self.used + nbytes > self.capacity:
            _key, size = self.entries.popitem(last=False)
            self.cached_bytes -= size
            self.stats["host_evicted_bytes"] += size
            self.version += 1
        return True

    def put(self, key: tuple, nbytes: int) -> int:
        """Back up one entry; returns the bytes copied (0: already there, or refused)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return 0
        if not self._room(nbytes):
            self.stats["backup_refused"] += 1
            return 0
        self.entries[key] = nbytes
        self.cached_bytes += nbytes
        self.stats["backed_up_bytes"] += nbytes
        self.version += 1
        return nbytes

    def has(self, key: tuple) -> bool:
        return key in self.entries

    def touch(self, key: tuple) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def reserve_swap(self, nbytes: int) -> bool:
        if not self._room(nbytes):
            return False
        self.swap_bytes += nbytes
        return True

    def release_swap(self, nbytes: int) -> None:
        self.swap_bytes -= nbytes
        assert self.swap_bytes >= 0, "unbalanced host swap reservation"


@dataclass
class _Swapped:
    tokens: int  # computed tokens at retraction: what the host gives back
    reserved: int  # host bytes held for it


@dataclass(frozen=True)
class _Load:
    """A planned load-back: the device matches `device` pages, the host extends it to `pages`."""

    device: int
    pages: int
    copy_bytes: int
    keys: tuple


class HostTierPool(KVChainPool):
    """A `KVChainPool` with a host tier (module doc). Made from a built pool by `with_host_tier`."""

    host: HostTier

    def _init_host(self, capacity: int, swap: bool = True) -> None:
        self.host = HostTier(capacity)
        self.swap = swap
        plan = self.plan
        self._owner_bytes = plan.owner.page_bytes if plan.owner.unit_bytes else 0
        self._windows = [p for p in plan.sub_pools if p.kind is PoolKind.WINDOW]
        self._state_bytes = plan.state.page_bytes if plan.state is not None else 0
        self._swapped: dict[ScheduledRequest, _Swapped] = {}
        self._hashes: dict[ScheduledRequest, tuple[int, list[int]]] = {}
        self._plans: dict[ScheduledRequest, tuple[tuple, _Load | None]] = {}
        self._loaded: dict[ScheduledRequest, tuple[int, int]] = {}
        self.host_counters = {"host_hit_tokens": 0, "loads": 0, "loaded_bytes": 0, "swapped_out": 0,
                              "swapped_tokens": 0, "swap_refused": 0, "copied_bytes": 0}
        if self.tree is not None:
            self.tree.on_evict = self._backup

    # -- backup ------------------------------------------------------------------------------------

    def _node_hashes(self, node) -> list[int]:
        parts = []
        walker = node
        while walker.parent is not None:
            parts.append(walker.key)
            walker = walker.parent
        return page_hashes(np.concatenate(parts[::-1]), self.page_size)

    def _backup(self, kind: str, node) -> None:
        """The tree is about to evict `node` as `kind`: copy what it gives back to the host."""
        hashes = self._node_hashes(node)
        first = node.start // self.page_size
        copied = 0
        if kind == "leaf":
            for p in range(node.n_pages):
                copied += self.host.put(("kv", hashes[first + p]), self._owner_bytes)
        if kind in ("leaf", "window"):
            for w, pool in enumerate(self._windows):
                for p in range(int(node.window_lo[w]), node.n_pages):
                    copied += self.host.put(("win", w, hashes[first + p]), pool.page_bytes)
        if kind in ("leaf", "state") and node.state_slot >= 0:
            copied += self.host.put(("state", hashes[-1]), self._state_bytes)
        self.host_counters["copied_bytes"] += copied

    # -- load-back on a match ------------------------------------------------------------------------

    def _prompt_hashes(self, req: ScheduledRequest, tokens: np.ndarray) -> list[int]:
        memo = self._hashes.get(req)
        if memo is None or memo[0] != len(tokens):
            memo = (len(tokens), page_hashes(tokens, self.page_size))
            self._hashes[req] = memo
        return memo[1]

    def plan_load(self, req: ScheduledRequest) -> _Load | None:
        """The load-back that extends `req`'s device match furthest, or None (module doc)."""
        tree = self.tree
        ps = self.page_size
        tokens = req.tokens(max(req.input_len - 1, 0))
        n = len(tokens) // ps
        if tree is None or not n or not self.host.entries:
            return None
        stats = tree.stats
        version = (self.host.version, stats["inserted_pages"], stats["evicted_pages"],
                   stats["evicted_window_pages"], stats["evicted_state_slots"], len(tokens))
        memo = self._plans.get(req)
        if memo is not None and memo[0] == version:
            return memo[1]
        hashes = self._prompt_hashes(req, tokens)
        path = tree._walk(tokens)
        shared = sum(k for _n, k in path)
        bound = [np.concatenate([np.arange(k) >= node.window_lo[w] for node, k in path]) if path
                 else np.zeros(0, dtype=bool) for w in range(len(self._windows))]
        device = 0
        if path:
            covered = tree._covered_ends(bound, shared)
            device = next(iter(tree._candidate_ends(path, covered)), (0, 0))[0]
        reach = shared
        host = self.host
        while reach < n and host.has(("kv", hashes[reach])):
            reach += 1
        plan = None
        for end in range(reach, device, -1):
            keys = [("kv", hashes[p]) for p in range(shared, end)]
            copy = self._owner_bytes * (end - shared)
            if tree.state is not None:
                if not host.has(("state", hashes[end - 1])):
                    continue
                keys.append(("state", hashes[end - 1]))
                copy += self._state_bytes
            ok = True
            for w, pool in enumerate(self._windows):
                lo = int(window_keep_from(np.int64(end * ps), pool.window, pool.lifetime.chunked)) // ps
                for p in range(lo, end):
                    if p < shared and bound[w][p]:
                        continue
                    if not host.has(("win", w, hashes[p])):
                        ok = False
                        break
                    keys.append(("win", w, hashes[p]))
                    copy += pool.page_bytes
                if not ok:
                    break
            if ok:
                plan = _Load(device, end, copy, tuple(keys))
                break
        self._plans[req] = (version, plan)
        return plan

    def _load_pages(self, plan: _Load) -> tuple[int, ...]:
        """What a planned load takes per sub-pool: a state slot, and every token sub-pool's pages past
        the device's (what `_load` allocates its row beyond the match)."""
        return tuple(1 if p.kind is PoolKind.STATE else plan.pages - plan.device for p in self.plan.sub_pools)

    def _load(self, req: ScheduledRequest, plan: _Load) -> bool:
        """Copy the planned prefix into the device tree (a row that holds it for a moment, handed
        to the tree whole with its state at the end). False, with the tree as it was, when the
        device cannot make room."""
        tree, storage = self.tree, self.storage
        table = storage.table
        ps = self.page_size
        if not table.free_rows:
            return False
        tokens = req.tokens(plan.pages * ps)
        match = tree.match_prefix(tokens)
        if match.length:
            tree.lock(match.node)
        path = tree._walk(tokens)
        deep = path[-1][0] if path else None
        if deep is not None:
            tree.lock(deep)  # the device pages the load builds on stay while room is made
        start = match.length // ps
        need = [1 if p.kind is PoolKind.STATE else plan.pages - start for p in self.plan.sub_pools]
        row = -1
        try:
            if not self._make_room(need):
                return False
            row = storage.alloc_row()
            if match.length:
                storage.assign_prefix(row, match.vpages, match.length, match.window_lo)
            storage.alloc_extend(np.array([row]), np.array([plan.pages * ps]))
        except CapacityError:
            return False
        finally:
            if deep is not None:
                tree.unlock(deep)
            if match.length:
                tree.unlock(match.node)
            if row >= 0 and int(table.seq_lens[row]) < plan.pages * ps:
                storage.free_rows(np.array([row]))
        rows = np.array([row])
        grid = tree.swa_retain_floor(plan.pages * ps)
        storage.advance(rows, None if grid is None else np.array([grid]))
        slot = int(table.state_slot[row]) if self.has_state else -1
        result = tree.insert(tokens, table.page_table[row, :plan.pages].copy(), table.window_lo[row], slot)
        storage.release_to_tree(row, plan.pages, result.duplicates)
        if result.state_taken:
            table.state_slot[row] = NO_SLOT
        storage.free_rows(rows)
        for key in plan.keys:
            self.host.touch(key)
        self.host_counters["loads"] += 1
        self.host_counters["loaded_bytes"] += plan.copy_bytes
        self.host_counters["copied_bytes"] += plan.copy_bytes
        return True

    # -- admission -----------------------------------------------------------------------------------

    def try_admit(self, ctx: ChainPrefillBudget, req: ScheduledRequest, token_limit: int) -> Admission:
        if req in self._swapped:
            return self._swap_in(ctx, req, token_limit)
        plan = self.plan_load(req)
        if plan is not None and self._keeps_load(ctx, req, token_limit, plan.pages * self.page_size,
                                                 self._load_pages(plan)) and self._load(req, plan):
            self._loaded[req] = (plan.device * self.page_size, plan.pages * self.page_size)
            ctx.reclaimable = reclaimable_pages(self.storage, self.tree)
        a = super().try_admit(ctx, req, token_limit)
        if a.decision is Decision.ADMIT:
            loaded = self._loaded.pop(req, None)
            if loaded is not None and not req.preemptions:
                self.host_counters["host_hit_tokens"] += max(0, min(req.cached, loaded[1]) - loaded[0])
            self._plans.pop(req, None)
            self._hashes.pop(req, None)
        return a

    # -- swap of retracted requests ------------------------------------------------------------------

    def preempt(self, req: ScheduledRequest) -> None:
        if not self.swap:
            return super().preempt(req)
        table = self.storage.table
        computed = int(table.seq_lens[req.row])
        held = self.held_pages([req])[0]
        out = self._owner_bytes * int(held[self.plan.owner.index]) + sum(
            int(held[w.index]) * w.page_bytes for w in self._windows) + self._state_bytes
        reserve = self._owner_bytes * pages_for(computed, self.page_size) + self._state_bytes + sum(
            w.page_bytes * self._window_pages(computed, w) for w in self._windows)
        if not computed or not self.host.reserve_swap(reserve):
            self.host_counters["swap_refused"] += 1
            return super().preempt(req)
        self._swapped[req] = _Swapped(computed, reserve)
        self.host_counters["swapped_out"] += 1
        self.host_counters["copied_bytes"] += out
        self._release(req.row, req.pool_state)  # the device pages go back; the host holds them

    def _window_pages(self, length: int, pool) -> int:
        ps = self.page_size
        lo = int(window_keep_from(np.int64(length), pool.window, pool.lifetime.chunked)) // ps
        return max(pages_for(length, ps) - lo, 0)

    def _drop_swap(self, req: ScheduledRequest) -> None:
        swapped = self._swapped.pop(req)
        self.host.release_swap(swapped.reserved)

    def _swap_in(self, ctx: ChainPrefillBudget, req: ScheduledRequest, token_limit: int) -> Admission:
        """Admit a swapped-out request with its computed tokens back from the host: what the device
        tree still matches is shared, the rest copied in; it computes the one token every admission
        computes (or the rest of its prompt, when it was retracted mid-prefill)."""
        storage, tree = self.storage, self.tree
        table = storage.table
        ps = self.page_size
        swapped = self._swapped[req]
        if self._pin is not None:
            self.relieve()
        if not table.free_rows:
            return Admission(Decision.WAIT, reason="no free request row")
        state = {"node": None, "window_lock": None, "tracking": -1, "checkpoint": 0}
        cached = min(swapped.tokens, req.input_len - 1)
        match = None
        device = 0
        if tree is not None and cached >= ps:
            match = tree.match_prefix(req.tokens(cached))
            device = match.length
            if device:
                tree.lock(match.node)
                state["node"] = match.node
                state["window_lock"] = tree.lock_window(match.node, device)
                ctx.reclaimable = reclaimable_pages(storage, tree)
        a = ctx.consider(req.input_len, self.policy.admit_output(req), cached, token_limit)
        if a.decision is Decision.ADMIT and not self._make_room(self._admit_demand(cached + a.chunk_len, device)):
            ctx.withdraw(a)
            a = Admission(Decision.WAIT, reason="room for the swapped-in pages is not there yet")
        if a.decision is not Decision.ADMIT:
            self._unlock(state)
            if a.decision is Decision.ABORT or not ctx._waiting_frees_memory():
                self._drop_swap(req)  # nothing will make room for it: recompute as without a host tier
                return super().try_admit(ctx, req, token_limit)
            return a
        first = cached + a.chunk_len
        row = storage.alloc_row()
        try:
            if device:
                storage.assign_prefix(row, match.vpages, device, match.window_lo)
            storage.alloc_extend(np.array([row]), np.array([first]))
            if self.tracking:
                state["tracking"] = int(storage.alloc_state_slots(1)[0])
        except CapacityError:
            self._release(row, state)
            ctx.withdraw(a)
            return Admission(Decision.WAIT, reason="room for the swapped-in pages is not there yet")
        ctx.took(a, self._taken(first, device))
        grid = tree.swa_retain_floor(first) if tree is not None else None
        if grid is not None:
            state["checkpoint"] = grid
        storage.advance(np.array([row]), None if grid is None else np.array([grid]))
        ctx.reclaimable = reclaimable_pages(storage, tree)
        back = self._owner_bytes * (pages_for(cached, ps) - device // ps) + self._state_bytes + sum(
            w.page_bytes * self._window_pages(cached, w) for w in self._windows)
        self.host_counters["copied_bytes"] += back
        self.host_counters["swapped_tokens"] += cached - device
        self._drop_swap(req)
        req.row, req.cached, req.computed, req.pool_state = row, cached, first, state
        return a

    # -- reporting -------------------------------------------------------------------------------------

    def host_report(self) -> dict:
        return {**self.host_counters, **self.host.stats, "host_budget": self.host.capacity}


def with_host_tier(pool: KVChainPool, capacity: int, swap: bool = True) -> HostTierPool:
    """`pool` with a host tier of `capacity` bytes behind its prefix tree (and swap of retracted
    requests unless `swap` is False)."""
    pool.__class__ = HostTierPool
    pool._init_host(capacity, swap)
    return pool
