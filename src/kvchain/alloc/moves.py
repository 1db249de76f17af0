"""`ChainMoves`: everything that copies pages inside the arena, done in one place.

Compaction plans its moves without doing them (`alloc/compaction.py`), and relief plans a layout
(`alloc/pricing.py`); this is where those plans are carried out: a band's flush (opportunistic, at
most a few moves and only where the free gap is small, or relief's, uncapped), a float's relocation
to a new block, and a relief plan realized in order (compact the ends, relocate floats, extend
pinned ones). Each copy first clears what the ledger says may still touch its sources and
destinations (`ChainWaits`), and every move bumps `move_epoch`."""

from __future__ import annotations

import logging

import numpy as np

from ..errors import InvariantError
from ..memory.arena import ArenaLayout
from ..memory.copy import PageCopier
from ..plan import Placement
from .band import Band, FloatBand, geometry_ready
from .compaction import plan_flush, plan_relocation
from .page_usage import Consumer
from .pricing import LayoutPlan
from .waits import ChainWaits

log = logging.getLogger("kvchain.chain")


class ChainMoves(ChainWaits):
    """Flushes, relocations and relief's realization over the bands of one chain."""

    layout: ArenaLayout
    copier: PageCopier
    #: bumped by every move and relocation: ids translated before it may name pages that moved
    move_epoch: int
    #: float relocations so far (`_relocate`): a float band's live pages copied to a new block
    relocations: int
    max_moves_per_call: int
    log_compaction_stats: bool
    compaction_gap_fraction: float

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

    def realize(self, layout: LayoutPlan, hold_network: bool = False) -> None:
        """Compact the listed ends, relocate floats in move order, extend pinned floats (ALLOC-16/17).
        The takes that follow run in chain order. A plan priced with network rows in place
        (`hold_network`) compacts around them as around fixed pages."""
        for i in layout.compact_ends:
            self.relief_flush(self.bands[i], hold_network)
        for r in layout.relocations:
            self._relocate(self._float(r.band), r.lo, r.size)
        for e in layout.extensions:
            band = self._float(e.band)
            self.wait_fences(band, band.extend(e.side, e.pages))

    def _float(self, index: int) -> FloatBand:
        band = self.bands[index]
        if not isinstance(band, FloatBand):
            raise InvariantError("chain.relief", f"the plan moves {band.name}, which is not a float")
        return band

    def flush_opportunistic(self, max_moves: int | None = None) -> int:
        """Close holes lazily: at most KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL moves per end band,
        and only in an end whose free gap is below KVCHAIN_LAZY_COMPACTION_GAP_FRACTION of the chain
        (pages are not copied while there is room to spare); boundary holes are always absorbed."""
        if max_moves is None:
            max_moves = self.max_moves_per_call
        moved = 0
        for band in self.bands:
            if band.n_holes:  # a band without holes has nothing to close or absorb
                moved += self.flush(band, max_moves if self._under_pressure(band) else 0)
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

    def relief_flush(self, band: Band, hold_network: bool = False) -> int:
        """The relief flush (the spec's urgent flush), entered only from relief (COMP-4): settled
        first, uncapped, packs every movable page (COMP-8, COMP-13); floats only hand back boundary
        holes. Returns pages moved."""
        if band.placement is Placement.FLOAT:
            return self.flush(band, None)
        geometry_ready(band)
        if band.n_pending:
            self._settle(band)
        return self.flush(band, None, relief=True, hold_network=hold_network)

    def flush(self, band: Band, max_moves: int | None, relief: bool = False, hold_network: bool = False) -> int:
        """One flush of one band: the moves `plan_flush` plans, then the frontier absorbs the holes
        left at it (a float only absorbs; COMP-21, COMP-22). Returns pages moved."""
        if band.placement is Placement.FLOAT:
            fences = band.absorb_boundary_holes()
            if fences:
                self.fences += fences
            return 0
        if band.parked or band.span == 0 or not band.n_holes:
            return 0
        moved = 0
        if max_moves != 0:
            moves = plan_flush(band, max_moves, relief, hold_network)
            if moves is not None:
                self._move(band, moves.src, moves.dst)
                moved = len(moves.src)
        fences = band.absorb_boundary_holes()
        if fences:
            self.fences += fences
        band.stats["flushes"] += 1
        return moved

    def _move(self, band: Band, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy live pages `src` into holes `dst` and rebind their virtual ids (COMP-16). The copy
        first waits every writer of the sources (COMP-17), clears the destinations and their
        fences; a source the forward in flight may still read keeps that hazard (COMP-18)."""
        self._clear(band, band.usage.writers_clearance(src))
        self._clear(band, band.usage.clearance(Consumer.SCHEDULE_COPY, dst))
        self.wait_fences(band, dst)
        self.copier.move_pages(band.grid, src, dst)
        band.commit_moves(src, dst, self.forward_steps.newest_unprocessed())
        self.move_epoch += 1
        self.log("move", band.name, src, dst)

    def _relocate(self, band: FloatBand, lo: int, size: int) -> None:
        """Make a float's span `[lo, lo + size)` (COMP-23): the live pages outside it are copied
        into its open pages and rebound, the rest stay, and every other page of the span is a hole.
        Pending pages settle first (`band.geometry_ready`). The copy writes holes only, so it waits
        no forward that reads live pages; it waits the writers of what it reads and the uses of what
        it writes, and the old block's pages that leave the span keep their unfinished uses as
        fences in the arena."""
        geometry_ready(band)
        if band.n_pending:
            self._settle(band, park=False)
        reloc = plan_relocation(band, lo, size)
        self.wait_fences(band, reloc.fresh)
        self._clear(band, band.usage.clearance(Consumer.SCHEDULE_COPY, reloc.reused))
        key = self.forward_steps.newest_unprocessed()
        if len(reloc.src):
            self._clear(band, band.usage.writers_clearance(reloc.src))
            self.copier.move_pages(band.grid, reloc.src, reloc.dst, label="relocate")
        self._add_fences(band.relocate(reloc.src, reloc.dst, lo, size, key))
        self.move_epoch += 1
        self.relocations += 1
        self.log("relocate", band.name, lo, size)

    def prewarm_compaction(self) -> None:
        """Run the page-copy path once at startup (COMP-25) so the first serving-time move neither
        compiles kernels nor allocates memory outside the pools: copy each band's sink (or base
        page) onto itself."""
        for band in self.bands:
            grid = band.grid
            page = grid.sink_id if grid.sink_id is not None else grid.first_id
            if page < grid.n_grid:
                ids = np.array([page], dtype=np.int64)
                self.copier.move_pages(grid, ids, ids, label="prewarm")
