"""Compaction and float relocation as move plans: which pages move where, read from a band's
logical state alone. Nothing here touches the device or changes a band; `ChainAllocator` clears
what each plan's copies need (`CLEARANCE`), launches them and commits the plan to the band.

An end band compacts by moving the live pages nearest its frontier into the holes nearest its
base (`plan_flush`); a float never compacts, and moves only when a planned layout relocates it
(`plan_relocation`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, InvariantError
from ..plan import Placement
from .band import LIVE, VACATED, Band, FloatBand
from .page_usage import Hazard


@dataclass(frozen=True)
class MovePlan:
    """Copy live pages `src` of one band into its holes `dst`, pair by pair (disjoint sets)."""

    src: np.ndarray
    dst: np.ndarray


@dataclass(frozen=True)
class RelocationPlan:
    """A float's block move: live pages `live` to `dst = [lo, lo + len(live))`, the span becoming
    `[lo, lo + size)`. `shifts` are the order-keeping copies (`PageCopier.shift_pages`)."""

    lo: int
    size: int
    live: np.ndarray
    dst: np.ndarray
    fresh: np.ndarray  # pages of the new block outside the old one: their fences are cleared first
    reused: np.ndarray  # destinations inside the old block: the ledger's clearance runs on them
    over_live: bool  # the new block overlaps live pages, which a forward in flight may still read
    shifts: tuple[tuple[np.ndarray, np.ndarray], ...]


def plan_flush(band: Band, max_moves: int | None, relief: bool = False, hold_network: bool = False) -> MovePlan | None:
    """The moves of one flush of an end band, or None when it moves nothing.

    Opportunistic (COMP-5..14): with pending pages it moves nothing; it never waits an unretired
    forward and stops at a source one writes, at a fixed or vacated page; it leaves alone a band
    holding receive rows or written by a speculative forward. For relief (COMP-6/8/11): uncapped,
    and it steps over fixed pages, which never move, and over network-held rows when the relief
    plan kept them in place (`hold_network`, ALLOC-14)."""
    if max_moves == 0 or band.n_pending:
        return None
    if not relief and (band.n_held or band.usage.unknown_writer is not None):
        return None
    holes = band.holes.view()
    down = band.placement is Placement.DOWN_END
    k = len(holes) if max_moves is None else min(max_moves, len(holes))
    if k < len(holes):
        part = np.partition(holes, len(holes) - k if down else k - 1)
        dst = part[len(holes) - k :] if down else part[:k]
    else:
        dst = holes.copy()
    dst = np.sort(dst)[::-1] if down else np.sort(dst)
    if not relief and band.usage.uses:
        # never wait an unretired forward: skip holes one may still read (COMP-5)
        dst = dst[~_forward_hazard(band, dst)]
    fixed = band.fixed_mask
    if relief and hold_network and (band.n_held or band.usage.uses):
        fixed = fixed.copy()
        fixed[band.network_held()] = True
    if relief:
        src = band.frontier_scan(k, lambda st, ids: (st == LIVE) & ~fixed[ids])
    else:
        written = _written_in_flight(band) if band.usage.uses else None
        blocked = (lambda st, ids: fixed[ids] | (st == VACATED) | written[ids]) if written is not None else \
            (lambda st, ids: fixed[ids] | (st == VACATED))
        src = band.frontier_scan(k, lambda st, ids: st == LIVE, stop=blocked)
    n = min(len(src), len(dst))
    beyond = dst[:n] > src[:n] if down else dst[:n] < src[:n]
    k = int(np.count_nonzero(beyond))
    if not k:
        return None
    return MovePlan(src[:k].copy(), dst[:k].copy())


def _forward_hazard(band: Band, ids: np.ndarray) -> np.ndarray:
    mask = np.zeros(band.grid.n_grid, dtype=bool)
    for use in band.usage.uses:
        if use.hazard is Hazard.FORWARD:
            mask[use.pages] = True
    return mask[ids]


def _written_in_flight(band: Band) -> np.ndarray:
    mask = np.zeros(band.grid.n_grid, dtype=bool)
    for use in band.usage.uses:
        if use.writes:
            mask[use.pages] = True
    return mask


def plan_relocation(band: FloatBand, lo: int, size: int) -> RelocationPlan:
    """Every live page of a float, in order, to `[lo, lo + live)` in a span `[lo, lo + size)`
    (COMP-23). The float must hold no pending (settled first), fixed or vacated page."""
    if band.n_fixed or band.n_vacated:
        raise InvariantError("band.relocate_fixed", f"{band.name} holds fixed or vacated pages and cannot move")
    live = band.live_pages()
    if size < len(live) or lo < band.grid.first_id or lo + size > band.grid.n_grid:
        raise CapacityError(f"{band.name}: block [{lo}, {lo + size}) cannot hold {len(live)} live pages")
    n = len(live)
    dst = np.arange(lo, lo + n, dtype=np.int64)
    # the old block, the new span and `dst` are ranges, `live` is sorted: range arithmetic, no sets
    old_lo, old_hi = (band.lo, band.hi) if not band.parked else (lo, lo)
    fresh = np.concatenate([np.arange(lo, min(lo + size, max(old_lo, lo)), dtype=np.int64),
                            np.arange(max(lo, old_hi), lo + size, dtype=np.int64)]) if old_hi > old_lo else \
        np.arange(lo, lo + size, dtype=np.int64)
    reused = np.arange(max(lo, old_lo), min(lo + n, old_hi), dtype=np.int64)
    over_live = bool(np.searchsorted(live, lo + n) > np.searchsorted(live, lo))
    return RelocationPlan(lo, size, live, dst, fresh=fresh, reused=reused, over_live=over_live,
                          shifts=_shifts(band, live, dst))


def _shifts(band: FloatBand, src: np.ndarray, dst: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """An order-keeping relocation in two launches: the pages moving down in ascending order, the
    pages moving up in descending order. Because the map keeps order, neither set writes a page the
    other reads, and within a set, in that order, no copy overwrites a source that is still to be
    read (`PageCopier.shift_pages`)."""
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if not len(src):
        return ()
    if (np.diff(src) <= 0).any() or (np.diff(dst) <= 0).any():
        raise InvariantError("band.relocate_order", f"{band.name}: a relocation must keep page order")
    down = dst < src
    out = []
    if down.any():
        out.append((src[down], dst[down]))
    if not down.all():
        out.append((src[~down][::-1], dst[~down][::-1]))
    return tuple(out)
