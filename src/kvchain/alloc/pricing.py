"""Pure capacity pricing over a host-only snapshot of the chain.

A snapshot records each band's counts and byte frontiers, never hole positions, so pricing never
touches the device. `take_layout` is the one definition of how a band takes pages (holes, then
pending pages, then frontier growth; a float toward its larger gap; a parked float in the middle of
its region): the take (`ChainAllocator.take_from`, `Band.hand_out`) calls it too, so pricing and the
take cannot disagree.

`plan` asks whether a demand (pages per band, chain order) is served under one rearrangement step:
`NO_MOVE` (bands in place), `FLUSH_ENDS` (the ends compacted) or `RELAYOUT` (floats relocated
between the compacted ends). `feasible` asks whether any reachable layout serves it; `first_plan`
finds the least step that does."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import InputError, InvariantError
from ..plan import Placement


class CapacityEpoch:
    """A counter that moves whenever anything a capacity answer depends on changes (CAP-6, CAP-7):
    a memoised snapshot is good while it has not moved."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class Step(enum.IntEnum):
    NO_MOVE = 0
    FLUSH_ENDS = 1
    RELAYOUT = 2


class Side(enum.IntEnum):
    DOWN = 0
    UP = 1


class BandSnap(NamedTuple):
    """One band's counts and frontiers. Spans are grid ids `[lo, hi)`; a parked float has none."""

    index: int
    placement: Placement
    page_bytes: int
    origin: int
    first_id: int
    n_grid: int
    lo: int
    hi: int
    parked: bool
    live: int
    holes: int
    pending: int
    fixed: int
    fixed_far: int  # ends: pages from the band's base to its farthest fixed page (0 if none)
    pinned: bool  # a float that cannot be relocated (it holds fixed pages)

    @property
    def free(self) -> int:
        """Pages a take reuses without growing: holes and pending pages (LIFE-26)."""
        return self.holes + self.pending

    @property
    def bottom(self) -> int:
        return self.origin + self.lo * self.page_bytes

    @property
    def top(self) -> int:
        return self.origin + self.hi * self.page_bytes

    @property
    def span(self) -> int:
        return 0 if self.parked else self.hi - self.lo


@dataclass(frozen=True)
class ChainSnapshot:
    """The whole chain as pricing sees it."""

    bands: tuple[BandSnap, ...]
    chain_lo: int
    arena_bytes: int
    epoch: int = -1
    frees_pend: bool = False  # a free now would pend (a recorded forward is unprocessed)


@dataclass(frozen=True)
class Relocation:
    band: int
    lo: int
    size: int  # span after relocation: every live page inside it, the rest `size - live` holes


@dataclass(frozen=True)
class Extension:
    band: int
    side: Side
    pages: int


