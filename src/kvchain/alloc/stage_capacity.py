"""Capacity under pipeline parallelism: every stage's geometry, its simulated snapshot, the digest.

Each pipeline stage keeps its own arena, whose bytes and per-band unit bytes follow the layers it
hosts, but every stage runs the same logical operations and so holds the same units (PP-1, PP-2).
Real layouts still differ (a float placed in the middle of its region lands elsewhere in another
arena, a relief runs on one stage and not on the next), so no stage may answer a capacity question
from its own layout. Once the stages' geometries are installed (`ChainAllocator.install_stage_capacity`),
every question is asked of a simulated snapshot of every stage (`simulated_snapshot`): that stage's
geometry with the shared logical counts (units held per band, ids held, whether a free pends), laid
out packed as relief would leave it. The answers read shared state alone, so every stage reaches the
same decision with no relay (PP-7..10). Each stage folds its questions, their answers and the units it
holds into a digest (`StageCapacity.take_digest`) that the next stage compares (PP-15, PP-16)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..env import InvariantCheckLevel
from ..memory.arena import ArenaLayout
from ..plan import KVStoragePlan, Placement, PoolKind, StagePartitionError
from . import invariants
from .pricing import BandSnap, ChainSnapshot, feasible, reclaimed_snapshot

if TYPE_CHECKING:
    from .demand import KVDemand

#: the stage's `ChainAllocator` (not imported: the chain imports this module)
ChainAllocator = Any


@dataclass(frozen=True)
class BandGeometry:
    """One band of one stage: what it stores (the same on every stage) and its grid there."""

    name: str
    kind: str
    lifetime: str
    placement: str
    units_per_page: int
    unit_bytes: int
    page_bytes: int
    origin: int
    first_id: int
    n_pages: int  # pages on the band's grid
    n_ids: int  # ids the band can bind: owner virtual pages (token bands) or slot ids (state)


@dataclass(frozen=True)
class StageGeometry:
    """What the stages all-gather when the pipeline loop starts (PP-6): the arena's bytes and, per
    band, its unit bytes, page counts and id counts. Plain fields only, so it crosses processes."""

    stage: int
    page_size: int
    arena_bytes: int
    chain_lo: int
    bands: tuple[BandGeometry, ...]

    @classmethod
    def of_chain(cls, chain: ChainAllocator, stage: int) -> StageGeometry:
        """The geometry of a built stage's chain."""
        return cls.of_layout(chain.plan, chain.layout, stage)

    @classmethod
    def of_layout(cls, plan: KVStoragePlan, layout: ArenaLayout, stage: int) -> StageGeometry:
        """The geometry a stage's plan has in an arena laid out as `layout` (no chain needed)."""
        n_virtual = layout.grids[plan.owner.index].n_grid  # virtual page 0 is the null page
        bands = []
        for pool, grid in zip(plan.sub_pools, layout.grids):
            n_ids = grid.n_grid if pool.kind is PoolKind.STATE else n_virtual
            bands.append(BandGeometry(pool.name, pool.kind.value, pool.lifetime.describe(), pool.placement.value,
                                      pool.units_per_page, pool.unit_bytes, grid.page_bytes, grid.origin,
                                      grid.first_id, grid.n_grid, n_ids))
        return cls(stage, plan.page_size, layout.arena_bytes, layout.chain_lo, tuple(bands))

    @property
    def chain_bytes(self) -> int:
        return self.arena_bytes - self.chain_lo

    @property
    def virtual_ids(self) -> int:
        """Owner virtual pages this stage can mint (the null page excluded)."""
        return self.bands[-1].n_ids

    @property
    def slot_ids(self) -> int:
        return next((b.n_ids for b in self.bands if b.kind == PoolKind.STATE.value), 0)

    def bytes_per_token(self) -> int:
        """Bytes one token of every token band takes on this stage (unit bytes, no alignment)."""
        return sum(b.unit_bytes for b in self.bands if b.kind != PoolKind.STATE.value)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SharedCounts:
    """The logical counts every stage shares: pages each band holds (live, fixed ones included), owner virtual
    pages and state slots bound, and whether a free now would pend behind a forward in flight."""

    held: tuple[int, ...]
    virtual_held: int
    slots_held: int
    frees_pend: bool


def shared_counts(chain: ChainAllocator) -> SharedCounts:
    held = tuple(b.n_live for b in chain.bands)  # a fixed page is a live one held in place
    slots = chain.state_band.grid.n_grid - len(chain.slot_free) if chain.state_band is not None else 0
    return SharedCounts(held, chain.n_virtual - 1 - len(chain.virtual_free), slots,
                        chain.forward_steps.newest_unprocessed() is not None)


_EMPTY = SharedCounts((), 0, 0, False)


