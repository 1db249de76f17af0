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
    """A float's move to the span `[lo, lo + size)`: the live pages already inside it stay where
    they are; those outside it (`src`) are copied into its lowest non-live pages (`dst`), so the
    copy moves only what the span leaves behind. `src` and `dst` are disjoint (one copy launch)."""

    lo: int
    size: int
    src: np.ndarray
    dst: np.ndarray
    fresh: np.ndarray  # pages of the new block outside the old one: their fences are cleared first
    reused: np.ndarray  # destinations inside the old block (holes): the ledger's clearance runs on them


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
    """The fewest copies that put every live page of a float inside `[lo, lo + size)` (COMP-23):
    a page already inside stays, and each page outside goes to the lowest page of the new span
    that holds none. A relief shifts a float by what its neighbours need, so most of its pages
    stay. The float must hold no pending (settled first), fixed or vacated page."""
    if band.n_fixed or band.n_vacated:
        raise InvariantError("band.relocate_fixed", f"{band.name} holds fixed or vacated pages and cannot move")
    live = band.live_pages()
    hi = lo + size
    if size < len(live) or lo < band.grid.first_id or hi > band.grid.n_grid:
        raise CapacityError(f"{band.name}: block [{lo}, {hi}) cannot hold {len(live)} live pages")
    # `live` is sorted: the pages inside the new span are one run of it
    first, last = np.searchsorted(live, lo), np.searchsorted(live, hi)
    src = np.concatenate([live[:first], live[last:]])
    open_ = lo + np.flatnonzero(band.state[lo:hi] != LIVE)
    dst = open_[: len(src)]
    # the old block and the new span are ranges: range arithmetic, no sets
    old_lo, old_hi = (band.lo, band.hi) if not band.parked else (lo, lo)
    fresh = np.concatenate([np.arange(lo, min(hi, max(old_lo, lo)), dtype=np.int64),
                            np.arange(max(lo, old_hi), hi, dtype=np.int64)]) if old_hi > old_lo else \
        np.arange(lo, hi, dtype=np.int64)
    reused = dst[(dst >= old_lo) & (dst < old_hi)]
    return RelocationPlan(lo, size, src, dst, fresh=fresh, reused=reused)
