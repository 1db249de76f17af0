"""Pricing is exact: `feasible` says yes exactly when some reachable layout serves the demand,
checked against a brute-force search over every layout of tiny arenas (CAP-9, CAP-10, CAP-8)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvchain.alloc.pricing import BandSnap, ChainSnapshot, Step, feasible, first_plan, fits_bytes, plan
from kvchain.plan import Placement


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def snapshots(draw):
    """A chain of an up end, 0-2 floats and a down end on a tiny arena, with random spans, live,
    pending and fixed pages, and a demand."""
    n_floats = draw(st.integers(0, 2))
    pbs = [draw(st.sampled_from([16, 32, 48, 64])) for _ in range(n_floats + 2)]
    arena = draw(st.integers(8, 40)) * 16
    chain_lo = draw(st.sampled_from([0, 16, 48]))
    bands = []
    cursor = chain_lo
    for i, pb in enumerate(pbs):
        placement = Placement.UP_END if i == 0 else Placement.DOWN_END if i == len(pbs) - 1 else Placement.FLOAT
        origin = arena % pb if placement is Placement.DOWN_END else 0
        n_grid = (arena - origin) // pb
        first = max(0, _ceil(chain_lo - origin, pb))
        if placement is Placement.UP_END:
            lo = first
            max_span = max(0, (arena - origin) // pb - lo)
        elif placement is Placement.FLOAT:
            if draw(st.booleans()):
                bands.append(BandSnap(i, placement, pb, origin, first, n_grid, -1, -1, True, 0, 0, 0, 0, 0, False))
                continue
            lo_min = max(first, _ceil(cursor - origin, pb))
            if lo_min >= n_grid:
                bands.append(BandSnap(i, placement, pb, origin, first, n_grid, -1, -1, True, 0, 0, 0, 0, 0, False))
                continue
            lo = draw(st.integers(lo_min, min(n_grid - 1, lo_min + 4)))
            max_span = n_grid - lo
        else:
            lo_min = max(first, _ceil(cursor - origin, pb))
            if lo_min > n_grid:
                return None
            lo = draw(st.integers(lo_min, n_grid))
            max_span = n_grid - lo
        span = draw(st.integers(0, min(max_span, 8))) if placement is not Placement.DOWN_END else n_grid - lo
        if placement is Placement.FLOAT and span == 0:
            span = 1
        hi = lo + span
        fixed = draw(st.integers(0, min(span, 2))) if draw(st.integers(0, 3)) == 0 else 0
        live = draw(st.integers(0, span - fixed))
        if placement is Placement.FLOAT and live + fixed == 0:
            live = 1
            if live + fixed > span:
                return None
        pending = draw(st.integers(0, span - fixed - live))
        holes = span - fixed - live - pending
        fixed_far = draw(st.integers(fixed, span)) if fixed and placement is not Placement.FLOAT else 0
        if fixed and placement is not Placement.FLOAT and fixed_far == 0:
            fixed_far = fixed
        bands.append(BandSnap(i, placement, pb, origin, first, n_grid, lo, hi, False, live, holes, pending,
                              fixed, fixed_far, fixed > 0))
        cursor = origin + hi * pb
    if len(bands) != len(pbs):
        return None
    demand = tuple(draw(st.integers(0, 6)) for _ in bands)
    return ChainSnapshot(tuple(bands), chain_lo, arena), demand


def brute_force(snapshot: ChainSnapshot, demand) -> bool:
    """Does any layout the allocator can reach serve the demand? Ends packed toward their end
    around fixed pages; each movable float anywhere (in chain order) as one block of its live pages
    plus its demand; a pinned float in place, extended on one side by what its free pages lack."""
    bands = snapshot.bands
    up, down, floats = bands[0], bands[-1], bands[1:-1]

    def end_need(b: BandSnap, d: int) -> int:
        return max(b.live + b.fixed + d, b.fixed_far)

    up_top = up.origin + (up.lo + end_need(up, demand[0])) * up.page_bytes
    if up.lo + end_need(up, demand[0]) > up.n_grid:
        return False
    d_need = end_need(down, demand[-1])
    down_lo = down.hi - d_need
    if down_lo < down.first_id:
        return False
    down_bottom = down.origin + down_lo * down.page_bytes

    options = []
    for f, d in zip(floats, demand[1:-1]):
        opts = []
        if f.pinned and not f.parked:
            grow = max(0, d - f.free)
            for side in (0, 1):
                lo, hi = (f.lo - grow, f.hi) if side == 0 else (f.lo, f.hi + grow)
                if lo >= f.first_id and hi <= f.n_grid:
                    opts.append((f.origin + lo * f.page_bytes, f.origin + hi * f.page_bytes))
        else:
            size = f.live + d
            if size == 0:
                opts.append(None)
            else:
                for lo in range(f.first_id, f.n_grid - size + 1):
                    opts.append((f.origin + lo * f.page_bytes, f.origin + (lo + size) * f.page_bytes))
        options.append(opts)
    for choice in itertools.product(*options):
        cursor = max(up_top, snapshot.chain_lo)
        ok = True
        for block in choice:
            if block is None:
                continue
            if block[0] < cursor:
                ok = False
                break
            cursor = block[1]
        if ok and cursor <= down_bottom:
            return True
    return False


@settings(max_examples=3000, deadline=None)
@given(snapshots())
def test_feasible_matches_brute_force(case):
    """CAP-9: `feasible` is exactly the existence of a reachable layout."""
    if case is None:
        return
    snapshot, demand = case
    assert feasible(snapshot, demand) == brute_force(snapshot, demand)


@settings(max_examples=3000, deadline=None)
@given(snapshots())
def test_a_demand_past_the_chain_s_bytes_has_no_layout_at_any_step(case):
    """CAP-9: `fits_bytes`, which lets `feasible` refuse without pricing, never says no where some
    step (or the brute force over every layout) serves the demand."""
    if case is None:
        return
    snapshot, demand = case
    if not fits_bytes(snapshot, demand):
        assert all(plan(snapshot, demand, step) is None for step in Step)
        assert not brute_force(snapshot, demand) or all(d <= 0 for d in demand)


@settings(max_examples=2000, deadline=None)
@given(snapshots())
def test_feasible_told_the_in_place_plan_is_short_gives_the_same_answer(case):
    """CAP-9: a refused take prices its in-place plan once; told that plan does not serve the
    demand, `feasible` answers as it would have alone."""
    if case is None:
        return
    snapshot, demand = case
    if plan(snapshot, demand, Step.NO_MOVE) is None:
        assert feasible(snapshot, demand, in_place_short=True) == feasible(snapshot, demand)


@settings(max_examples=2000, deadline=None)
@given(snapshots())
def test_steps_are_ordered_and_first_plan_is_least(case):
    """CAP-8, CAP-10: a step that serves a demand implies every later step serves it, and
    `first_plan` returns the least such step."""
    if case is None:
        return
    snapshot, demand = case
    served = [plan(snapshot, demand, step) is not None for step in Step]
    if served[Step.NO_MOVE] or served[Step.FLUSH_ENDS]:
        assert served[Step.RELAYOUT]
    chosen = first_plan(snapshot, demand)
    if chosen is None:
        assert not any(served)
    else:
        assert chosen.step == min(s for s in Step if served[s])
