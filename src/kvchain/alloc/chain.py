"""`ChainAllocator`: one allocator over every band of the arena.

It answers every capacity question (one layout search on a host-only snapshot) and performs every
chain allocation. A take plans in place first; when that is short and some layout serves the
demand, it enters urgent recovery (settle every pending batch, park empty floats), plans the least
rearrangement, realizes it (compact the ends, relocate floats in `move_order`), then takes each
band's pages in chain order. When no layout serves the demand it refuses before anything moves."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import env
from ..capacity import capacity_decision, observe_only_read
from ..device.base import Device, Event
from ..errors import CapacityError, InvariantError
from ..memory.arena import KVArena
from ..memory.copy import PageCopier
from ..plan import KVStoragePlan, Placement, PoolKind
from .band import HOLE, LIVE, OUT, PENDING, SINK, VACATED, Band, CapacityEpoch, FloatBand, SnapshotMode
from .demand import DemandPurpose, KVDemand, request_demand
from .forward_steps import ForwardSteps, LaunchRecord
from .id_space import UNBOUND, IdStack
from .invariants import check_windows_released
from .page_usage import CLEARANCE, Clear, Consumer, Hazard, PageUse
from .pricing import (
    ChainSnapshot,
    LayoutPlan,
    Step,
    feasible,
    first_plan,
    plan,
    reclaimed_snapshot,
    take_layout,
)
from .signals import HostTransfer, NetworkTransfer, NetworkTransferWaiter

log = logging.getLogger("kvchain.chain")

_NO_PAGES = np.empty(0, dtype=np.int64)
_NO_PAGES.flags.writeable = False


@dataclass(eq=False)
class Fence:
    """Bytes that left a band while a use of them was unfinished: whichever band next writes them
    clears the use first (COMP-20)."""

    lo: int
    hi: int
    use: PageUse


class ChainAllocator:
    """Every band of one arena, in chain order (up end, floats, down end = full-attention owner)."""

    def __init__(self, plan: KVStoragePlan, arena: KVArena, device: Device, *, scratch_bytes: int) -> None:
        self.plan = plan
        self.arena = arena
        self.device = device
        self.layout = arena.layout
        self.epoch = CapacityEpoch()
        self.forward_steps = ForwardSteps(self)
        self.move_epoch = 0
        self.copier = PageCopier(arena, device, scratch_bytes)
        owner_grid = self.layout.grids[plan.owner.index]
        self.n_virtual = owner_grid.n_grid + 1  # virtual page 0 is the null page: it reads the sink
        self.bands: list[Band] = []
        for pool, grid in zip(plan.sub_pools, self.layout.grids):
            cls = FloatBand if pool.placement is Placement.FLOAT else Band
            n_virtual = grid.n_grid if pool.kind is PoolKind.STATE else self.n_virtual
            self.bands.append(cls(pool, grid, self, n_virtual))
        self.owner = self.bands[-1]
        self.window_bands = [b for b in self.bands if b.pool.kind is PoolKind.WINDOW]
        self.token_bands = [b for b in self.bands if b.pool.kind is not PoolKind.STATE]
        self.state_band = next((b for b in self.bands if b.pool.kind is PoolKind.STATE), None)
        #: the token bands' read maps side by side, a row per virtual id: one gather translates a
        #: page for every token band at once (about 1.5x faster than a gather per band); each
        #: band's `ids.read_map` is its column
        self.token_read_maps = np.stack([b.ids.read_map for b in self.token_bands], axis=1)
        for k, band in enumerate(self.token_bands):
            band.ids.read_map = self.token_read_maps[:, k]
        self.virtual_free = IdStack(self.n_virtual, np.arange(self.n_virtual - 1, 0, -1, dtype=np.int64))
        n_slots = self.state_band.grid.n_grid if self.state_band is not None else 0
        self.slot_free = IdStack(n_slots, np.arange(n_slots - 1, -1, -1, dtype=np.int64))
        #: most live pages per band (chain order), or None: with caps the chain emulates fixed
        #: per-kind pools that cannot borrow each other's bytes (the static baselines)
        self.caps: tuple[int, ...] | None = None
        self._memo: dict[SnapshotMode, ChainSnapshot] = {}
        self.fences: list[Fence] = []
        self.waiter = NetworkTransferWaiter(device)
        #: when a list, every decision (pages chosen, frontiers, moves, waits) is appended to it
        self.decisions: list | None = None
        #: read once at construction, like the rest of the pool's configuration
        self.max_moves_per_call = int(env.get("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL"))
        self.log_compaction_stats = bool(env.get("KVCHAIN_LOG_LAZY_COMPACTION_STATS"))
        self.compaction_gap_fraction = float(env.get("KVCHAIN_LAZY_COMPACTION_GAP_FRACTION"))

    # -- snapshots ----------------------------------------------------------------------------

    def neighbour_bounds(self, index: int) -> tuple[int, int]:
        """Bytes between which band `index` may grow: the nearest placed neighbours' frontiers."""
        prev_top = self.layout.chain_lo
        for band in reversed(self.bands[:index]):
            if not band.parked:
                prev_top = band.top
                break
        next_bottom = self.layout.arena_bytes
        for band in self.bands[index + 1 :]:
            if not band.parked:
                next_bottom = band.bottom
                break
        return prev_top, next_bottom

    def snapshot(self, mode: SnapshotMode = SnapshotMode.TAKE) -> ChainSnapshot:
        return ChainSnapshot(
            tuple(b.snapshot(mode) for b in self.bands),
            self.layout.chain_lo,
            self.layout.arena_bytes,
            self.epoch.value,
            self.forward_steps.newest_unprocessed() is not None,
        )

    def pricing_snapshot(self, mode: SnapshotMode = SnapshotMode.EVERY_BYTE) -> ChainSnapshot:
        """The snapshot pricing reads, kept until the capacity epoch moves (CAP-6). Capacity
        questions read every byte (a relief may wait on the host for a transfer to free it); an
        in-place take reads the band as it stands."""
        memo = self._memo.get(mode)
        if memo is None or memo.epoch != self.epoch.value:
            memo = self._memo[mode] = self.snapshot(mode)
        return memo

    def in_place(self, pages: Sequence[int]) -> bool:
        """Would a take of `pages` succeed with no rearrangement at all?"""
        return plan(self.pricing_snapshot(SnapshotMode.TAKE), tuple(pages), Step.NO_MOVE) is not None

    def empty_snapshot(self) -> ChainSnapshot:
        """The chain with nothing allocated: what an arriving request is checked against."""
        bands = []
        for b in self.bands:
            s = b.snapshot()
            if b.placement is Placement.FLOAT:
                s = s._replace(lo=-1, hi=-1, parked=True)
            elif b.placement is Placement.DOWN_END:
                s = s._replace(lo=s.n_grid, hi=s.n_grid)
            else:
                s = s._replace(lo=s.first_id, hi=s.first_id)
            bands.append(s._replace(live=0, holes=0, pending=0, fixed=0, fixed_far=0, pinned=False))
        return ChainSnapshot(tuple(bands), self.layout.chain_lo, self.layout.arena_bytes)

    # -- capacity decisions -------------------------------------------------------------------

    def _check_demand(self, pages: Sequence[int]) -> tuple[int, ...]:
        pages = tuple(int(p) for p in pages)
        if len(pages) != len(self.bands) or any(p < 0 for p in pages):
            raise ValueError(f"demand must be {len(self.bands)} non-negative page counts, got {pages}")
        return pages

    def _within_caps(self, pages: Sequence[int], freed: Sequence[int] | None = None) -> bool:
        if self.caps is None:
            return True
        for band, cap, n, f in zip(self.bands, self.caps, pages, freed or (0,) * len(self.bands)):
            if n and band.n_live - min(f, band.n_live) + n > cap:
                return False
        return True

    @capacity_decision
    def units_fit(self, pages: Sequence[int]) -> bool:
        """Would a take of `pages` (per band) succeed now? Exactly the take's own answer (CAP-11)."""
        pages = self._check_demand(pages)
        return self._within_caps(pages) and feasible(self.pricing_snapshot(), pages)

    @capacity_decision
    def admits(self, demand: KVDemand, reclaimable: Sequence[int] | None = None) -> bool:
        """Admission: owner virtual ids (ADM-4), free state slots (ADM-5), and a layout for the
        demand once the prefix cache frees what it could evict per band (ADM-6). Every cached
        virtual page has an owner page, so evicting the owner pages credited frees as many ids."""
        evictable_ids = reclaimable[self.owner.pool.index] if reclaimable is not None else 0
        if demand.virtual_pages > len(self.virtual_free) + evictable_ids:
            return False
        if demand.state_slots > len(self.slot_free):
            return False
        if not self._within_caps(demand.pages, reclaimable):
            return False
        snap = self.pricing_snapshot()
        if reclaimable is not None:
            snap = reclaimed_snapshot(snap, reclaimable)
        return feasible(snap, self._check_demand(demand.pages))

    @capacity_decision
    def fits_after_frees(self, pages: Sequence[int], freed: Sequence[int]) -> bool:
        """Would `pages` fit once `freed` pages per band are given back? An eviction walk stops at
        the first yes (ADM-8)."""
        pages = self._check_demand(pages)
        return self._within_caps(pages, freed) and feasible(reclaimed_snapshot(self.pricing_snapshot(), freed), pages)

    @capacity_decision
    def ensure_capacity(self, pages: Sequence[int]) -> bool:
        """Lay the chain out so that a take of `pages` succeeds, moving pages if needed. A yes is
        always followed by a successful take (CAP-11); a no changes nothing."""
        pages = self._check_demand(pages)
        if not self._within_caps(pages):
            return False
        if self.in_place(pages):
            return True
        if not feasible(self.pricing_snapshot(), pages):
            return False
        self._relieve(pages)
        return True

    def lay_out_for(self, pages: Sequence[int]) -> bool:
        """The relief a lone short band (`Band.relieve`) runs: same path as a chain take's."""
        return self.ensure_capacity(pages)

    # -- takes ------------------------------------------------------------------------------------

    def take(self, pages: Sequence[int]) -> list[np.ndarray]:
        """Physical page ids per band for `pages` (chain order). Raises CapacityError, with nothing
        changed, when no layout serves the demand."""
        return self._plan_and_take(self._check_demand(pages))

    def _plan_and_take(self, pages: tuple[int, ...]) -> list[np.ndarray]:
        bands = self.bands
        if self.caps is not None and not self._within_caps(pages):
            raise CapacityError(f"a fixed per-kind pool is full: {pages} pages over caps {self.caps}")
        growers = [i for i, (b, n) in enumerate(zip(bands, pages)) if n > b.n_holes + b.n_pending]
        if not growers:
            # every band serves its share from holes and pending pages: the in-place plan holds
            # with no growth, so there is nothing to price
            return [band._acquire(n) if n else _NO_PAGES for band, n in zip(bands, pages)]
        if len(growers) == 1:
            # one band grows and no other band's span changes, so its in-place layout against its
            # neighbours as they stand is the in-place plan's answer for it
            i = growers[0]
            prev_top, next_bottom = self.neighbour_bounds(i)
            after = take_layout(bands[i].snapshot(), pages[i], prev_top, next_bottom)
            if after is not None:
                return [band._acquire(n, after if j == i else None) for j, (band, n) in enumerate(zip(bands, pages))]
        in_place = plan(self.pricing_snapshot(SnapshotMode.TAKE), pages, Step.NO_MOVE)
        if in_place is None:
            if not feasible(self.pricing_snapshot(), pages):
                raise CapacityError(self._shortfall_message(pages))
            self._relieve(pages)
            return [band._acquire(n) for band, n in zip(self.bands, pages)]
        # the in-place plan ran take_layout on each band in chain order on the current state:
        # hand its per-band result to the take instead of computing it again
        return [band._acquire(n, after) for band, n, after in zip(self.bands, pages, in_place.after)]

    def _relieve(self, pages: tuple[int, ...]) -> LayoutPlan:
        self._urgent_recovery()
        layout, hold_network = self._relief_plan(pages)
        if layout is None:
            raise InvariantError("chain.relief", f"feasible said yes but no relief plan serves {pages}")
        self.log("relief", layout.step.name, [(r.band, r.lo, r.size) for r in layout.relocations])
        self.realize(layout, hold_network)
        return layout

    def _urgent_recovery(self, read_ahead: bool = True) -> None:
        """Read ahead, settle every pending batch of every band, then park floats left empty
        (ALLOC-11/12/13). After a host wait in the same operation there is no read-ahead: a host
        read after a stream wait is what the read-ahead exists to avoid (LIFE-41)."""
        if read_ahead:
            for band in self.bands:
                band.read_ahead_for_recovery()
        for band in self.bands:
            band.settle_pending_for_recovery()
        for band in self.bands:
            if isinstance(band, FloatBand) and not band.parked and band.n_live + band.n_fixed + band.n_vacated == 0:
                band.park()

    def _relief_plan(self, pages: tuple[int, ...]) -> tuple[LayoutPlan | None, bool]:
        """First with every network-held row fixed in place (ALLOC-14, PD-6); only when no such
        layout exists, with every byte, waiting on the host for the transfers (ALLOC-15, PD-7).
        The wait releases pages into pending batches and may empty floats, so recovery runs again
        before the second plan is priced. Returns the plan and whether it holds network rows."""
        layout = first_plan(self.pricing_snapshot(SnapshotMode.HOLD_NETWORK), pages)
        if layout is not None:
            return layout, True
        held = self.network_transfers()
        if held:
            self.wait_transfers(held)
            self._urgent_recovery(read_ahead=False)
        return first_plan(self.pricing_snapshot(SnapshotMode.TAKE), pages), False

    def realize(self, layout: LayoutPlan, hold_network: bool = False) -> None:
        """Compact the listed ends, relocate floats in move order, extend pinned floats (ALLOC-16/17).
        The takes that follow run in chain order. A plan priced with network rows in place
        (`hold_network`) compacts around them as around fixed pages."""
        for i in layout.compact_ends:
            self.bands[i].flush_for_allocation(hold_network)
        for r in layout.relocations:
            band = self.bands[r.band]
            assert isinstance(band, FloatBand)
            band.relocate_into(r.lo, r.size)
        for e in layout.extensions:
            band = self.bands[e.band]
            assert isinstance(band, FloatBand)
            band.extend(e.side, e.pages)

    def _shortfall_message(self, pages: tuple[int, ...]) -> str:
        parts = [f"{b.name} {n} pages ({b.n_live} live)" for b, n in zip(self.bands, pages) if n]
        return (f"no layout of the arena serves {', '.join(parts)}; "
                f"about {self.available_bytes_estimate()} bytes free in all")

    # -- compaction -------------------------------------------------------------------------------

    # -- the ledger across bands ------------------------------------------------------------------

    def log(self, kind: str, *fields) -> None:
        if self.decisions is not None:
            self.decisions.append((kind, *(f.tolist() if isinstance(f, np.ndarray) else f for f in fields)))

    def network_transfers(self) -> list[NetworkTransfer]:
        seen: dict[int, NetworkTransfer] = {}
        for band in self.bands:
            for use in band.usage.uses:
                if use.hazard is Hazard.NETWORK and isinstance(use.transfer, NetworkTransfer):
                    seen.setdefault(use.transfer.id, use.transfer)
        return list(seen.values())

    def wait_transfers(self, transfers: Sequence[NetworkTransfer]) -> None:
        """Host-wait network transfers (the transfer engine runs outside every stream), then release
        them everywhere (LEDG-4). Past the deadline this raises naming the transfers in flight."""
        transfers = [t for t in transfers if t is not None and not t.released]
        if not transfers:
            return
        self.log("host_wait", [t.name for t in transfers])
        self.waiter.wait(transfers)
        for t in transfers:
            self.end_transfer(t)

    def end_transfer(self, transfer: NetworkTransfer | HostTransfer) -> None:
        """A transfer is over (released, or its host copy acknowledged): end its uses in every band
        and the fences it left, and return vacated pages it alone held."""
        if isinstance(transfer, NetworkTransfer):
            transfer.released = True
        else:
            transfer.ended = True
        for band in self.bands:
            if band.usage.end_transfer(transfer):
                band.epoch.bump()
            band.take_ready_vacated()
        self.fences = [f for f in self.fences if f.use.transfer is not transfer]

    def fence_pages(self, band: Band, ids: np.ndarray) -> None:
        """Pages leaving `band`: every unfinished use on them becomes a fence over their bytes."""
        if not band.usage.uses or not len(ids) or not band.usage.count[ids].any():
            return
        leaving = np.zeros(band.grid.n_grid, dtype=bool)
        leaving[ids] = True
        for use in list(band.usage.uses):
            if use.hazard is Hazard.FIXED:
                continue
            out = leaving[use.pages]
            if not out.any():
                continue
            lo, hi = band.byte_ranges(use.pages[out])
            self.fences += [Fence(int(a), int(b), use) for a, b in zip(lo, hi)]
            band.usage.end(use)
            if not out.all():
                rest = PageUse(use.hazard, use.pages[~out], use.writes, use.event, use.step, use.transfer,
                               use.vacated, use.label)
                band.usage.record(rest)

    def wait_fences(self, band: Band, ids: np.ndarray) -> None:
        """Before `band` writes bytes that left another band (or itself), clear their fences on the
        schedule stream (COMP-20); a fence cleared there is dropped."""
        if not self.fences or not len(ids):
            return
        lo, hi = band.byte_ranges(ids)
        a, b = int(lo.min()), int(hi.max())
        keep = []
        waited: set[int] = set()
        rules = CLEARANCE[Consumer.SCHEDULE_COPY]
        for fence in self.fences:
            if fence.hi <= a or fence.lo >= b or not ((lo < fence.hi) & (hi > fence.lo)).any():
                keep.append(fence)
                continue
            clear = rules[fence.use.hazard]
            if clear is Clear.HOST_WAIT:
                self.wait_transfers([fence.use.transfer])
            elif clear is Clear.STREAM_WAIT and fence.use.event is not None and fence.use.event.seq not in waited:
                waited.add(fence.use.event.seq)
                band._stream_wait(fence.use.event, f"fence left by {fence.use.label}")
        self.fences = keep

    # -- compaction -------------------------------------------------------------------------------

    def flush_opportunistic(self, max_moves: int | None = None) -> int:
        """Close holes lazily: at most KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL moves per end band,
        and only in an end whose free gap is below KVCHAIN_LAZY_COMPACTION_GAP_FRACTION of the chain
        (pages are not copied while there is room to spare); boundary holes are always absorbed."""
        if max_moves is None:
            max_moves = self.max_moves_per_call
        moved = 0
        for band in self.bands:
            if band.n_holes:  # a band without holes has nothing to close or absorb
                moved += band.flush(max_moves if self._under_pressure(band) else 0)
        if self.log_compaction_stats:
            for band in self.bands:
                log.info("compaction %s: %s", band.name, band.stats)
        return moved

    def _under_pressure(self, band: Band) -> bool:
        """Whether closing a band's holes now is worth page copies: the free gap between it and its
        neighbour is small. A float's gaps never matter here (floats never compact)."""
        if band.placement is Placement.FLOAT or not band.n_holes:
            return False
        prev_top, next_bottom = self.neighbour_bounds(band.index)
        gap = band.bottom - prev_top if band.placement is Placement.DOWN_END else next_bottom - band.top
        return gap < self.compaction_gap_fraction * self.layout.chain_bytes

    def prewarm_compaction(self) -> None:
        for band in self.bands:
            band.prewarm_compaction()

    # -- forward retirement -----------------------------------------------------------------------

    def on_forward_retired(self, step: int) -> None:
        """A forward is processed (with every earlier one): release its pending pages and end its
        uses in every band's ledger and in the fences (LIFE-23, LEDG-7)."""
        for band in self.bands:
            band.release_pending_through(step)
            band.retire_forwards_through(step)
        self.fences = [f for f in self.fences if f.use.step is None or f.use.step > step]
        self.epoch.bump()

    # -- the memory clip --------------------------------------------------------------------------

    @capacity_decision
    def max_new_tokens_for_memory(self, input_len: int, max_new_tokens: int, **demand_kwargs) -> int | None:
        """The most output tokens (up to `max_new_tokens`) a request of `input_len` tokens can hold in
        an empty pool, priced by `request_demand` (ADM-16). None when even its input does not fit."""
        empty = self.empty_snapshot()

        def fits(output_len: int) -> bool:
            d = request_demand(self.plan, DemandPurpose.CEILING, input_len=input_len,
                               output_len=output_len, **demand_kwargs)
            within = self.caps is None or all(n <= cap for n, cap in zip(d.pages, self.caps))
            return (within and d.virtual_pages < self.n_virtual
                    and d.state_slots <= len(self.slot_free) + self._slots_held() and feasible(empty, d.pages))

        if not fits(0):
            return None
        lo, hi = 0, max_new_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _slots_held(self) -> int:
        return self.state_band.n_live if self.state_band is not None else 0

    # -- estimates (stats only) --------------------------------------------------------------------

    def available_bytes_estimate(self) -> int:
        gaps = self.layout.chain_bytes - sum(b.span * b.page_bytes for b in self.bands)
        return gaps + sum((b.n_holes + b.n_pending) * b.page_bytes for b in self.bands)

    def estimated_units_available(self, band: Band) -> int:
        """Units `band` could take from free bytes, ignoring alignment, fixed and pending pages."""
        observe_only_read("estimated_units_available")
        free_bytes = self.available_bytes_estimate()
        pages = free_bytes // band.page_bytes
        if band is self.owner:
            pages = min(pages, len(self.virtual_free))
        return pages * band.pool.units_per_page

    def available_size(self) -> int:
        observe_only_read("available_size")
        return self.estimated_units_available(self.owner)

    def full_available_size(self) -> int:
        observe_only_read("full_available_size")
        return self.estimated_units_available(self.owner)

    def window_available_size(self) -> dict[str, int]:
        observe_only_read("window_available_size")
        return {b.name: self.estimated_units_available(b) for b in self.window_bands}

    def usage(self) -> float:
        """Live bytes over chain bytes."""
        observe_only_read("usage")
        live = sum(b.n_live * b.page_bytes for b in self.bands)
        return live / max(1, self.layout.chain_bytes)

    # -- accounting ----------------------------------------------------------------------------------

    def verify_byte_accounting(self) -> None:
        """Byte conservation: counts match page states, spans lie in order inside the chain without
        overlap, ids and maps agree, and a memoised snapshot is never stale (CHK-15)."""
        problems: list[str] = []
        for mode, memo in self._memo.items():
            if memo.epoch == self.epoch.value and memo != self.snapshot(mode):
                problems.append(f"stale pricing snapshot ({mode.value}): the capacity epoch did not move on a change")
        cursor = self.layout.chain_lo
        for band in self.bands:
            problems += _band_problems(band)
            if band.parked:
                continue
            if band.bottom < cursor:
                problems.append(f"{band.name}: span starts at byte {band.bottom}, below its neighbour's end {cursor}")
            cursor = band.top
        if cursor > self.layout.arena_bytes:
            problems.append(f"chain ends at byte {cursor}, past the arena's {self.layout.arena_bytes}")
        bound = int(np.count_nonzero(self.owner.ids.v2p >= 0))
        if bound + len(self.virtual_free) != self.n_virtual - 1:
            problems.append(f"owner: {bound} bound + {len(self.virtual_free)} free virtual pages "
                            f"!= {self.n_virtual - 1}")
        if self.state_band is not None:
            slots = int(np.count_nonzero(self.state_band.ids.v2p >= 0))
            if slots + len(self.slot_free) != self.state_band.grid.n_grid:
                problems.append(f"state: {slots} bound + {len(self.slot_free)} free slot ids != "
                                f"{self.state_band.grid.n_grid}")
        if problems:
            raise InvariantError("chain.byte_accounting", "; ".join(problems))

    # -- used by KVStorage ------------------------------------------------------------------------
    # What the storage facade needs of the chain, as operations over sub-pool names, virtual ids and
    # slot ids: the facade reaches no band, id map, ledger, epoch, copier, device or forward step.

    def free_virtual(self, band: Band, virtual: np.ndarray) -> np.ndarray:
        """Unbind virtual ids of one band and free the pages behind them; returns the physical ids."""
        return band.free_virtual(virtual)

    def take_for_load(self, band: Band, n: int) -> tuple[np.ndarray, PageUse]:
        """Pages of one band for a host-tier load, fixed under a load reservation (HIC-4/5)."""
        return band.alloc_physical(n)

    def copy_state(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A schedule-stream copy of live state pages `src` onto live state pages `dst`, ordered
        after everything the ledger says may still touch them (LEDG-14..17)."""
        band = self.state_band
        band.clear_for_copy(src, dst)
        self.copier.move_pages(band, src, dst, label="state_copy")

    def forward_processed(self, record: LaunchRecord) -> None:
        """The oldest step is processed (`ForwardSteps.forward_processed`); a forward retires with it."""
        self.forward_steps.forward_processed(record)

    def check_idle(self) -> None:
        """With no recorded forward in flight, no band holds a pending page."""
        self.forward_steps.check_idle()

    def _band_named(self, sub_pool: str) -> Band:
        return self.bands[self.plan.by_name(sub_pool).index]

    def _bands_named(self, pages: dict[str, np.ndarray]) -> list[tuple[Band, np.ndarray]]:
        """(band, page ids) per sub-pool name, every name resolved before anything changes."""
        return [(self._band_named(name), np.asarray(ids, dtype=np.int64)) for name, ids in pages.items()]

    def take_virtual(self, n_pages: int, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
        """One chain take: `n_pages` pages in every token band bound to as many fresh owner virtual
        pages, and `n_slots` state pages bound to fresh slot ids. Returns (virtual pages, slot ids).
        Raises CapacityError, with nothing changed, when ids or bytes run short."""
        if n_pages > len(self.virtual_free):
            raise CapacityError(f"owner has {len(self.virtual_free)} free virtual pages, {n_pages} needed")
        if n_slots > len(self.slot_free):
            raise CapacityError(f"state sub-pool has {len(self.slot_free)} free slot ids, {n_slots} needed")
        state = self.state_band
        demand = [n_pages] * len(self.bands)
        if state is not None:
            demand[state.index] = n_slots
        physical = self.take(demand)
        vpages = slots = _NO_PAGES
        if n_pages:
            vpages = self.virtual_free.pop(n_pages)
            for band in self.token_bands:
                band.bind(vpages, physical[band.index])
        if n_slots:
            slots = self.slot_free.pop(n_slots)
            state.bind(slots, physical[state.index])
        return vpages, slots

    def free_virtual_pages(self, vpages: np.ndarray) -> None:
        """Each window frees the rows it still binds of `vpages`, then the owner frees them all and
        the ids return to the free stack (CHK-8 between the two)."""
        if not len(vpages):
            return
        for band in self.window_bands:
            bound = vpages[band.ids.v2p[vpages] != UNBOUND]
            self.free_virtual(band, bound)
        check_windows_released(self, vpages)
        self.free_virtual(self.owner, vpages)
        self.virtual_free.push(vpages)

    def free_window_rows(self, sub_pool: str, vpages: np.ndarray) -> None:
        """One window frees its rows of `vpages`; every other band keeps them bound."""
        self.free_virtual(self._band_named(sub_pool), vpages)

    def free_state_slots(self, slots: np.ndarray) -> None:
        """The state band frees the pages behind `slots`; the slot ids return to the free stack."""
        if not len(slots):
            return
        self.free_virtual(self.state_band, slots)
        self.slot_free.push(slots)

    def rehome_window(self, sub_pool: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Rebind one window's pages from virtual pages `src` to unbound virtual pages `dst`; nothing
        is taken, freed or copied (WIN-7)."""
        band = self._band_named(sub_pool)
        physical = band.ids.v2p[src]
        if (physical < 0).any() or (band.ids.v2p[dst] >= 0).any():
            raise InvariantError("chain.window_segment_bound", f"{sub_pool}: rehome needs bound sources and free targets")
        band.ids.unbind_physical(physical)
        band.ids.bind(dst, physical)

    def bind_window(self, sub_pool: str, vpages: np.ndarray, physical: np.ndarray) -> None:
        """Bind live pages of one window to owner virtual pages (WIN-7)."""
        self._band_named(sub_pool).bind(vpages, physical)

    def copy_state_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Copy state slots on the schedule stream after every unfinished writer of the sources,
        clearing the ledger on the destinations first (LEDG-14..17)."""
        v2p = self.state_band.ids.v2p
        src = v2p[src_slots]
        dst = v2p[dst_slots]
        if (src < 0).any() or (dst < 0).any():
            raise InvariantError("band.free_of_bound_page", "state copy names an unbound slot")
        self.copy_state(src, dst)

    def physical_pages(self, sub_pool: str, virtual: np.ndarray) -> np.ndarray:
        """Physical ids behind bound virtual ids of one sub-pool (slot ids for state); raises
        InvariantError naming the sub-pool when one is unbound."""
        physical = self._band_named(sub_pool).ids.v2p[virtual]
        if (physical < 0).any():
            raise InvariantError("band.free_of_bound_page", f"{sub_pool}: translation of unbound ids")
        return physical

    def alloc_load(self, sub_pool: str, n: int) -> tuple[np.ndarray, PageUse]:
        """`n` pages of one sub-pool fixed under a load reservation (HIC-4/5)."""
        return self.take_for_load(self._band_named(sub_pool), n)

    def end_load_reservation(self, sub_pool: str, reservation: PageUse) -> None:
        """The reservation's pages may move again (HIC-6)."""
        self._band_named(sub_pool).unfix(reservation)

    def record_host_transfer(self, transfer: HostTransfer, pages: dict[str, np.ndarray]) -> None:
        """One COPY_WRITE (a load) or COPY_READ (a backup) use per sub-pool named in `pages`."""
        hazard = Hazard.COPY_WRITE if transfer.writes else Hazard.COPY_READ
        for band, ids in self._bands_named(pages):
            band.usage.record(PageUse(hazard, ids, transfer.writes, event=transfer.done, transfer=transfer,
                                      label=f"{hazard.value} {transfer.name}"))

    def record_network_transfer(self, transfer: NetworkTransfer, pages: dict[str, np.ndarray]) -> None:
        """One NETWORK use per sub-pool named in `pages` (a receive writes them); each band's capacity
        epoch moves, since network-held rows price differently (PD-1)."""
        for band, ids in self._bands_named(pages):
            band.usage.record(PageUse(Hazard.NETWORK, ids, writes=not transfer.sends, event=transfer.done,
                                      transfer=transfer, label=repr(transfer)))
            band.epoch.bump()

    def hold_rows(self, pages: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
        """Hold physical pages per sub-pool in place (no compaction moves them) until `release_rows`;
        returns the held pages per band index, the argument `release_rows` takes (PD-8)."""
        held = {}
        for band, ids in self._bands_named(pages):
            band.held[ids] += 1
            band.n_held += len(ids)
            held[band.index] = ids
        return held

    def release_rows(self, held: dict[int, np.ndarray]) -> None:
        """End a `hold_rows`: the pages may move again."""
        for index, ids in held.items():
            band = self.bands[index]
            band.held[ids] -= 1
            band.n_held -= len(ids)

    def forward_launched(self, has_forward: bool = True) -> LaunchRecord:
        """A step launched (LIFE-21); see `ForwardSteps.forward_launched`."""
        return self.forward_steps.forward_launched(has_forward)

    def record_forward(self, record: LaunchRecord, done: Event, written: Sequence[np.ndarray | None] | None,
                       shared_read_done: Event | None = None) -> None:
        """The launched forward's `done` event and, per band in chain order, the pages it writes
        (None for a band it leaves alone); `written=None` when unknown, every band then counts it
        as writing everywhere (LIFE-22, LIFE-36)."""
        self.forward_steps.forward_recorded(record, done, writes_known=written is not None)
        record.shared_read_done = shared_read_done
        for band in self.bands:
            if written is None:
                band.set_inflight_forward(record.step, done, None)
            elif written[band.index] is not None:
                band.set_inflight_forward(record.step, done, written[band.index])

    def order_forward_after_schedule(self) -> None:
        """The forward stream waits everything queued on the schedule stream so far."""
        device = self.device
        device.stream_wait(device.forward_stream, device.record(device.schedule_stream, "schedule"))

    def apply_war_barrier(self) -> None:
        """The schedule stream waits the running forward's shared-read end, or the whole forward
        stream when it declared none (LIFE-4/5/6)."""
        device = self.device
        running = self.forward_steps.newest_unprocessed()
        event = getattr(running, "shared_read_done", None) if running is not None else None
        if event is None:
            event = device.record(device.forward_stream, "war barrier")
        device.stream_wait(device.schedule_stream, event)

    def band_counts(self) -> dict[str, dict[str, int]]:
        """Per band name: its `live`, `holes`, `pending` and `span` pages, its `page_bytes` and the
        pages it has `moves`d. Reads counters only."""
        return {b.name: {"live": b.n_live, "holes": b.n_holes, "pending": b.n_pending, "span": b.span,
                         "page_bytes": b.page_bytes, "moves": b.stats["moves"]} for b in self.bands}

    def pages_accounted_for(self, vpages: np.ndarray, n_slots: int) -> dict[str, int]:
        """Live pages per band that owner virtual pages `vpages` and `n_slots` state slots account for:
        the owner one per virtual page, a window the rows it still binds, the state band the slots."""
        out = {}
        for band in self.bands:
            if band.pool.kind is PoolKind.STATE:
                out[band.name] = n_slots
            elif band is self.owner:
                out[band.name] = len(vpages)
            else:
                out[band.name] = int(np.count_nonzero(band.ids.v2p[vpages] != UNBOUND))
        return out


def _band_problems(band: Band) -> list[str]:
    out = []
    st = band.state
    counts = np.bincount(st, minlength=6)
    if counts[VACATED] != band.n_vacated:
        out.append(f"{band.name}: {counts[VACATED]} vacated pages, counted {band.n_vacated}")
    if int(np.count_nonzero(band.fixed_mask)) != band.n_fixed:
        out.append(f"{band.name}: {int(np.count_nonzero(band.fixed_mask))} fixed pages, counted {band.n_fixed}")
    if counts[LIVE] != band.n_live:
        out.append(f"{band.name}: {counts[LIVE]} live pages, counted {band.n_live}")
    if counts[HOLE] != band.n_holes or len(band.holes) != band.n_holes:
        out.append(f"{band.name}: {counts[HOLE]} holes ({len(band.holes)} listed), counted {band.n_holes}")
    if counts[PENDING] != band.n_pending or band.pending.count != band.n_pending:
        out.append(f"{band.name}: {counts[PENDING]} pending pages ({band.pending.count} batched), "
                   f"counted {band.n_pending}")
    listed = band.holes.view()
    if len(listed) and (len(np.unique(listed)) != len(listed) or (st[listed] != HOLE).any()):
        out.append(f"{band.name}: hole list repeats ids or lists pages that are not holes")
    if band.parked:
        if (st != OUT).sum() - (st == SINK).sum():
            out.append(f"{band.name}: parked but holds pages")
    else:
        outside = np.concatenate([st[: band.lo], st[band.hi :]])
        if ((outside != OUT) & (outside != SINK)).any():
            out.append(f"{band.name}: pages outside its span [{band.lo}, {band.hi})")
        inside = st[band.lo : band.hi]
        if (inside == OUT).any() or (inside == SINK).any():
            out.append(f"{band.name}: span [{band.lo}, {band.hi}) has pages outside the band")
    live = np.flatnonzero(st == LIVE)
    if len(live) and ((band.ids.p2v[live] < 0).any() or (band.ids.v2p[band.ids.p2v[live]] != live).any()):
        out.append(f"{band.name}: a live page is unbound or its virtual id maps elsewhere")
    if int(np.count_nonzero(band.ids.v2p >= 0)) != len(live):
        out.append(f"{band.name}: {int(np.count_nonzero(band.ids.v2p >= 0))} virtual ids bound to "
                   f"{len(live)} live pages (two ids share a page, or an id outlived its page)")
    if band.ids.v2p[-1] != UNBOUND or band.ids.read_map[-1] != band.ids.sink:
        out.append(f"{band.name}: the map entry past the last virtual id was bound")
    not_live = np.flatnonzero(st != LIVE)
    if len(not_live) and (band.ids.p2v[not_live] >= 0).any():
        out.append(f"{band.name}: a page that is not live is bound")
    return out
