"""`KVChainPool`: the scheduler's pool protocol over a `KVStorage`, the prefix tree and admission.

Per request it keeps: the row, the tree node it holds a lock on (its deepest shared prefix), the
window locks behind it, and a tracking state slot when the tree checkpoints recurrent state.

The checkpoint retention bound is exact (closing the reference design's known limitation): a
checkpoint the tree cannot take (no replacement tracking slot, or no slot at a lazy grid point,
even once the prefix cache made what room it could) is abandoned, not waited for: windows keep only the rows behind the latest grid point, so a request
never holds more window rows than `request_demand` priced (window + one interval + this pass's
tail), and a stall costs a cache entry, never memory.

A request that recomputes a prefix the tree holds but cannot match (its window rows were
evicted, WIN-9) hands that prefix to the tree in the step its chunk passes the prefix's end,
while its own window rows there are still bound, so the tree's copy is matchable again."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..alloc.demand import DemandPurpose, KVDemand, request_demand
from ..cache.checkpoints import default_checkpoint_interval
from ..cache.hicache import HiCacheController, HiRadixCache, WritePolicy, host_pages_per_state
from ..cache.radix import CheckpointStrategy, UnifiedRadixCache
from ..capacity import evict_until_fits, reclaimable_pages
from ..errors import CapacityError, InputError
from ..memory.host import HostPools
from ..plan import KVStoragePlan, PoolKind
from ..prefill_budget import (
    Admission,
    ChainPrefillBudget,
    Decision,
    ProjectedPrefillBudget,
    mamba_prefill_chunk_grid,
)
from ..requests import NO_SLOT
from ..sizing import pages_for
from ..storage import KVStorage
from ..units import format_bytes, is_integer
from .policies import ExactPolicy, SchedulePolicy
from .request import ScheduledRequest
from .steps import Forward, Launched, StepSequence


class PoolFull(Exception):
    """An extension the pool cannot serve even after it made what room it could; nothing changed."""


@dataclass(frozen=True)
class PoolStats:
    live_bytes: int  # bytes held by running requests and the prefix cache
    budget_bytes: int
    cached_bytes: int  # of live_bytes, what only the prefix cache holds

    @property
    def utilisation(self) -> float:
        return self.live_bytes / max(1, self.budget_bytes)


def pool_checkpoint_interval(plan: KVStoragePlan, interval: int | None,
                             strategy: CheckpointStrategy = CheckpointStrategy.EXTRA_BUFFER) -> int | None:
    """The checkpoint interval a pool over `plan` keeps: none without state or without a buffered
    strategy, else `interval`, or the plan's default (`default_checkpoint_interval`) when None."""
    if not isinstance(strategy, CheckpointStrategy):
        raise InputError(f"strategy must be a CheckpointStrategy, got {strategy!r}")
    if interval is not None and (not is_integer(interval) or interval < 1):
        raise InputError(f"checkpoint_interval must be None or a positive integer, got {interval!r}")
    if plan.state is None or strategy is CheckpointStrategy.NO_BUFFER:
        return None
    return default_checkpoint_interval(plan) if interval is None else int(interval)


