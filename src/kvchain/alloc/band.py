"""`Band` (an end of the chain) and `FloatBand` (a band between the ends): passive page stores.

A band holds pages of its own page-byte size on its grid in the arena: a span `[lo, hi)` of grid
ids holding live pages, holes (free pages inside the span), pending pages (freed under a forward
still in flight) and vacated pages (move sources a network transfer still reads). A hand-out uses
holes, then settles pending batches, then grows the frontier to the layout `pricing.take_layout`
planned, so pricing and takes agree exactly. A free is logical: it leaves a hole (or a pending
page) at once, with no stream wait, and holes are closed later by compaction.

A band mutates only its own arrays and counts. What it needs from the rest of the chain (the
newest unprocessed forward, the planned layout) comes in as arguments, and what must happen
outside it comes back as values: the waits a settle needs (`Wait`, derived from `CLEARANCE`) and
the fences left by pages that leave its span while a use of them is unfinished (`Fence`).
`ChainAllocator` performs them; compaction's move plans come from `alloc/compaction.py`. What a
band holds and what reading it shows (pricing's snapshot) are `BandState` (`alloc/band_state.py`);
this module holds what changes it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .. import faults
from ..device.base import Event
from ..env import InvariantCheckLevel
from ..errors import InvariantError
from ..memory.arena import BandGrid
from ..plan import Placement, SubPool
from . import invariants
from .band_state import HOLE, LIVE, OUT, PENDING, SINK, VACATED, BandState, PageState, SnapshotMode
from .forward_steps import LaunchRecord, PendingBatch
from .npfast import has_duplicates, unique_sorted
from .page_usage import Fence, Hazard, PageUse, Wait, forward_reads
from .pricing import BandSnap, CapacityEpoch, Side

__all__ = [
    "HOLE", "LIVE", "OUT", "PENDING", "SINK", "VACATED", "Band", "BandState", "FloatBand", "PageState",
    "SnapshotMode", "allocator_operation", "check_freed_pages", "check_virtual_bound", "geometry_ready",
]

_NO_FENCES: tuple[Fence, ...] = ()


class allocator_operation:
    """One allocator operation (a take, a free, a flush, an advance): the invariant level is read
    once at its start, and the rules that hold within one operation (LIFE-41) are checked in it."""

    __slots__ = ("pinned",)

    def __enter__(self) -> None:
        self.pinned = invariants.begin_operation()

    def __exit__(self, *exc) -> None:
        invariants.end_operation(self.pinned)


class Band(BandState):
    """An end of the chain: it grows from its end of the arena toward the other. The mutations of
    a band's state: hand-outs, the page state machine (frees, pending batches, vacated pages),
    forwards' uses, committed moves and the span's retreat, and id binding."""

    # -- hand-out -----------------------------------------------------------------------------

    def hand_out(self, n: int, after: BandSnap | None,
                 fired: Callable[[Event], bool] | None = None) -> tuple[np.ndarray, np.ndarray | None, Sequence[Wait]]:
        """Make `n` pages live: holes, then settled pending batches, then growth to `after` (this
        band's layout after the take, from `take_layout`; needed only when the band grows). Returns
        the pages, those grown over (None when none), and the waits the settled batches need.

        The caller (`ChainAllocator.take_from`) checked that the take fits before calling, so a
        refused take changes nothing (ALLOC-7). `fired` exists only for a fault point."""
        holes, pending = self.n_holes, self.n_pending
        grow = n - holes - pending if n > holes + pending else 0
        from_pending = min(max(0, n - holes), pending)
        waits: Sequence[Wait] = ()
        if from_pending:
            # settled pages are taken at once: a float must not park in between
            waits, _ = self.settle_pending(self.pending.oldest_covering(from_pending), park=False)
        from_holes = n - grow
        ids = self._take_holes(from_holes, fired) if from_holes else None
        grown = None
        if grow:
            if after is None:
                raise InvariantError("band.hand_out", f"{self.name}: {n} pages need growth and no planned layout")
            grown = self._grow_to(after)
            ids = grown if ids is None else np.concatenate([ids, grown])
        self.state[ids] = LIVE
        self.n_live += n
        return ids, grown, waits

    def _take_holes(self, k: int, fired: Callable[[Event], bool] | None) -> np.ndarray:
        """`k` holes, those no consumer must wait for first (LEDG-31): the order reads the ledger's
        logical state only, never whether an event fired."""
        cleared = self._fired_pages(fired) if fired is not None else None
        self.n_holes -= k
        if not self.usage.uses:
            return self.holes.pop(k)
        listed = self.holes.view()
        busy = self.usage.busy(listed)
        if cleared is not None:
            busy &= ~cleared[listed]
        if not busy[len(listed) - k :].any():
            return self.holes.pop(k)
        order = np.concatenate([np.flatnonzero(busy), np.flatnonzero(~busy)])  # clean last: popped first
        chosen = order[len(order) - k :]
        ids = listed[chosen].copy()
        keep = np.ones(len(listed), dtype=bool)
        keep[chosen] = False
        self.holes.keep(keep)
        return ids

    def _fired_pages(self, fired: Callable[[Event], bool]) -> np.ndarray:
        """Pages whose uses' events fired (fault `holes_by_fired_event` only: a decision on this
        would differ by rank)."""
        cleared = np.zeros(self.grid.n_grid, dtype=bool)
        for use in self.usage.uses:
            if use.event is not None and fired(use.event):
                cleared[use.pages] = True
        return cleared

    def _grow_to(self, after: BandSnap) -> np.ndarray:
        """Extend the span to the planned one; the new grid ids become the taken pages."""
        if self.parked:
            ids = np.arange(after.lo, after.hi, dtype=np.int64)
            self.parked = False
            self.lo, self.hi = after.lo, after.hi
            return ids
        parts = []
        if after.lo < self.lo:
            parts.append(np.arange(after.lo, self.lo, dtype=np.int64))
            self.lo = after.lo
        if after.hi > self.hi:
            parts.append(np.arange(self.hi, after.hi, dtype=np.int64))
            self.hi = after.hi
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def fix(self, ids: np.ndarray, label: str) -> PageUse:
        """Fix live pages in place (LEDG-6): they never move and are excluded from every consumer."""
        use = self.usage.record(PageUse(Hazard.FIXED, ids, writes=False, label=label))
        self.fixed_mask[ids] = True
        self.n_fixed += len(ids)
        return use

    def unfix(self, use: PageUse) -> None:
        """End a fixing use (LEDG-6); a page another fixing use still covers stays fixed."""
        self.usage.end(use)
        self.fixed_mask[use.pages] = False
        for other in self.usage.uses:
            if other.hazard is Hazard.FIXED:
                self.fixed_mask[other.pages] = True
        self.n_fixed = int(np.count_nonzero(self.fixed_mask))

    # -- the page state machine: freeing, pending, vacated --------------------------------------

    def free(self, ids: np.ndarray, key: LaunchRecord | None) -> Sequence[Fence]:
        """Logical free (LIFE-2, LIFE-3): the pages are unbound and leave at once, with no stream
        wait. Under a recorded, unprocessed forward (`key`) they pend on it (LIFE-24); otherwise
        they become holes (LIFE-25). A page a network transfer still reads is vacated until it is
        released. Returns the fences a float that parks leaves."""
        check_freed_pages(self, ids)
        self.ids.unbind_physical(ids)
        self.n_live -= len(ids)
        if self.usage.uses:
            net = self.network_used(ids)
            if net.any():
                self._vacate(ids[net])
                ids = ids[~net]
        self._release(ids, key)
        return self._after_free()

    def _release(self, ids: np.ndarray, key: LaunchRecord | None) -> None:
        """Pages out of use: pending under `key` when a forward is in flight, else holes."""
        if key is not None:
            self.state[ids] = PENDING
            self.pending.add(key.step, key.event, ids)
            self.n_pending += len(ids)
        else:
            self.state[ids] = HOLE
            self.holes.push(ids)
            self.n_holes += len(ids)

    def _vacate(self, ids: np.ndarray) -> None:
        self.state[ids] = VACATED
        self.n_vacated += len(ids)

    def take_ready_vacated(self, key: LaunchRecord | None) -> Sequence[Fence]:
        """Vacated pages no network transfer reads any more return to use (COMP-18): pending under
        the newest forward in flight (`key`), else holes."""
        if not self.n_vacated:
            return _NO_FENCES
        vacated = np.flatnonzero(self.state == VACATED)
        ready = vacated[~self.network_used(vacated)]
        if not len(ready):
            return _NO_FENCES
        self.n_vacated -= len(ready)
        self._release(ready, key)
        return self._after_free()

    def _after_free(self) -> Sequence[Fence]:
        return _NO_FENCES

    def settle_pending(self, n_batches: int | None = None, park: bool = True) -> tuple[list[Wait], Sequence[Fence]]:
        """Settle the oldest `n_batches` pending batches (all when None): their pages become holes,
        and the returned waits make the schedule stream wait their forwards' events; the host
        never blocks (LIFE-29). The forwards stay unprocessed (LIFE-30)."""
        n = len(self.pending.batches) if n_batches is None else n_batches
        if n <= 0:
            return [], _NO_FENCES
        batches = self.pending.pop_oldest(n)
        waits = [w for b in batches for w in forward_reads(b.event, b.key, f"settle pending under step {b.key}")]
        fences = self._pending_to_holes(batches, park)
        self.stats["settled_batches"] += len(batches)
        return waits, fences

    def release_pending_through(self, step: int) -> Sequence[Fence]:
        """Return every batch keyed at or before a processed forward to the holes (LIFE-27)."""
        batches = self.pending.pop_through(step)
        return self._pending_to_holes(batches) if batches else _NO_FENCES

    def _pending_to_holes(self, batches: list[PendingBatch], park: bool = True) -> Sequence[Fence]:
        ids = np.concatenate([b.pages() for b in batches])
        self.state[ids] = HOLE
        self.holes.push(ids)
        self.n_pending -= len(ids)
        self.n_holes += len(ids)
        return self._after_free() if park else _NO_FENCES

    # -- forwards -------------------------------------------------------------------------------

    def set_inflight_forward(self, step: int, event: Event, pages: np.ndarray | None) -> None:
        """Record what a forward writes here until it retires (LEDG-2). `pages` None: unknown
        (a speculative step): compaction then moves nothing in this band until it retires."""
        if pages is None:
            self.usage.unknown_writer = PageUse(Hazard.FORWARD, np.empty(0, dtype=np.int64), writes=True,
                                                event=event, step=step, label=f"unknown writes of step {step}")
        elif len(pages):
            self.usage.record(PageUse(Hazard.FORWARD, unique_sorted(pages), writes=True, event=event, step=step,
                                      label=f"writes of step {step}"))

    def retire_forwards_through(self, step: int) -> None:
        self.usage.end_forwards_through(step)

    # -- the span: moves committed, holes absorbed -------------------------------------------------

    def commit_moves(self, src: np.ndarray, dst: np.ndarray, key: LaunchRecord | None) -> None:
        """Live pages `src` were copied into holes `dst`: rebind their virtual ids (COMP-16). A
        source the forward in flight (`key`) may still read is left a hole with that forward's
        hazard, which the next writer waits (COMP-18); one a network send reads is vacated until
        it is released."""
        self.ids.rebind_physical(src, dst)
        self.state[dst] = LIVE
        self.holes.keep(self.state[self.holes.view()] == HOLE)
        self._vacate_sources(src, key)
        self.stats["moves"] += len(src)
        self.epoch.bump()

    def _vacate_sources(self, src: np.ndarray, key: LaunchRecord | None) -> None:
        if faults.ACTIVE and faults.active(faults.REUSE_VACATED):
            self.state[src] = HOLE
            self.holes.push(src)
            return
        net = self.network_used(src) if self.usage.uses else np.zeros(len(src), dtype=bool)
        if net.any():
            # the destinations the move filled were counted as holes; a vacated source does not
            # give one back
            self._vacate(src[net])
            self.n_holes -= int(net.sum())
        holes = src[~net]
        self.state[holes] = HOLE
        self.holes.push(holes)
        if key is not None and len(src):
            self.usage.record(PageUse(Hazard.FORWARD, src.copy(), writes=False, event=key.event, step=key.step,
                                      vacated=True, label=f"vacated under step {key.step}"))

    def absorb_boundary_holes(self) -> Sequence[Fence]:
        """Retreat the frontier over trailing holes; never over a pending, live, fixed or vacated page.
        Holes that leave with unfinished uses on them become fences in the arena (COMP-20)."""
        if self.parked or self.span == 0:
            return _NO_FENCES
        frontier = self.lo if self.placement is Placement.DOWN_END else self.hi - 1
        if self.state[frontier] != HOLE:
            return _NO_FENCES
        first_kept = self.frontier_scan(1, lambda st, ids: st != HOLE)
        if self.placement is Placement.DOWN_END:
            new_lo = int(first_kept[0]) if len(first_kept) else self.hi
            if new_lo > self.lo:
                fences = self._drop_holes(np.arange(self.lo, new_lo))
                self.lo = new_lo
                return fences
        else:
            new_hi = int(first_kept[0]) + 1 if len(first_kept) else self.lo
            if new_hi < self.hi:
                fences = self._drop_holes(np.arange(new_hi, self.hi))
                self.hi = new_hi
                return fences
        return _NO_FENCES

    def _drop_holes(self, ids: np.ndarray) -> list[Fence]:
        """Holes that leave the span: out of the band; their unfinished uses fence their bytes."""
        fences = self.fences_leaving(ids)
        self.state[ids] = OUT
        self.holes.keep(self.state[self.holes.view()] == HOLE)
        self.n_holes -= len(ids)
        return fences

    def fences_leaving(self, ids: np.ndarray) -> list[Fence]:
        """Pages leaving the band: every unfinished use on them ends here and becomes a fence over
        their bytes, which the next writer of those bytes clears (COMP-20)."""
        if not self.usage.uses or not len(ids) or not self.usage.count[ids].any():
            return []
        leaving = np.zeros(self.grid.n_grid, dtype=bool)
        leaving[ids] = True
        fences: list[Fence] = []
        for use in list(self.usage.uses):
            if use.hazard is Hazard.FIXED:
                continue
            out = leaving[use.pages]
            if not out.any():
                continue
            lo, hi = self.byte_ranges(use.pages[out])
            fences += [Fence(int(a), int(b), use) for a, b in zip(lo, hi)]
            self.usage.end(use)
            if not out.all():
                rest = PageUse(use.hazard, use.pages[~out], use.writes, use.event, use.step, use.transfer,
                               use.vacated, use.label)
                self.usage.record(rest)
        return fences

    # -- ids ---------------------------------------------------------------------------------

    def bind(self, virtual: np.ndarray, physical: np.ndarray) -> None:
        self.ids.bind(virtual, physical)

    def translate(self, virtual: np.ndarray) -> np.ndarray:
        """Physical page ids for virtual ones; an unbound id reads as the sink (IDS-4)."""
        return np.take(self.ids.read_map, virtual)


class FloatBand(Band):
    """A band between the ends. It never compacts (its holes are reused where they are), moves only
    when a planned layout relocates it, and is parked (transparent to its neighbours) when it holds
    no live, fixed, pending or vacated page."""

    def __init__(self, pool: SubPool, grid: BandGrid, epoch: CapacityEpoch, n_virtual: int) -> None:
        super().__init__(pool, grid, epoch, n_virtual)
        self.lo = self.hi = -1
        self.parked = True

    def _after_free(self) -> Sequence[Fence]:
        if not self.parked and self.n_live + self.n_pending + self.n_fixed + self.n_vacated == 0:
            return self.park()
        return _NO_FENCES

    def park(self) -> Sequence[Fence]:
        """Give the whole span back: an empty float is transparent (COMP-24)."""
        if self.n_live + self.n_pending + self.n_fixed + self.n_vacated:
            raise InvariantError("band.park_nonempty", f"{self.name} cannot park with pages in it")
        if self.parked:
            return _NO_FENCES
        fences = self._drop_holes(np.arange(self.lo, self.hi))
        self.lo = self.hi = -1
        self.parked = True
        return fences

    def absorb_boundary_holes(self) -> Sequence[Fence]:
        """Floats never compact: a flush only hands back the holes at either end of the span
        (COMP-21, COMP-22), and parks a float left with none but holes."""
        if self.parked or not self.n_holes:
            return _NO_FENCES
        if self.state[self.lo] != HOLE and self.state[self.hi - 1] != HOLE:
            return _NO_FENCES
        span = self.state[self.lo : self.hi]
        keep = np.flatnonzero(span != HOLE)
        if not len(keep):
            return self.park()
        new_lo, new_hi = self.lo + int(keep[0]), self.lo + int(keep[-1]) + 1
        absorbed = np.concatenate([np.arange(self.lo, new_lo), np.arange(new_hi, self.hi)])
        if not len(absorbed):
            return _NO_FENCES
        fences = self._drop_holes(absorbed)
        self.lo, self.hi = new_lo, new_hi
        return fences

    def relocate(self, src: np.ndarray, dst: np.ndarray, lo: int, size: int, key: LaunchRecord | None) -> list[Fence]:
        """Live pages `src` were copied to the open pages `dst` of the new span `[lo, lo + size)`
        (COMP-23); the other live pages stayed, and every other page of the span is a hole. The
        copied pages' old positions carry the forward in flight's hazard; pages of the old block
        that leave the span keep their unfinished uses as the returned fences."""
        if len(src):
            self.ids.rebind_physical(src, dst)
            self.stats["moves"] += len(src)
            if key is not None:
                self.usage.record(PageUse(Hazard.FORWARD, src.copy(), writes=False, event=key.event, step=key.step,
                                          vacated=True, label=f"relocated under step {key.step}"))
        old = np.arange(self.lo, self.hi, dtype=np.int64) if not self.parked else np.empty(0, dtype=np.int64)
        # the old block less the new span: both are ranges, so two ranges (no sort of the block)
        leaving = old[(old < lo) | (old >= lo + size)]
        fences = self.fences_leaving(leaving) if len(leaving) else []
        span = self.state[lo : lo + size]
        stays = span == LIVE  # read before the old block leaves: only its live pages are LIVE
        self.state[old] = OUT
        span[:] = HOLE
        span[stays] = LIVE
        self.state[dst] = LIVE
        holes = lo + np.flatnonzero(span == HOLE)
        self.holes.keep(np.zeros(self.holes.count, dtype=bool))
        self.holes.push(holes)
        self.n_holes = len(holes)
        self.parked = False
        self.lo, self.hi = lo, lo + size
        return fences

    def extend(self, side: Side, pages: int) -> np.ndarray:
        """Grow the span by `pages` holes on one side, with no copy (a planned pinned float).
        Returns the new pages, whose fences the caller clears."""
        if pages <= 0:
            return np.empty(0, dtype=np.int64)
        if side is Side.UP:
            ids = np.arange(self.hi, self.hi + pages, dtype=np.int64)
            self.hi += pages
        else:
            ids = np.arange(self.lo - pages, self.lo, dtype=np.int64)
            self.lo -= pages
        self.state[ids] = HOLE
        self.holes.push(ids)
        self.n_holes += pages
        return ids


# -- checks on one band (`KVCHAIN_INVARIANT_CHECK`) ------------------------------------------------


def check_freed_pages(band: Band, ids: np.ndarray) -> None:
    """`band.free_of_bound_page` (CHK-5): every page a free names is live and bound, so a double
    free or a free of a page never allocated fails instead of returning a tombstone to the holes."""
    if invariants.level() is InvariantCheckLevel.OFF:
        return
    ids = np.asarray(ids)
    in_grid = (ids >= 0) & (ids < band.grid.n_grid)
    bad = ~in_grid
    if in_grid.all():
        bad = (band.state[ids] != LIVE) | (band.ids.p2v[ids] < 0)
        if has_duplicates(ids):
            invariants.fail("band.free_of_bound_page", f"{band.name}: a free names the same page twice")
    if bad.any():
        invariants.fail("band.free_of_bound_page", f"{band.name}: free of unbound pages {ids[bad][:8].tolist()}")
    if band.n_fixed and band.fixed_mask[ids[in_grid]].any():
        invariants.fail("band.free_outside_reservation",
                        f"{band.name}: a free names pages reserved for a host-tier load")


def check_virtual_bound(band: Band, virtual: np.ndarray) -> None:
    """A window free names rows still bound to the window (`chain.window_segment_bound`); other
    bands' frees of unbound ids are `band.free_of_bound_page`."""
    if invariants.level() is InvariantCheckLevel.OFF:
        return
    v = np.asarray(virtual)
    bad = (v < 0) | (v >= band.ids.n_virtual)
    if not bad.any():
        bad = band.ids.v2p[v] < 0
    if bad.any():
        check = "chain.window_segment_bound" if band.pool.window is not None else "band.free_of_bound_page"
        invariants.fail(check, f"{band.name}: free of virtual pages not bound here {v[bad][:8].tolist()}")


def geometry_ready(band: Band) -> None:
    """`band.geometry_ready` (CHK-11): layout-changing geometry sees a band with no pending page."""
    if band.n_pending and invariants.level() is not InvariantCheckLevel.OFF:
        invariants.fail("band.geometry_ready", f"{band.name}: {band.n_pending} pending pages under a layout change")