def simulated_snapshot(geometry: StageGeometry, counts: SharedCounts) -> ChainSnapshot:
    """A stage's chain as relief would leave it holding `counts`: each end packed against its base,
    each float packed at the lowest aligned block above its lower neighbour (parked when empty), no
    holes and no pending pages. Only counts and geometry enter, never a real layout (PP-7)."""
    held = counts.held or (0,) * len(geometry.bands)
    bands = []
    cursor = geometry.chain_lo
    for i, (g, n) in enumerate(zip(geometry.bands, held)):
        placement = Placement(g.placement)
        if placement is Placement.DOWN_END:
            lo, hi, parked = g.n_pages - n, g.n_pages, False
        elif placement is Placement.UP_END:
            lo, hi, parked = g.first_id, g.first_id + n, False
        elif n == 0:
            lo, hi, parked = -1, -1, True
        else:
            lo = max(g.first_id, -(-(cursor - g.origin) // g.page_bytes))
            hi, parked = lo + n, False
        if not parked:
            cursor = g.origin + hi * g.page_bytes
        bands.append(BandSnap(i, placement, g.page_bytes, g.origin, g.first_id, g.n_pages, lo, hi, parked,
                              n, 0, 0, 0, 0, False))
    return ChainSnapshot(tuple(bands), geometry.chain_lo, geometry.arena_bytes, -1, counts.frees_pend)


def check_same_sub_pools(geometries: Sequence[StageGeometry]) -> None:
    """Refuse stages that do not all have the same sub-pools on the same page size (PP-5): a stage
    without a layer kind or window length another stage has cannot run the same operations."""
    first = geometries[0]
    want = [(b.name, b.kind, b.lifetime) for b in first.bands]
    for g in geometries[1:]:
        if g.page_size != first.page_size:
            raise StagePartitionError(f"stage {g.stage} pages {g.page_size} tokens, stage {first.stage} "
                                      f"{first.page_size}: every stage needs the same page size")
        have = [(b.name, b.kind, b.lifetime) for b in g.bands]
        if have != want:
            missing = sorted({n for n, _k, _lt in want} ^ {n for n, _k, _lt in have})
            raise StagePartitionError(
                f"stage {g.stage} has sub-pools {[n for n, _k, _lt in have]}, stage {first.stage} "
                f"{[n for n, _k, _lt in want]} (differing: {', '.join(missing) or 'their lifetimes'}): "
                "every stage needs the same layer kinds and window lengths")


class StageCapacity:
    """The capacity questions of one stage's chain, answered on every stage's simulated snapshot,
    and the digest of those answers (PP-7..10, PP-15)."""

    def __init__(self, chain: ChainAllocator, geometries: Sequence[StageGeometry], stage: int) -> None:
        geometries = tuple(sorted(geometries, key=lambda g: g.stage))
        if not geometries:
            raise StagePartitionError("no stage geometry to install")
        if [g.stage for g in geometries] != list(range(len(geometries))):
            raise StagePartitionError(f"stage geometries for stages {[g.stage for g in geometries]}: "
                                      f"need one per stage 0..{len(geometries) - 1}")
        check_same_sub_pools(geometries)
        if not 0 <= stage < len(geometries) or geometries[stage] != StageGeometry.of_chain(chain, stage):
            raise StagePartitionError(f"stage {stage}'s geometry is not this chain's: install the geometry "
                                      "this allocator reported")
        self.chain = chain
        self.stage = stage
        self.geometries = geometries
        self._memo: tuple[int, tuple[ChainSnapshot, ...]] | None = None
        self._empty = tuple(simulated_snapshot(g, _EMPTY) for g in geometries)
        self._fold = hashlib.blake2b(digest_size=16)
        self.questions = 0

    # -- the snapshots ------------------------------------------------------------------------------

    def counts(self) -> SharedCounts:
        return shared_counts(self.chain)

    def snapshots(self) -> tuple[ChainSnapshot, ...]:
        """Every stage's simulated snapshot, kept until the capacity epoch moves."""
        epoch = self.chain.epoch.value
        if self._memo is None or self._memo[0] != epoch:
            counts = self.counts()
            self._memo = (epoch, tuple(simulated_snapshot(g, counts) for g in self.geometries))
        return self._memo[1]

    def _fits(self, pages: tuple[int, ...], freed: Sequence[int] | None = None) -> bool:
        """A demand fits only where it fits on every stage (PP-8)."""
        for snap in self.snapshots():
            if freed is not None:
                snap = reclaimed_snapshot(snap, freed)
            if not feasible(snap, pages):
                return False
        return True

    def id_shortfall(self, n_pages: int, n_slots: int, evictable_ids: int = 0) -> str | None:
        """Why some stage lacks the owner's virtual ids or the state slots, or None (PP-7)."""
        counts = self.counts()
        for g in self.geometries:
            free = g.virtual_ids - counts.virtual_held
            if n_pages > free + evictable_ids:
                return f"stage {g.stage}: owner has {free} free virtual pages, {n_pages} needed"
            if n_slots > g.slot_ids - counts.slots_held:
                return f"stage {g.stage}: state sub-pool has {g.slot_ids - counts.slots_held} free slot ids, " \
                       f"{n_slots} needed"
        return None

    # -- the questions ------------------------------------------------------------------------------

    def _answer(self, question: str, args: tuple, answer: bool) -> bool:
        if invariants.level() is not InvariantCheckLevel.OFF:
            self._fold.update(repr((question, args, answer)).encode())
            self.questions += 1
        return answer

    def units_fit(self, pages: tuple[int, ...]) -> bool:
        return self._answer("units_fit", pages, self._fits(pages))

    def fits_after_frees(self, pages: tuple[int, ...], freed: Sequence[int]) -> bool:
        freed = tuple(int(f) for f in freed)
        return self._answer("fits_after_frees", (pages, freed), self._fits(pages, freed))

    def take_fits(self, pages: tuple[int, ...]) -> bool:
        """Whether a take (or `ensure_capacity`) of `pages` is served on every stage."""
        return self._answer("take", pages, self._fits(pages))

    def ids_fit(self, n_pages: int, n_slots: int) -> str | None:
        """The owner's id shortfall of a take on every stage: None when the ids are there."""
        short = self.id_shortfall(n_pages, n_slots)
        self._answer("ids", (n_pages, n_slots), short is None)
        return short

    def admits(self, demand: KVDemand, reclaimable: Sequence[int] | None) -> bool:
        chain = self.chain
        evictable = reclaimable[chain.owner.pool.index] if reclaimable is not None else 0
        freed = tuple(int(r) for r in reclaimable) if reclaimable is not None else None
        ok = (self.id_shortfall(demand.virtual_pages, demand.state_slots, evictable) is None
              and chain._within_caps(demand.pages, reclaimable)
              and self._fits(chain._check_demand(demand.pages), freed))
        return self._answer("admits", (demand.pages, demand.virtual_pages, demand.state_slots, freed), ok)

    def fits_empty(self, pages: tuple[int, ...], virtual_pages: int, state_slots: int) -> bool:
        """Whether a demand fits every stage's empty chain (the memory clip's question)."""
        for g, snap in zip(self.geometries, self._empty):
            if virtual_pages > g.virtual_ids or state_slots > g.slot_ids or not feasible(snap, pages):
                return False
        return True

    def record_clip(self, input_len: int, max_new_tokens: int, clip: int | None) -> int | None:
        """Fold the memory clip's answer (the output tokens it allows) into the digest."""
        self._answer("max_new_tokens_for_memory", (input_len, max_new_tokens, clip), clip is not None)
        return clip

    # -- estimates (PP-9) ---------------------------------------------------------------------------

    def available_bytes_estimate(self) -> int:
        """The least free chain bytes of any stage's simulated snapshot."""
        counts = self.counts()
        return min(g.chain_bytes - sum(n * b.page_bytes for n, b in zip(counts.held, g.bands))
                   for g in self.geometries)

    def usage(self) -> float:
        """Held bytes over chain bytes on the fullest stage."""
        counts = self.counts()
        return max(sum(n * b.page_bytes for n, b in zip(counts.held, g.bands)) / max(1, g.chain_bytes)
                   for g in self.geometries)

    def estimated_units_available(self, index: int) -> int:
        """The fewest units band `index` could take on any stage, from free bytes and id room."""
        counts = self.counts()
        out = None
        for g in self.geometries:
            free = g.chain_bytes - sum(n * b.page_bytes for n, b in zip(counts.held, g.bands))
            band = g.bands[index]
            pages = free // band.page_bytes
            if index == len(g.bands) - 1:
                pages = min(pages, g.virtual_ids - counts.virtual_held)
            units = pages * band.units_per_page
            out = units if out is None else min(out, units)
        return int(out or 0)

    # -- the digest (PP-15) -------------------------------------------------------------------------

    def take_digest(self) -> str:
        """The digest of this iteration's questions and answers and the units held now; the fold
        starts over. Stages that made the same decisions return the same string."""
        counts = self.counts()
        self._fold.update(repr((counts.held, counts.virtual_held, counts.slots_held)).encode())
        digest = self._fold.hexdigest()
        self._fold = hashlib.blake2b(digest_size=16)
        self.questions = 0
        return digest


def check_stage_agreement(mine: str, previous: str, stage: int, iteration: int) -> None:
    """`chain.stage_capacity_agreement` (CHK-9, PP-16): a stage whose digest differs from the
    previous stage's made other capacity decisions or holds other units. Fatal at level 1 and 2."""
    if mine != previous:
        invariants.fail("chain.stage_capacity_agreement",
                        f"iteration {iteration}: stage {stage}'s capacity digest {mine} differs from stage "
                        f"{stage - 1}'s {previous}")