class KVChainPool:
    name = "kvchain"

    def __init__(self, storage: KVStorage, *, prefix_cache: bool = True,
                 strategy: CheckpointStrategy = CheckpointStrategy.EXTRA_BUFFER,
                 checkpoint_interval: int | None = None, policy: SchedulePolicy | None = None) -> None:
        if not isinstance(prefix_cache, bool):
            raise InputError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        if policy is not None and not isinstance(policy, SchedulePolicy):
            raise InputError(f"policy must be a SchedulePolicy (such as ExactPolicy) or None, got {policy!r}")
        self.storage = storage
        self.chain = storage.allocator
        self.plan = storage.plan
        self.page_size = storage.page_size
        self.has_state = self.plan.state is not None
        self.strategy = strategy
        self.checkpoint_interval = pool_checkpoint_interval(self.plan, checkpoint_interval, strategy)
        self.tree = UnifiedRadixCache(storage, strategy, self.checkpoint_interval) if prefix_cache else None
        self.shares = prefix_cache
        #: what admission charges and who gives way on a full pool (default: exact reservation)
        self.policy = policy if policy is not None else ExactPolicy()
        self.tracking = self.has_state and prefix_cache and strategy is CheckpointStrategy.EXTRA_BUFFER
        #: a checkpoint is the state of the row when the chunk ending on the grid point was computed;
        #: a model-free pool (the simulator) may count the state at a grid point inside a chunk, as an
        #: engine whose kernel saves it there would; a pool that runs a model holds only what it computed
        self.exact_checkpoints = False
        #: take a step's checkpoints together (`_checkpoint_all`); the simulator takes them one by one,
        #: so its allocation order (and every number it reports) stays as it was
        self.batch_checkpoints = False
        self.stats_counters = {"clipped": 0, "checkpoints": 0, "checkpoint_stalls": 0, "window_retired": 0,
                               "windows_revived": 0}
        #: the one step sequence, synchronous: nothing runs ahead of the host in a simulation, and the
        #: simulator never flushes opportunistically (its numbers count no compaction between steps)
        self.steps: StepSequence[list[ScheduledRequest]] = StepSequence(storage, depth=0, on_processed=self._on_processed)
        #: the waiting request at the head of the queue and the locks on its cached match
        self._pin: tuple[ScheduledRequest, dict] | None = None

    # -- the host tier -------------------------------------------------------------------------------

    def enable_host_tier(self, budget_bytes: int, policy: WritePolicy = WritePolicy.WRITE_BACK,
                         max_groups: int | None = None) -> None:
        """Back the prefix tree with host pools of `budget_bytes` (the host tier): a node the tree
        evicts is copied to the host first, and a match loads back what the host holds past the
        device tree, state included. Only before anything is cached. `max_groups` caps the host
        groups (`memory.host.stage_host_groups`: pipeline stages hold as many pages each)."""
        if self.tree is None:
            raise InputError("a host tier backs the prefix cache: it needs prefix caching on")
        if self.tree.root.children:
            raise InputError("a host tier is set up before anything is cached")
        host = HostPools(self.plan, budget_bytes, max_groups=max_groups,
                         pages_per_state=host_pages_per_state(self.plan, self.checkpoint_interval))
        self.tree = HiRadixCache(self.storage, host, self.strategy, self.checkpoint_interval, policy)

    @property
    def hicache(self) -> HiCacheController | None:
        """The host tier's controller (None without one)."""
        return self.tree.hicache if isinstance(self.tree, HiRadixCache) else None

    # -- demand ----------------------------------------------------------------------------------------

    @property
    def min_chunk(self) -> int:
        """The smallest prefill chunk: one checkpoint interval when chunks are cut on the grid."""
        return self.checkpoint_interval or self.page_size

    def _demand_kwargs(self) -> dict:
        return {"checkpoint_interval": self.checkpoint_interval, "shares_prefixes": self.shares,
                "min_chunk": self.min_chunk, "tracking_slot": self.tracking}

    def arrival_check(self, req: ScheduledRequest) -> str | None:
        """Reject a request larger than an empty pool, with the numbers; clip max_new to memory and
        to the context length."""
        context = self.storage.table.context_len
        if req.input_len >= context:
            return f"rejected at arrival: {req.input_len} input tokens reach the context length {context}"
        if req.max_new > context - req.input_len:
            req.max_new = context - req.input_len
            req.output_len = min(req.output_len, req.max_new)
            self.stats_counters["clipped"] += 1
        clip = self.chain.max_new_tokens_for_memory(req.input_len, req.max_new, **self._demand_kwargs())
        if clip is None:
            d = request_demand(self.plan, DemandPurpose.CEILING, input_len=req.input_len, **self._demand_kwargs())
            need = sum(n * p.page_bytes for n, p in zip(d.pages, self.plan.sub_pools))
            return (f"rejected at arrival: {req.input_len} input tokens need {format_bytes(need)} "
                    f"({', '.join(f'{p.name} {n} pages' for p, n in zip(self.plan.sub_pools, d.pages) if n)}); "
                    f"an empty pool of {format_bytes(self.chain.layout.chain_bytes)} holds at most "
                    f"{self.chain.largest_input_for_memory(req.input_len, **self._demand_kwargs())} input tokens")
        if clip < req.max_new:
            req.max_new = clip
            req.output_len = min(req.output_len, max(clip, 1))
            self.stats_counters["clipped"] += 1
        return None

    def _reserve(self, running: list[ScheduledRequest]) -> KVDemand:
        """What running requests may still take, all together: the rest of their full-attention
        tokens (the rest of the prompt, and the output the policy keeps reserved) and a page per
        window for each one's next step (or the rest of its prompt); plus the policy's watermark."""
        watermark = self._watermark()
        if not running:
            return watermark
        ps = self.page_size
        n = len(running)
        held = self.storage.table.seq_lens[np.fromiter((r.row for r in running), np.int64, n)]  # this step's growth included
        prompt = np.maximum(np.fromiter((r.input_len for r in running), np.int64, n), held)
        out = np.fromiter((self.policy.reserve_output(r) for r in running), np.int64, n)
        have = (held + ps - 1) // ps
        prompt_left = np.maximum((prompt + ps - 1) // ps - have, 0)
        full = np.maximum((prompt + out + ps - 1) // ps - have, 0)
        total = int(full.sum())
        window = int(np.minimum(full, 1 + prompt_left).sum())
        pages = tuple(total if p.kind is PoolKind.FULL else window if p.kind is PoolKind.WINDOW else 0
                      for p in self.plan.sub_pools)
        return KVDemand(pages, total, 0) + watermark

    def _watermark(self) -> KVDemand:
        """The policy's watermark as full-attention pages kept free (a share of the chain's bytes)."""
        share = self.policy.watermark
        if share <= 0:
            return KVDemand.zero(len(self.plan.sub_pools))
        owner = self.plan.owner
        n = int(share * self.chain.layout.chain_bytes // max(owner.page_bytes, 1))
        return KVDemand(tuple(n if p is owner else 0 for p in self.plan.sub_pools), n, 0)

    def begin_pass(self, running: list[ScheduledRequest], frees_coming: bool) -> ChainPrefillBudget:
        if self.policy.projected:
            ps = self.page_size
            lens = self.storage.table.seq_lens[np.fromiter((r.row for r in running), np.int64, len(running))]
            return ProjectedPrefillBudget(
                self.storage, self._reserve(running), frees_coming, self.checkpoint_interval, self.shares,
                reclaimable_pages(self.storage, self.tree),
                lengths=[max(r.input_len, int(n)) for r, n in zip(running, lens)],
                remaining=[self.policy.reserve_output(r) for r in running],
                held=int(((lens + ps - 1) // ps).sum()), chunk_only=self.policy.chunk_only,
                tracking_slot=self.tracking, partial_slots=0 if any(r.prefilling for r in running) else 1)
        return ChainPrefillBudget(self.storage, self._reserve(running), frees_coming, self.checkpoint_interval,
                                  self.shares, reclaimable_pages(self.storage, self.tree),
                                  chunk_only=self.policy.chunk_only, tracking_slot=self.tracking)

    def next_chunk(self, req: ScheduledRequest, token_limit: int) -> int:
        limit = self._grid_cut(req.computed, req.input_len, token_limit)
        return mamba_prefill_chunk_grid(req.computed, limit, req.input_len, self.checkpoint_interval)

    def _grid_cut(self, start: int, input_len: int, limit: int) -> int:
        """With `exact_checkpoints`, a chunk that would run past the prompt's last grid point stops
        there, so the state at that point exists in the row when the tree takes it."""
        if not (self.exact_checkpoints and self.checkpoint_interval and self.tree is not None):
            return limit
        last = (input_len // self.checkpoint_interval) * self.checkpoint_interval
        return min(limit, last - start) if start < last < input_len else limit

    # -- room -----------------------------------------------------------------------------------------------

    def _make_room(self, pages: list[int]) -> bool:
        return evict_until_fits(self.storage, self.tree, pages)

    def _extend_demand(self, rows: np.ndarray, new_lens: np.ndarray) -> list[int]:
        table = self.storage.table
        ps = self.page_size
        grow = int((pages_for_arr(new_lens, ps) - pages_for_arr(table.seq_lens[rows], ps)).sum())
        need_slot = int((table.state_slot[rows] == NO_SLOT).sum())
        return [need_slot if p.kind is PoolKind.STATE else grow for p in self.plan.sub_pools]

    def extend(self, reqs: list[ScheduledRequest], new_lens: list[int]) -> None:
        """Grow each row to its new length; a step of one token per row (every decode) goes
        through `alloc_decode`, the storage's one-token path: the same takes in the same order."""
        storage = self.storage
        rows = np.fromiter((r.row for r in reqs), np.int64, len(reqs))
        lens = np.array(new_lens, dtype=np.int64)
        decode = bool((lens == storage.table.seq_lens[rows] + 1).all())

        def grow() -> None:
            if decode:
                storage.alloc_decode(rows)
            else:
                storage.alloc_extend(rows, lens)
        try:
            grow()
            return
        except CapacityError:
            pass
        if not self._make_room(self._extend_demand(rows, lens)):
            raise PoolFull("the pool cannot grow the running requests")
        try:
            grow()
        except CapacityError as e:
            raise PoolFull(str(e)) from e

    # -- retraction -----------------------------------------------------------------------------------

    def held_pages(self, reqs: list[ScheduledRequest]) -> np.ndarray:
        """Pages per band (state band: slots) each request would give back if it were retracted now:
        the pages past its tree-shared prefix (each window: those still bound there), its state slot
        and its tracking slot. Shape [len(reqs), bands]."""
        table = self.storage.table
        out = np.zeros((len(reqs), len(self.plan.sub_pools)), dtype=np.int64)
        for i, req in enumerate(reqs):
            own = table.own_pages(np.array([req.row]))
            for band in self.chain.bands:
                kind = band.pool.kind
                if kind is PoolKind.FULL:
                    out[i, band.pool.index] = len(own)
                elif kind is PoolKind.WINDOW:
                    out[i, band.pool.index] = int(np.count_nonzero(band.ids.v2p[own] >= 0))
                else:
                    out[i, band.pool.index] = int(table.state_slot[req.row] != NO_SLOT) + int(
                        req.pool_state.get("tracking", -1) >= 0)
        return out

    def growth_pages(self, reqs: list[ScheduledRequest], new_lens: list[int]) -> np.ndarray:
        """Pages per band each request's growth to its new length takes (as `extend` would)."""
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        table = self.storage.table
        grow = pages_for_arr(np.asarray(new_lens, dtype=np.int64), self.page_size) - pages_for_arr(
            table.seq_lens[rows], self.page_size)
        slot = (table.state_slot[rows] == NO_SLOT).astype(np.int64)
        return np.stack([slot if p.kind is PoolKind.STATE else grow for p in self.plan.sub_pools], axis=1)

    def retract_victims(self, plan: list[tuple[ScheduledRequest, int]], candidates: list[ScheduledRequest]
                        ) -> list[ScheduledRequest] | None:
        """The shortest prefix of `candidates` (in the policy's order) whose retraction lets the rest
        of the step's `plan` grow: for each prefix, `fits_after_frees` is asked whether what the
        others still need fits once the victims' pages and what the prefix cache could evict are
        given back. The walk stops at the first yes; None (retract nothing) when no prefix does."""
        reqs = [r for r, _ in plan]
        need = self.growth_pages(reqs, [n for _, n in plan]).sum(axis=0) if plan else np.zeros(
            len(self.plan.sub_pools), dtype=np.int64)
        index = {id(r): i for i, r in enumerate(reqs)}
        growth = self.growth_pages(reqs, [n for _, n in plan]) if plan else None
        held = self.held_pages(candidates)
        reclaim = np.asarray(reclaimable_pages(self.storage, self.tree) or (0,) * len(self.plan.sub_pools))
        freed = reclaim.copy()
        for k, victim in enumerate(candidates):
            freed = freed + held[k]
            i = index.get(id(victim))
            if i is not None:
                need = need - growth[i]
            if self.chain.fits_after_frees(need.tolist(), freed.tolist()):
                return candidates[: k + 1]
        return None

    def admit_victims(self, running: list[ScheduledRequest], req: ScheduledRequest, candidates: list[ScheduledRequest],
                      token_limit: int) -> list[ScheduledRequest] | None:
        """Priority preemption that asks admission: the shortest prefix of `candidates` (less
        important running requests, in the policy's order) such that `req` would be admitted, its
        first chunk included, once they are gone (their pages given back, their reservations
        dropped). None when no prefix makes room: nothing is preempted."""
        if not candidates:
            return None
        held = self.held_pages(candidates)
        reclaim = np.asarray(reclaimable_pages(self.storage, self.tree) or (0,) * len(self.plan.sub_pools))
        chunk = mamba_prefill_chunk_grid(0, token_limit, req.input_len, self.checkpoint_interval)
        if chunk <= 0:
            return None
        probe = ChainPrefillBudget(self.storage, KVDemand.zero(len(self.plan.sub_pools)), False,
                                   self.checkpoint_interval, self.shares, chunk_only=self.policy.chunk_only,
                                   tracking_slot=self.tracking)
        demand = probe._demand(req.input_len, self.policy.admit_output(req), 0, chunk)
        gone: set[int] = set()
        freed = reclaim.copy()
        for k, victim in enumerate(candidates):
            gone.add(id(victim))
            freed = freed + held[k]
            rest = [r for r in running if id(r) not in gone]
            total = self._reserve(rest) + demand
            if self.chain.admits(total, tuple(int(x) for x in freed)):
                return candidates[: k + 1]
        return None

    # -- admission --------------------------------------------------------------------------------------

    def try_admit(self, ctx: ChainPrefillBudget, req: ScheduledRequest, token_limit: int) -> Admission:
        try:
            return self._try_admit(ctx, req, token_limit)
        finally:
            if self.tree is not None:
                self.tree.hold_state_for_copy(None)

    def _try_admit(self, ctx: ChainPrefillBudget, req: ScheduledRequest, token_limit: int) -> Admission:
        storage = self.storage
        table = storage.table
        if self._pin is not None and self._pin[0] is not req:
            self.relieve()
        if not table.free_rows:
            return Admission(Decision.WAIT, reason="no free request row")
        state = {"node": None, "window_lock": None, "tracking": -1, "checkpoint": 0}
        match = None
        cached = 0
        if self.tree is not None:
            tokens = req.tokens(max(req.input_len - 1, 0))
            if self.hicache is not None:  # a load-back only for a request admission would keep it for
                match = self.tree.match_prefix(
                    tokens, wanted=lambda plan: self._keeps_load(ctx, req, token_limit, plan.tokens_served, plan.pages))
            else:
                match = self.tree.match_prefix(tokens)
            cached = match.length
            if cached:
                # lock what the match found at once: making room for this request must not evict it,
                # nor the state it is to copy (a lock keeps pages only)
                self.tree.lock(match.node)
                if match.state_slot >= 0:
                    self.tree.hold_state_for_copy(match.node)
                state["node"] = match.node
                state["window_lock"] = self.tree.lock_window(match.node, cached)
                state["checkpoint"] = cached
        if match is not None and not self.has_state and self.plan.windows:
            shared = self._shared_len(req)
            if shared > cached:  # the tree holds more of the prompt than it could match: revive it
                state["revive"] = shared
        self.relieve()  # the lock just taken (if any) replaces the one the request held while waiting
        if cached or self.hicache is not None:
            # what the match just locked is no longer reclaimable; and a host-tier match changes
            # the tree even when it finds nothing (its load-back evicts to make room, and what it
            # loads is the tree's), so the pass's figure from before it is stale either way
            ctx.reclaimable = reclaimable_pages(self.storage, self.tree)
        if match is not None and match.branch:
            if self.exact_checkpoints:  # the first chunk ends where the branch leaves the tree
                token_limit = min(token_limit, match.branch - cached)
            else:  # the model-free pool counts the state there as a kernel saving it would (`processed`)
                state["branch"] = match.branch
        token_limit = self._grid_cut(cached, req.input_len, token_limit)
        a = ctx.consider(req.input_len, self.policy.admit_output(req), cached, token_limit)
        if a.decision is Decision.ADMIT and not self._make_room(self._admit_demand(cached + a.chunk_len, cached)):
            ctx.withdraw(a)
            if cached or ctx._waiting_frees_memory():
                a = Admission(Decision.WAIT, reason="room for the first chunk is not there yet")
            else:  # the cache made what room it could and nothing else will give memory back (ADM-11)
                a = Admission(Decision.ABORT, reason=f"unschedulable: the first {a.chunk_len} tokens do not fit "
                                                     "the pool with nothing else in it")
        if a.decision is not Decision.ADMIT:
            if cached and (a.decision is Decision.ABORT or not ctx._waiting_frees_memory()):
                self._unlock(state)
                # the match itself pins what it would need: start over without it, from an emptied cache
                self.tree.hold_state_for_copy(None)
                self.tree.evict_all()
                ctx.reclaimable = reclaimable_pages(self.storage, self.tree)
                state.pop("branch", None)
                return self._admit_fresh(ctx, req, token_limit, state)
            if cached and a.decision is Decision.WAIT and self.policy.pins_waiting:
                self._pin = (req, state)  # the head keeps its match while it waits
            else:
                self._unlock(state)
            return a
        first = cached + a.chunk_len
        row = storage.alloc_row()
        try:
            if cached:
                storage.assign_prefix(row, match.vpages, cached, match.window_lo)
            storage.alloc_extend(np.array([row]), np.array([first]))
            if match is not None and match.state_slot >= 0:
                storage.copy_state(np.array([match.state_slot]), table.state_slot[[row]])
            if self.tracking:
                state["tracking"] = int(storage.alloc_state_slots(1)[0])
        except CapacityError:
            self._release(row, state)
            ctx.withdraw(a)
            return Admission(Decision.WAIT, reason="room for the first chunk is not there yet")
        ctx.took(a, self._taken(first, cached))
        ctx.reclaimable = reclaimable_pages(self.storage, self.tree)  # the take may have evicted some
        req.row = row
        req.cached = cached
        req.computed = first
        req.pool_state = state
        return a

    def _keeps_load(self, ctx: ChainPrefillBudget, req: ScheduledRequest, token_limit: int, served: int,
                    pages: tuple[int, ...]) -> bool:
        """Whether admission would keep the match a host load-back of `pages` (per sub-pool) brings,
        the request then cached up to `served` tokens, asked before the load takes anything: the
        load's pages as this pass's own demand. A request admission would abort with that match, or
        start over without it (the match pins what the request itself needs and nothing else will
        give memory back), would leave the loaded pages unread, and at a budget for one request
        every load went so."""
        cached = min(served, req.input_len - 1)
        if cached <= 0:
            return True
        reserve = ctx.reserve
        ctx.reserve = reserve + self._pages_demand(pages)
        try:
            a = ctx.consider(req.input_len, self.policy.admit_output(req), cached,
                             self._grid_cut(cached, req.input_len, token_limit))
        finally:
            ctx.reserve = reserve
        if a.decision is Decision.ADMIT:
            ctx.withdraw(a)
            return True
        return a.decision is Decision.WAIT and ctx._waiting_frees_memory()

    def _taken(self, first: int, cached: int) -> KVDemand:
        return self._pages_demand(self._admit_demand(first, cached))

    def _pages_demand(self, pages) -> KVDemand:
        """Pages taken per sub-pool as a demand: the owner's pages are its virtual ids, the state
        sub-pool's its slots."""
        return KVDemand(tuple(pages), pages[self.plan.owner.index], pages[self.plan.state.index] if self.has_state else 0)

    def _admit_fresh(self, ctx: ChainPrefillBudget, req: ScheduledRequest, token_limit: int, state: dict) -> Admission:
        """Admission with no cached prefix (after dropping a match that pinned the memory it needed)."""
        storage = self.storage
        a = ctx.consider(req.input_len, self.policy.admit_output(req), 0, token_limit)
        if a.decision is not Decision.ADMIT:
            return a
        if not self._make_room(self._admit_demand(a.chunk_len, 0)):
            return Admission(Decision.ABORT, reason=f"unschedulable: the first {a.chunk_len} tokens do not fit "
                                                   "an emptied pool")
        row = storage.alloc_row()
        state.update(checkpoint=0)
        try:
            storage.alloc_extend(np.array([row]), np.array([a.chunk_len]))
            if self.tracking:
                state["tracking"] = int(storage.alloc_state_slots(1)[0])
        except CapacityError:
            self._release(row, state)
            return Admission(Decision.ABORT, reason="unschedulable: the first chunk does not fit an emptied pool")
        ctx.took(a, self._taken(a.chunk_len, 0))
        ctx.reclaimable = reclaimable_pages(self.storage, self.tree)
        req.row, req.cached, req.computed, req.pool_state = row, 0, a.chunk_len, state
        return a

    def relieve(self) -> bool:
        """Give up the waiting head's hold on its cached match (so the cache may evict it when a
        running request needs the room). True when there was one."""
        if self._pin is None:
            return False
        _, state = self._pin
        self._pin = None
        self._unlock(state)
        return True

    def _admit_demand(self, first: int, cached: int) -> list[int]:
        ps = self.page_size
        grow = pages_for(first, ps) - pages_for(cached, ps)
        slots = (1 if self.has_state else 0) + (1 if self.tracking else 0)
        return [slots if p.kind is PoolKind.STATE else grow for p in self.plan.sub_pools]

    # -- the forward and after it ----------------------------------------------------------------------

    def forward(self, reqs: list[ScheduledRequest]) -> None:
        """Run the step's forward through the step sequence: launched and recorded (no kernels, its
        writes unknown), the write-after-read barrier, then processed at once (`processed`)."""
        self.steps.step(_NO_KERNELS, reqs, flush=False)

    def _on_processed(self, launched: Launched[list[ScheduledRequest]]) -> None:
        self.processed(launched.payload)

    def processed(self, reqs: list[ScheduledRequest]) -> None:
        storage = self.storage
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        checkpoints = None
        if self.checkpoint_interval and self.tree is not None:
            floor_at = self.tree.swa_retain_floor
            exact = self.exact_checkpoints
            due: list[tuple[ScheduledRequest, int]] = []
            floors = []
            for req in reqs:
                st = req.pool_state
                computed = req.computed
                grid = floor_at(computed)  # the latest grid point at or before it
                if "branch" in st:
                    branch = st["branch"]
                    if branch and branch <= computed:  # where later siblings will leave this branch
                        del st["branch"]
                        if st["checkpoint"] < branch < grid:
                            due.append((req, branch))
                if grid > st["checkpoint"]:
                    if grid == computed or not exact:
                        due.append((req, grid))
                    st["checkpoint"] = grid  # taken or abandoned: never waited for
                floors.append(st["checkpoint"])
            self._checkpoint_all(due)
            checkpoints = np.array(floors, dtype=np.int64)
        elif self.tree is not None and not self.has_state:
            for req in reqs:
                revive = req.pool_state.get("revive", 0)
                if revive and revive <= req.computed:  # this chunk recomputed the tree's prefix
                    del req.pool_state["revive"]
                    if revive > int(self.storage.table.shared_pages[req.row]) * self.page_size \
                            and self._hand_prefix_to_tree(req, revive, -1):
                        self.stats_counters["windows_revived"] += 1
                if req.computed == req.input_len and req.generated <= 1:  # its prompt's prefill just ended
                    self.cache_prefill(req)
        self.stats_counters["window_retired"] += storage.advance(rows, checkpoints)
        if self.tree is not None:
            for req in reqs:
                st = req.pool_state
                if st["window_lock"] is not None:
                    st["window_lock"] = self.tree.advance_window(st["window_lock"], req.computed)

    def _checkpoint_all(self, due: list[tuple[ScheduledRequest, int]]) -> None:
        """This step's checkpoints, in order. With `batch_checkpoints` (extra-buffer tracking), the
        replacement tracking slots are taken in one allocator operation and the state copies run
        as one `copy_state`, rather than one of each per checkpoint; when the slots cannot all be
        had at once, each checkpoint goes its own way (`checkpoint_into_tree`), making room or
        abandoning as it can."""
        if not due:
            return
        if not self.batch_checkpoints or len(due) == 1 or self.strategy is not CheckpointStrategy.EXTRA_BUFFER:
            for req, at in due:
                self.checkpoint_into_tree(req, at)
            return
        storage = self.storage
        try:
            spare = storage.alloc_state_slots(len(due)).tolist()
        except CapacityError:
            for req, at in due:
                self.checkpoint_into_tree(req, at)
            return
        copies: tuple[list[int], list[int]] = ([], [])
        unused = []
        counters = self.stats_counters
        for (req, at), replacement in zip(due, spare, strict=True):
            st = req.pool_state
            if self._hand_prefix_to_tree(req, at, st["tracking"], copies=copies):
                st["tracking"] = replacement
                counters["checkpoints"] += 1
            else:  # another request cached this prefix with its own pages first: keep ours
                unused.append(replacement)
                counters["checkpoint_stalls"] += 1
        if copies[0]:
            storage.copy_state(np.array(copies[0], dtype=np.int64), np.array(copies[1], dtype=np.int64))
        if unused:
            storage.free_state_slots(np.array(unused, dtype=np.int64))

    def checkpoint_into_tree(self, req: ScheduledRequest, at: int, source: int | None = None) -> None:
        """Hand the state at grid point `at` to the tree with the prefix behind it (WIN-14), if a
        slot can be had; otherwise abandon this checkpoint (the exact retention bound). `source`:
        the slot holding the state at `at` (default the row's own; a speculative round's scratch
        slot when the round went past `at`)."""
        storage = self.storage
        st = req.pool_state
        if self.strategy is CheckpointStrategy.EXTRA_BUFFER:
            slot = st["tracking"]
            replacement = self._take_state_slot()
            if replacement is None:
                self.stats_counters["checkpoint_stalls"] += 1
                return
        else:  # lazy: a slot only at the grid point
            # on a full pool the slot is made room for like any other take (CAP-2): the tree's least
            # recently used entries go, which on a state model are mostly pages no match can use
            # (a match needs a state); abandoning the checkpoint instead left the tree all pages
            slot = self._take_state_slot()
            if slot is None:
                self.stats_counters["checkpoint_stalls"] += 1
                return
            replacement = -1
        if not self._hand_prefix_to_tree(req, at, slot, source):
            # another request cached this prefix with its own pages first: keep ours, skip this one
            storage.free_state_slots(np.array([slot if replacement < 0 else replacement]))
            self.stats_counters["checkpoint_stalls"] += 1
            return
        if replacement >= 0:
            st["tracking"] = replacement
        self.stats_counters["checkpoints"] += 1

    def _shared_len(self, req: ScheduledRequest) -> int:
        """Tokens (whole pages) of `req`'s prompt the tree holds, usable as a match or not."""
        return self.tree.path_pages(req.tokens(max(req.input_len - 1, 0))) * self.page_size

    def _take_state_slot(self) -> int | None:
        """One state slot for a checkpoint, the prefix cache evicting what it must to make room
        (CAP-2); None when even that does not make room."""
        try:
            return int(self.storage.alloc_state_slots(1)[0])
        except CapacityError:
            if not self._make_room([1 if p.kind is PoolKind.STATE else 0 for p in self.plan.sub_pools]):
                return None
            return int(self.storage.alloc_state_slots(1)[0])

    def cache_prefill(self, req: ScheduledRequest) -> None:
        """Once a prompt is prefilled (a model without recurrent state), hand its whole pages to the
        tree, as engines cache an unfinished request: requests that arrive while it decodes match
        its prompt (a model with state matches only where the tree holds a state). Once per
        request, not after every chunk: each insert walks the prefix from the root."""
        at = (req.computed // self.page_size) * self.page_size
        if at > int(self.storage.table.shared_pages[req.row]) * self.page_size:
            self._hand_prefix_to_tree(req, at, -1)

    def _hand_prefix_to_tree(self, req: ScheduledRequest, at: int, slot: int, source: int | None = None,
                             copies: tuple[list[int], list[int]] | None = None) -> bool:
        """Insert the row's first `at` tokens (whole pages) with state `slot` (-1: none), hand their
        pages to the tree and move the row's locks there (where the tree holds part of that prefix
        under other pages, the row moves onto them). False, with nothing changed, when the tree
        cannot take it (`UnifiedRadixCache.insert_running`). `copies`: (sources, destinations) the
        state copy is queued on for the caller to run, instead of copying at once."""
        storage = self.storage
        table = storage.table
        st = req.pool_state
        row = req.row
        n = at // self.page_size
        result = self.tree.insert_running(row, req.tokens(at), slot)
        if result is None:
            return False
        assert (slot < 0 or result.state_taken) and not len(result.duplicates)
        if slot >= 0:
            src = int(table.state_slot[row]) if source is None else source
            if copies is not None:
                copies[0].append(src)
                copies[1].append(slot)
            else:
                storage.copy_state(np.array([src]), np.array([slot]))  # the state at the grid point
        storage.release_to_tree(row, n)
        if slot >= 0 and at > req.prompt_len:
            self.tree.supersede_output_checkpoint(result.node, req.prompt_len)
        self.tree.lock(result.node)
        if st["node"] is not None:
            self.tree.unlock(st["node"])
        st["node"] = result.node
        self.tree.unlock_window(st["window_lock"])
        st["window_lock"] = self.tree.lock_window(result.node, at)
        return True

    # -- the end of a request --------------------------------------------------------------------------

    def finish(self, req: ScheduledRequest) -> None:
        self._cache_and_free(req, end_state=self.strategy is CheckpointStrategy.NO_BUFFER and self.has_state)

    def preempt(self, req: ScheduledRequest) -> None:
        self._cache_and_free(req, end_state=False)

    def _cache_and_free(self, req: ScheduledRequest, end_state: bool) -> None:
        storage = self.storage
        table = storage.table
        row = req.row
        st = req.pool_state
        if self.tree is not None:
            n = int(table.seq_lens[row]) // self.page_size
            shared = int(table.shared_pages[row])
            if n > shared:
                slot = int(table.state_slot[row]) if end_state and n * self.page_size == table.seq_lens[row] else -1
                result = self.tree.insert(req.tokens(n * self.page_size), table.page_table[row, :n].copy(),
                                          table.window_lo[row], slot)
                storage.release_to_tree(row, n, result.duplicates)
                if result.state_taken:
                    table.state_slot[row] = NO_SLOT
        self._release(row, st)

    def _unlock(self, st: dict) -> None:
        if self.tree is not None:
            self.tree.unlock_window(st["window_lock"])
            if st["node"] is not None:
                self.tree.unlock(st["node"])
        st.update(node=None, window_lock=None)

    def _release(self, row: int, st: dict) -> None:
        self._unlock(st)
        if st.get("tracking", -1) >= 0:
            self.storage.free_state_slots(np.array([st["tracking"]]))
        st["tracking"] = -1
        self.storage.free_rows(np.array([row]))

    # -- stats ---------------------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        bands = self.chain.bands
        live = sum(b.n_live * b.page_bytes for b in bands)
        cached = 0
        if self.tree is not None:
            held = self.tree.held_pages()
            cached = sum(held[b.name] * b.page_bytes for b in bands)
        return PoolStats(live, self.storage.sizing.budget_bytes, cached)

    def check_idle(self) -> None:
        if self.hicache is not None:
            self.hicache.collect(wait=True)  # every host copy ends, so the ledger is empty
        held = self.tree.held_pages() if self.tree is not None else None
        self.steps.check_idle(held)


#: the simulator's forward: no kernel runs, only the sequence's bookkeeping
_NO_KERNELS = Forward(lambda step: None)


def pages_for_arr(tokens: np.ndarray, page_size: int) -> np.ndarray:
    return (np.asarray(tokens) + page_size - 1) // page_size


def _negate(d: KVDemand) -> KVDemand:
    return KVDemand(tuple(-p for p in d.pages), -d.virtual_pages, -d.state_slots)