@dataclass(frozen=True)
class LayoutPlan:
    """A rearrangement that serves a demand, and the chain as it will be after the takes."""

    step: Step
    demand: tuple[int, ...]
    compact_ends: tuple[int, ...]
    relocations: tuple[Relocation, ...]
    extensions: tuple[Extension, ...]
    after: tuple[BandSnap, ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _transparent(b: BandSnap) -> bool:
    return b.parked


def neighbour_bounds(bands: Sequence[BandSnap], i: int, chain_lo: int, arena_bytes: int) -> tuple[int, int]:
    """(top byte of the nearest placed band below i, bottom byte of the nearest placed band above i).
    Parked floats are transparent: their neighbours see through them."""
    prev_top = chain_lo
    for j in range(i - 1, -1, -1):
        if not _transparent(bands[j]):
            prev_top = bands[j].top
            break
    next_bottom = arena_bytes
    for j in range(i + 1, len(bands)):
        if not _transparent(bands[j]):
            next_bottom = bands[j].bottom
            break
    return prev_top, next_bottom


def growth_rooms(b: BandSnap, prev_top: int, next_bottom: int) -> tuple[int, int]:
    """Pages a placed band could grow (down, up) on its own grid between its neighbours."""
    floor_id = max(b.first_id, _ceil_div(prev_top - b.origin, b.page_bytes))
    ceil_id = min(b.n_grid, (next_bottom - b.origin) // b.page_bytes)
    return b.lo - floor_id, ceil_id - b.hi


def take_layout(b: BandSnap, d: int, prev_top: int, next_bottom: int) -> BandSnap | None:
    """The band after it takes `d` pages, or None when it cannot. Mirrors `Band.hand_out`."""
    if d <= 0:
        return b
    free = b.free
    if d <= free:
        from_holes = min(d, b.holes)
        return b._replace(live=b.live + d, holes=b.holes - from_holes, pending=b.pending - (d - from_holes))
    grow = d - free
    taken = dict(live=b.live + d, holes=0, pending=0)
    if b.parked:
        floor_id = max(b.first_id, _ceil_div(prev_top - b.origin, b.page_bytes))
        ceil_id = min(b.n_grid, (next_bottom - b.origin) // b.page_bytes)
        room = ceil_id - floor_id
        if grow > room:
            return None
        lo = floor_id + (room - grow) // 2
        return b._replace(lo=lo, hi=lo + grow, parked=False, **taken)
    down, up = growth_rooms(b, prev_top, next_bottom)
    if b.placement is Placement.UP_END:
        return b._replace(hi=b.hi + grow, **taken) if grow <= up else None
    if b.placement is Placement.DOWN_END:
        return b._replace(lo=b.lo - grow, **taken) if grow <= down else None
    if up >= down:
        return b._replace(hi=b.hi + grow, **taken) if grow <= up else None
    return b._replace(lo=b.lo - grow, **taken) if grow <= down else None


def _simulate_takes(bands: list[BandSnap], demand: Sequence[int], chain_lo: int, arena_bytes: int) -> list[BandSnap] | None:
    for i, d in enumerate(demand):
        if d <= 0:
            continue
        prev_top, next_bottom = neighbour_bounds(bands, i, chain_lo, arena_bytes)
        taken = take_layout(bands[i], d, prev_top, next_bottom)
        if taken is None:
            return None
        bands[i] = taken
    return bands


def _packed_pages(b: BandSnap) -> int:
    return max(b.live + b.fixed, b.fixed_far)


def _flushed_end(b: BandSnap) -> BandSnap:
    """An end after relief's recovery and flush: pending settled, live pages packed toward
    its base around fixed pages, which never move."""
    packed = _packed_pages(b)
    holes = packed - b.live - b.fixed
    if b.placement is Placement.UP_END:
        return b._replace(hi=b.lo + packed, holes=holes, pending=0, fixed_far=packed if b.fixed else 0)
    return b._replace(lo=b.hi - packed, holes=holes, pending=0, fixed_far=packed if b.fixed else 0)


def _recovered_float(b: BandSnap) -> BandSnap:
    """A float after relief's recovery: pending settled into holes; parked when left empty."""
    if b.parked:
        return b
    if b.live + b.fixed == 0:
        return b._replace(lo=-1, hi=-1, parked=True, holes=0, pending=0)
    return b._replace(holes=b.holes + b.pending, pending=0)


def _recovered(bands: Sequence[BandSnap]) -> list[BandSnap]:
    return [_recovered_float(b) if b.placement is Placement.FLOAT else _flushed_end(b) for b in bands]


def _relayout(snapshot: ChainSnapshot, demand: Sequence[int]) -> LayoutPlan | None:
    """Ends compacted; every unpinned float relocated into the lowest block that fits it, its take's
    pages included as trailing holes; pinned floats stay and grow one side, each side tried."""
    bands = _recovered(snapshot.bands)
    pinned = [i for i, b in enumerate(bands) if b.placement is Placement.FLOAT and b.pinned and not b.parked]
    for sides in itertools.product((Side.DOWN, Side.UP), repeat=len(pinned)):
        result = _relayout_with(bands, demand, dict(zip(pinned, sides)), snapshot)
        if result is not None:
            return result
    return None


def _relayout_with(
    recovered: list[BandSnap], demand: Sequence[int], sides: dict[int, Side], snapshot: ChainSnapshot
) -> LayoutPlan | None:
    bands = list(recovered)
    n = len(bands)
    relocations: list[Relocation] = []
    extensions: list[Extension] = []
    cursor = snapshot.chain_lo
    start = 0
    if n > 1 and bands[0].placement is Placement.UP_END:
        up = take_layout(bands[0], demand[0], snapshot.chain_lo, snapshot.arena_bytes)
        if up is None:
            return None
        bands[0] = up
        cursor = up.top
        start = 1
    for i in range(start, n - 1):
        b = bands[i]
        d = demand[i]
        if i in sides:
            grow = max(0, d - b.free)
            if sides[i] is Side.DOWN:
                lo = b.lo - grow
                if lo < b.first_id or b.origin + lo * b.page_bytes < cursor:
                    return None
                b = b._replace(lo=lo, holes=b.holes + grow)
            else:
                if b.bottom < cursor or b.hi + grow > b.n_grid:
                    return None
                b = b._replace(hi=b.hi + grow, holes=b.holes + grow)
            if grow:
                extensions.append(Extension(i, sides[i], grow))
            b = take_layout(b, d, 0, 0)  # served from holes: no growth left
            assert b is not None
            bands[i] = b
            cursor = b.top
            continue
        size = b.live + d
        if size == 0:
            bands[i] = b._replace(lo=-1, hi=-1, parked=True, holes=0, pending=0)
            continue
        lo = max(b.first_id, _ceil_div(cursor - b.origin, b.page_bytes))
        if lo + size > b.n_grid:
            return None
        if b.parked or lo != b.lo or b.hi != b.lo + size or b.holes:
            relocations.append(Relocation(i, lo, size))
        bands[i] = b._replace(lo=lo, hi=lo + size, parked=False, live=size, holes=0, pending=0)
        cursor = bands[i].top
    down = bands[n - 1]
    grow = max(0, demand[n - 1] - down.free)
    lo = down.lo - grow
    if lo < down.first_id or down.origin + lo * down.page_bytes < cursor:
        return None
    bands[n - 1] = take_layout(down, demand[n - 1], cursor, snapshot.arena_bytes) or down
    ends = tuple(i for i in (0, n - 1) if snapshot.bands[i].placement is not Placement.FLOAT)
    ordered = move_order(snapshot.bands, relocations)
    return LayoutPlan(Step.RELAYOUT, tuple(demand), tuple(sorted(set(ends))), tuple(ordered),
                      tuple(extensions), tuple(bands))


def move_order(current: Sequence[BandSnap], relocations: Sequence[Relocation]) -> list[Relocation]:
    """Order relocations so that no float is copied into a block another float still holds.

    Chain order is kept in bytes, so the dependency graph has no cycle."""
    pending = list(relocations)
    ordered: list[Relocation] = []
    while pending:
        for k, r in enumerate(pending):
            b = current[r.band]
            pb = b.page_bytes
            lo_bytes = b.origin + r.lo * pb
            hi_bytes = b.origin + (r.lo + r.size) * pb
            blocked = False
            for other in pending:
                if other is r:
                    continue
                o = current[other.band]
                if o.parked or o.span == 0:
                    continue
                if o.bottom < hi_bytes and lo_bytes < o.top:
                    blocked = True
                    break
            if not blocked:
                ordered.append(r)
                del pending[k]
                break
        else:
            raise InvariantError("pricing.move_order", f"float relocations form a cycle: {pending}")
    return ordered


def plan(snapshot: ChainSnapshot, demand: Sequence[int], step: Step) -> LayoutPlan | None:
    """The layout after serving `demand` under `step`, or None when that step cannot serve it."""
    if len(demand) != len(snapshot.bands):
        raise InputError(f"demand has {len(demand)} entries for {len(snapshot.bands)} bands")
    if step is Step.RELAYOUT:
        return _relayout(snapshot, demand)
    if step is Step.NO_MOVE:
        bands = list(snapshot.bands)
        compact: tuple[int, ...] = ()
    else:
        bands = _recovered(snapshot.bands)
        compact = tuple(i for i, b in enumerate(snapshot.bands) if b.placement is not Placement.FLOAT)
    after = _simulate_takes(bands, demand, snapshot.chain_lo, snapshot.arena_bytes)
    if after is None:
        return None
    return LayoutPlan(step, tuple(demand), compact, (), (), tuple(after))


def first_plan(snapshot: ChainSnapshot, demand: Sequence[int], steps: Sequence[Step] = tuple(Step)) -> LayoutPlan | None:
    """The least rearrangement that serves `demand` (CAP-10)."""
    for step in steps:
        result = plan(snapshot, demand, step)
        if result is not None:
            return result
    return None


def fits_bytes(snapshot: ChainSnapshot, demand: Sequence[int]) -> bool:
    """Whether the chain's bytes could hold the demand at all: in every layout pricing reaches,
    each band's span holds its live and fixed pages and the pages it takes, and the spans are
    disjoint inside `[chain_lo, arena_bytes)`. So a no here is every layout's no, found without
    pricing one (a full pool refuses most takes this way)."""
    need = 0
    for b, d in zip(snapshot.bands, demand):
        need += (b.live + b.fixed + (d if d > 0 else 0)) * b.page_bytes
    return need <= snapshot.arena_bytes - snapshot.chain_lo


def feasible(snapshot: ChainSnapshot, demand: Sequence[int], in_place_short: bool = False) -> bool:
    """Is there any reachable layout that serves `demand`? The one capacity question (CAP-9).

    Relayout compacts every end and packs every movable float at its lowest position, which serves
    whatever any in-place layout serves, so it alone decides. `in_place_short`: the caller has
    just found that the in-place plan on this very snapshot does not serve it (a refused take's
    first answer), so that plan is not priced twice."""
    if all(d <= 0 for d in demand):
        return True
    if not fits_bytes(snapshot, demand):
        return False
    if not in_place_short and plan(snapshot, demand, Step.NO_MOVE) is not None:
        return True
    return _relayout(snapshot, demand) is not None


def reclaimed_snapshot(snapshot: ChainSnapshot, freed: Sequence[int]) -> ChainSnapshot:
    """The snapshot after the prefix cache frees `freed[i]` live pages of band i (ADM-6).

    A freed page pends when a forward is in flight, else it becomes a hole; a float left with no
    page at all is parked, as a real free would leave it."""
    bands = list(snapshot.bands)
    for i, k in enumerate(freed):
        if k <= 0:
            continue
        b = bands[i]
        k = min(k, b.live)
        if snapshot.frees_pend:
            b = b._replace(live=b.live - k, pending=b.pending + k)
        else:
            b = b._replace(live=b.live - k, holes=b.holes + k)
        if b.placement is Placement.FLOAT and b.live + b.fixed + b.pending == 0:
            b = b._replace(lo=-1, hi=-1, parked=True, holes=0)
        bands[i] = b
    return ChainSnapshot(tuple(bands), snapshot.chain_lo, snapshot.arena_bytes, -1, snapshot.frees_pend)
