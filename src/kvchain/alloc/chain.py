"""`ChainAllocator`: one allocator over every band of the arena, and the one executor.

It answers every capacity question (one layout search on a host-only snapshot) and performs every
chain allocation. A take plans in place first; when that is short and some layout serves the
demand, it relieves: recovery (settle every pending batch, park empty floats), the least
rearrangement planned, realized (compact the ends, relocate floats in `move_order`), then each
band's pages taken in chain order. When no layout serves the demand it refuses before anything moves.

Bands are passive stores (`alloc/band.py`) and compaction plans moves without doing them
(`alloc/compaction.py`): everything that touches the device, the page copier or the forward steps
happens in this class. It is one class in four files, each a part a reader can open alone:

- here: construction, snapshots, capacity decisions, takes and relief, frees, forward steps, the
  memory clip and estimates;
- `alloc/moves.py` (`ChainMoves`): flushes, float relocations and relief plans realized, every
  page copy inside the arena;
- `alloc/waits.py` (`ChainWaits`): the one dispatch of waits, `_clear` (every wait it performs is
  a `Wait` that `page_usage.clearance`, the one reader of `CLEARANCE`, returned), fences and
  transfers;
- `alloc/storage_ops.py` (`StorageOps`): the operations `KVStorage` calls, over sub-pool names,
  virtual ids and slot ids;

and `alloc/accounting.py` checks its byte conservation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .. import env, faults
from ..device.base import Device
from ..errors import CapacityError, InputError, InvariantError
from ..memory.arena import KVArena
from ..memory.copy import PageCopier
from ..plan import KVStoragePlan, Placement, PoolKind
from . import invariants
from .accounting import chain_problems
from .band import (
    Band,
    FloatBand,
    SnapshotMode,
    check_virtual_bound,
)
from .decisions import capacity_decision, observe_only_read
from .demand import DemandPurpose, KVDemand, request_demand
from .forward_steps import ForwardSteps, LaunchRecord
from .id_space import IdStack
from .moves import ChainMoves
from .page_usage import Consumer, Fence, PageUse
from .pricing import (
    BandSnap,
    CapacityEpoch,
    ChainSnapshot,
    LayoutPlan,
    Step,
    feasible,
    first_plan,
    plan,
    reclaimed_snapshot,
    take_layout,
)
from .signals import NetworkTransferWaiter
from .stage_capacity import StageCapacity, StageGeometry
from .storage_ops import NO_PAGES, StorageOps


class ChainAllocator(StorageOps, ChainMoves):
    """Every band of one arena, in chain order (up end, floats, down end = full-attention owner)."""

    def __init__(self, plan: KVStoragePlan, arena: KVArena, device: Device, *, scratch_bytes: int) -> None:
        self.plan = plan
        self.arena = arena
        self.device = device
        self.layout = arena.layout
        self.epoch = CapacityEpoch()
        self.forward_steps = ForwardSteps(self.epoch)
        self.move_epoch = 0
        #: float relocations so far (`_relocate`): a float band's live pages copied to a new block
        self.relocations = 0
        #: reliefs so far (`_relieve`): takes that compacted or relocated bands before they fit
        self.reliefs = 0
        self.copier = PageCopier(arena, device, scratch_bytes)
        owner_grid = self.layout.grids[plan.owner.index]
        self.n_virtual = owner_grid.n_grid + 1  # virtual page 0 is the null page: it reads the sink
        self.bands: list[Band] = []
        for pool, grid in zip(plan.sub_pools, self.layout.grids):
            cls = FloatBand if pool.placement is Placement.FLOAT else Band
            n_virtual = grid.n_grid if pool.kind is PoolKind.STATE else self.n_virtual
            self.bands.append(cls(pool, grid, self.epoch, n_virtual))
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
        #: called with what is read whenever the allocator reads device-side state on the host
        #: (relief's read-ahead): a checker that orders host reads against waits listens here
        self.host_read_observers: list[Callable[[str], None]] = []
        #: read once at construction, like the rest of the pool's configuration
        self.max_moves_per_call = int(env.get("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL"))
        self.log_compaction_stats = bool(env.get("KVCHAIN_LOG_LAZY_COMPACTION_STATS"))
        self.compaction_gap_fraction = float(env.get("KVCHAIN_LAZY_COMPACTION_GAP_FRACTION"))
        #: under pipeline parallelism, every stage's geometry: capacity is asked of them all (PP-7)
        self._stages: StageCapacity | None = None

    def install_stage_capacity(self, geometries: Sequence[StageGeometry], stage: int) -> StageCapacity:
        """Install every pipeline stage's geometry, this chain's as stage `stage` among them (PP-6):
        from now on every capacity question and estimate is answered on every stage's simulated
        snapshot (PP-7..9). Refuses stages that differ in sub-pools or page size (PP-5)."""
        self._stages = StageCapacity(self, geometries, stage)
        return self._stages

    @property
    def stage_capacity(self) -> StageCapacity | None:
        return self._stages

    # -- snapshots ----------------------------------------------------------------------------

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
            if self._modes_agree():
                # no band holds a vacated, received or network-used page: every mode reads the
                # chain alike, so one snapshot serves them all until the epoch moves
                memo = self.snapshot(SnapshotMode.TAKE)
                for m in SnapshotMode:
                    self._memo[m] = memo
            else:
                memo = self._memo[mode] = self.snapshot(mode)
        return memo

    def _modes_agree(self) -> bool:
        """Whether every `SnapshotMode` gives the same snapshot: they differ only on vacated pages,
        receive holds and network uses."""
        return not any(b.n_vacated or b.n_held or b.usage.uses for b in self.bands)

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
            raise InputError(f"demand must be {len(self.bands)} non-negative page counts, got {pages}")
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
        if self._stages is not None:
            return self._within_caps(pages) and self._stages.units_fit(pages)
        return self._within_caps(pages) and feasible(self.pricing_snapshot(), pages)

    @capacity_decision
    def admits(self, demand: KVDemand, reclaimable: Sequence[int] | None = None) -> bool:
        """Admission: owner virtual ids (ADM-4), free state slots (ADM-5), and a layout for the
        demand once the prefix cache frees what it could evict per band (ADM-6). Every cached
        virtual page has an owner page, so evicting the owner pages credited frees as many ids."""
        if self._stages is not None:
            return self._stages.admits(demand, reclaimable)
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
        if self._stages is not None:
            return self._within_caps(pages, freed) and self._stages.fits_after_frees(pages, freed)
        return self._within_caps(pages, freed) and feasible(reclaimed_snapshot(self.pricing_snapshot(), freed), pages)

    @capacity_decision
    def ensure_capacity(self, pages: Sequence[int]) -> bool:
        """Lay the chain out so that a take of `pages` succeeds, moving pages if needed. A yes is
        always followed by a successful take (CAP-11); a no changes nothing."""
        pages = self._check_demand(pages)
        if not self._within_caps(pages):
            return False
        if self._stages is not None and not self._stages.take_fits(pages):
            return False
        if self.in_place(pages):
            return True
        if self._stages is None and not feasible(self.pricing_snapshot(), pages):
            return False
        self._relieve(pages)
        return True

    # -- takes ------------------------------------------------------------------------------------

    def take(self, pages: Sequence[int]) -> list[np.ndarray]:
        """Physical page ids per band for `pages` (chain order). Raises CapacityError, with nothing
        changed, when no layout serves the demand."""
        return self._plan_and_take(self._check_demand(pages))

    def _plan_and_take(self, pages: tuple[int, ...]) -> list[np.ndarray]:
        bands = self.bands
        if self.caps is not None and not self._within_caps(pages):
            raise CapacityError(f"a fixed per-kind pool is full: {pages} pages over caps {self.caps}")
        if self._stages is not None:
            return self._stage_take(pages)
        growers = [i for i, (b, n) in enumerate(zip(bands, pages)) if n > b.n_holes + b.n_pending]
        if not growers:
            # every band serves its share from holes and pending pages: the in-place plan holds
            # with no growth, so there is nothing to price
            return [self.take_from(band, n) if n else NO_PAGES for band, n in zip(bands, pages)]
        if self._past_chain_bytes(pages):
            raise CapacityError(self._shortfall_message(pages))
        if len(growers) == 1:
            # one band grows and no other band's span changes, so its in-place layout against its
            # neighbours as they stand is the in-place plan's answer for it
            i = growers[0]
            prev_top, next_bottom = self.neighbour_bounds(i)
            after = take_layout(bands[i].snapshot(), pages[i], prev_top, next_bottom)
            if after is not None:
                return [self.take_from(band, n, after if j == i else None)
                        for j, (band, n) in enumerate(zip(bands, pages))]
            in_place = None  # that answer was no: the in-place plan would only ask it again
        else:
            in_place = plan(self.pricing_snapshot(SnapshotMode.TAKE), pages, Step.NO_MOVE)
        if in_place is None:
            every = self.pricing_snapshot()
            # where the snapshot over every byte is the in-place plan's own, its in-place answer
            # is the no just found: only the relayout is left to ask
            if not feasible(every, pages, in_place_short=every is self._memo.get(SnapshotMode.TAKE)):
                raise CapacityError(self._shortfall_message(pages))
            self._relieve(pages)
            return [self.take_from(band, n) for band, n in zip(self.bands, pages)]
        # the in-place plan ran take_layout on each band in chain order on the current state:
        # hand its per-band result to the take instead of computing it again
        return [self.take_from(band, n, after) for band, n, after in zip(self.bands, pages, in_place.after)]

    def _past_chain_bytes(self, pages: tuple[int, ...]) -> bool:
        """A full pool's refusal without a snapshot: with no fixed or vacated page in any band, every
        snapshot mode counts each band's live pages alone, so this is `pricing.fits_bytes`'s no on
        the snapshot `feasible` would read, and it is every layout's no, the in-place plan's too
        (spans are disjoint inside the chain and each holds its live and taken pages). Otherwise
        (fixed or vacated pages) it says nothing and pricing decides."""
        need = 0
        for band, n in zip(self.bands, pages):
            if band.n_fixed or band.n_vacated:
                return False
            need += (band.n_live + n) * band.page_bytes
        return need > self.layout.arena_bytes - self.layout.chain_lo

    def _stage_take(self, pages: tuple[int, ...]) -> list[np.ndarray]:
        """A take under pipeline parallelism: refused when some stage's simulated snapshot refuses it
        (PP-8); else realized on this stage's real layout, in place or by relief (PP-11)."""
        if not self._stages.take_fits(pages):
            raise CapacityError(f"a pipeline stage cannot serve the take: {self._shortfall_message(pages)}")
        if self.in_place(pages):
            return [self.take_from(band, n) for band, n in zip(self.bands, pages)]
        self._relieve(pages)
        return [self.take_from(band, n) for band, n in zip(self.bands, pages)]

    def take_from(self, band: Band, n: int, after: BandSnap | None = None,
                  consumer: Consumer = Consumer.ZERO) -> np.ndarray:
        """Hand out `n` writable pages of one band: holes, then settled pending batches, then
        frontier growth, then clear what the ledger and the fences record on them and zero them.

        `after` is the band's layout after the take when the caller already computed it with
        `take_layout` on the current state (a chain take's in-place plan). Every failure check
        runs before anything settles, so a refused take changes nothing (ALLOC-7)."""
        self.forward_steps.assert_no_open_launch("take", band.name, n)
        if n <= 0:
            return NO_PAGES
        if after is None and n > band.n_holes + band.n_pending:
            prev_top, next_bottom = self.neighbour_bounds(band.index)
            after = take_layout(band.snapshot(), n, prev_top, next_bottom)
            if after is None:
                raise CapacityError(
                    f"{band.name}: cannot take {n} pages (holes {band.n_holes}, pending {band.n_pending}, "
                    f"span {band.span}, growth room exhausted)"
                )
        fired = self.device.query if faults.ACTIVE and faults.active(faults.HOLES_BY_FIRED_EVENT) else None
        ids, grown, settled = band.hand_out(n, after, fired)
        if settled:
            self._settle_waits(band, settled)
        if grown is not None:
            self.wait_fences(band, grown)
        if band.usage.uses or band.usage.unknown_writer is not None:
            # what the pages need is read only now, after they were chosen (LEDG-9, LEDG-32)
            self._clear(band, band.usage.clearance(consumer, ids))
        self._zero(band, ids, grown)
        self.log("take", band.name, ids)
        return ids

    def _zero(self, band: Band, ids: np.ndarray, grown: np.ndarray | None) -> None:
        """MHA and MLA pages are zeroed on hand-out (ALLOC-20): kernels load whole pages, and a stale
        NaN or a neighbour's FP32 state bytes read as BF16 would still reach the output."""
        if not band.zero_on_handout:
            return
        if faults.ACTIVE:
            if faults.active(faults.SKIP_ZEROING):
                return
            if grown is not None and faults.active(faults.UNZEROED_GROWTH):
                ids = ids[~np.isin(ids, grown)]
        if not len(ids):
            return
        band.stats["zeroed_pages"] += len(ids)
        self.copier.zero_pages(band.grid, ids)

    def take_alone(self, band: Band, n: int, consumer: Consumer = Consumer.ZERO) -> np.ndarray:
        """A lone band's take (a host-tier load's, ALLOC-19): when it falls short it runs the same
        relief as a chain take's, then takes. Raises CapacityError, with nothing changed, when no
        layout of the arena serves it."""
        demand = [0] * len(self.bands)
        demand[band.index] = n
        if not self.ensure_capacity(demand):
            raise CapacityError(f"{band.name}: no layout of the arena serves {n} more pages ({band.n_live} live)")
        return self.take_from(band, n, consumer=consumer)

    def _relieve(self, pages: tuple[int, ...]) -> LayoutPlan:
        self.reliefs += 1
        self._recover_for_relief()
        layout, hold_network = self._relief_plan(pages)
        if layout is None:
            raise InvariantError("chain.relief", f"feasible said yes but no relief plan serves {pages}")
        self.log("relief", layout.step.name, [(r.band, r.lo, r.size) for r in layout.relocations])
        self.realize(layout, hold_network)
        return layout

    def _recover_for_relief(self, read_ahead: bool = True) -> None:
        """Relief's recovery (the spec's urgent recovery): read ahead, settle every pending batch of
        every band, then park floats left empty (ALLOC-11/12/13). After a host wait in the same
        operation there is no read-ahead: a host read after a stream wait is what the read-ahead
        exists to avoid (LIFE-41)."""
        settle_first = faults.ACTIVE and faults.active(faults.READ_AFTER_SETTLE)
        if read_ahead and not settle_first:
            self._read_ahead()
        for band in self.bands:
            self._settle(band, park=False)
        if read_ahead and settle_first:
            self._read_ahead()
        for band in self.bands:
            if isinstance(band, FloatBand) and not band.parked and band.n_live + band.n_fixed + band.n_vacated == 0:
                self._add_fences(band.park())

    def _read_ahead(self) -> None:
        """Recovery's first half (ALLOC-11): read on the host everything the layout will read
        (free lists, pending pages, in-flight write sets, transfer pages) before any stream wait."""
        for band in self.bands:
            for observe in self.host_read_observers:
                observe(f"{band.name}'s recovery read-ahead")
            invariants.check_host_read(band.name, "the recovery read-ahead")

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
            self._recover_for_relief(read_ahead=False)
        return first_plan(self.pricing_snapshot(SnapshotMode.TAKE), pages), False

    def _shortfall_message(self, pages: tuple[int, ...]) -> str:
        parts = [f"{b.name} {n} pages ({b.n_live} live)" for b, n in zip(self.bands, pages) if n]
        return (f"no layout of the arena serves {', '.join(parts)}; "
                f"about {self.available_bytes_estimate()} bytes free in all")

    # -- frees ------------------------------------------------------------------------------------

    def free(self, band: Band, ids: np.ndarray) -> None:
        """Logical free of live pages of one band (LIFE-2, LIFE-3, `Band.free`): pending under the
        newest recorded, unprocessed forward, else holes, with no stream wait."""
        steps = self.forward_steps
        key = steps.newest_unprocessed()
        if faults.ACTIVE and key is not None:
            key = self._faulty_free_key(key)
        steps.assert_no_open_launch("free", band.name, len(ids))
        if not len(ids):
            return
        fences = band.free(ids, key)
        if fences:
            self.fences += fences

    def _faulty_free_key(self, key: LaunchRecord) -> LaunchRecord | None:
        """Faults `free_to_holes` and `free_on_fired_event`: a free that ignores the running forward
        (always, or when its event fired: a decision that would differ by rank)."""
        if faults.active(faults.FREE_TO_HOLES):
            return None
        if faults.active(faults.FREE_ON_FIRED_EVENT) and self.device.query(key.event):
            return None
        return key

    def free_virtual(self, band: Band, virtual: np.ndarray) -> np.ndarray:
        """Unbind virtual ids of one band and free the pages behind them; returns the physical ids."""
        if not len(virtual):
            return virtual
        if invariants.level():
            check_virtual_bound(band, virtual)
        physical = band.ids.v2p[virtual]
        self.free(band, physical)
        return physical

    # -- forward steps ----------------------------------------------------------------------------

    def forward_processed(self, record: LaunchRecord) -> None:
        """The oldest step is processed (`ForwardSteps.forward_processed`); a forward retires with it."""
        step = self.forward_steps.forward_processed(record)
        if step is not None:
            self._retire(step)

    def _retire(self, step: int) -> None:
        """A forward is processed (with every earlier one): release its pending pages and end its
        uses in every band's ledger and in the fences (LIFE-23, LEDG-7)."""
        for band in self.bands:
            self._add_fences(band.release_pending_through(step))
            band.retire_forwards_through(step)
        if not (faults.ACTIVE and faults.active(faults.KEEP_FENCES)):
            self.fences = [f for f in self.fences if f.use.step is None or f.use.step > step]
        self.epoch.bump()

    def check_idle(self) -> None:
        """With no recorded forward in flight, no band holds a pending page."""
        self.forward_steps.check_idle({b.name: b.pending.count for b in self.bands})

    # -- host-tier loads and state copies ---------------------------------------------------------

    def take_for_load(self, band: Band, n: int) -> tuple[np.ndarray, PageUse]:
        """Pages for a host-tier load, fixed under a load reservation until the tree names them
        (HIC-4). Settles first when the band has pending pages and its holes do not cover the load
        (HIC-5); a short band relieves like a chain take (ALLOC-19)."""
        ids = self.take_alone(band, n, Consumer.HOST_LOAD)
        return ids, band.fix(ids, "load reservation")

    def copy_state(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A schedule-stream copy of live state pages `src` onto live state pages `dst`, ordered
        after everything the ledger says may still touch them (LEDG-14..17)."""
        band = self.state_band
        if band is None:
            raise InputError("the plan has no state sub-pool to copy slots of")
        self._clear(band, band.usage.writers_clearance(src))
        self._clear(band, band.usage.clearance(Consumer.SCHEDULE_COPY, dst))
        self.copier.move_pages(band.grid, src, dst, label="state_copy")

    # -- the memory clip --------------------------------------------------------------------------

    def _fits_empty(self, input_len: int, output_len: int, demand_kwargs: dict) -> bool:
        """Whether a request of `input_len` and `output_len` tokens fits an empty pool (every stage's,
        under pipeline parallelism), priced by `request_demand` (ADM-16)."""
        d = request_demand(self.plan, DemandPurpose.CEILING, input_len=input_len, output_len=output_len,
                           **demand_kwargs)
        if self.caps is not None and any(n > cap for n, cap in zip(d.pages, self.caps)):
            return False
        if self._stages is not None:
            return self._stages.fits_empty(d.pages, d.virtual_pages, d.state_slots)
        return (d.virtual_pages < self.n_virtual and d.state_slots <= len(self.slot_free) + self._slots_held()
                and feasible(self.empty_snapshot(), d.pages))

    @capacity_decision
    def max_new_tokens_for_memory(self, input_len: int, max_new_tokens: int, **demand_kwargs) -> int | None:
        """The most output tokens (up to `max_new_tokens`) a request of `input_len` tokens can hold in
        an empty pool, priced by `request_demand` (ADM-16). None when even its input does not fit."""
        stages = self._stages
        if not self._fits_empty(input_len, 0, demand_kwargs):
            return None if stages is None else stages.record_clip(input_len, max_new_tokens, None)
        lo, hi = 0, max_new_tokens
        if self._fits_empty(input_len, hi, demand_kwargs):  # the common case: the whole ask fits (monotone)
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits_empty(input_len, mid, demand_kwargs):
                lo = mid
            else:
                hi = mid - 1
        return lo if stages is None else stages.record_clip(input_len, max_new_tokens, lo)

    @capacity_decision
    def largest_input_for_memory(self, below: int, **demand_kwargs) -> int:
        """The longest input (under `below` tokens) an empty pool holds with no output, priced as the
        memory clip prices (0 when none does): what a rejection at arrival tells the user, since the
        sub-pools' page grids align apart and a request whose bytes match the pool's may not fit."""
        lo, hi = 0, below - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits_empty(mid, 0, demand_kwargs):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _slots_held(self) -> int:
        return self.state_band.n_live if self.state_band is not None else 0

    # -- estimates (stats only) --------------------------------------------------------------------

    def available_bytes_estimate(self) -> int:
        if self._stages is not None:
            return self._stages.available_bytes_estimate()
        gaps = self.layout.chain_bytes - sum(b.span * b.page_bytes for b in self.bands)
        return gaps + sum((b.n_holes + b.n_pending) * b.page_bytes for b in self.bands)

    def estimated_units_available(self, band: Band) -> int:
        """Units `band` could take from free bytes, ignoring alignment, fixed and pending pages."""
        observe_only_read("estimated_units_available")
        if self._stages is not None:
            return self._stages.estimated_units_available(band.index)
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
        if self._stages is not None:
            return self._stages.usage()
        live = sum(b.n_live * b.page_bytes for b in self.bands)
        return live / max(1, self.layout.chain_bytes)

    # -- accounting ----------------------------------------------------------------------------------

    def verify_byte_accounting(self) -> None:
        """Byte conservation: counts match page states, spans lie in order inside the chain without
        overlap, ids and maps agree (`accounting.chain_problems`), and a memoised snapshot is never
        stale (CHK-15)."""
        problems = [f"stale pricing snapshot ({mode.value}): the capacity epoch did not move on a change"
                    for mode, memo in self._memo.items()
                    if memo.epoch == self.epoch.value and memo != self.snapshot(mode)]
        problems += chain_problems(self)
        if problems:
            raise InvariantError("chain.byte_accounting", "; ".join(problems))
