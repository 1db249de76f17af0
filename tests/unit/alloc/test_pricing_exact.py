"""Pricing to the page: each step's layout, worked out by hand on small chains.

test_pricing.py checks the yes/no answers against a brute-force search; these check the layouts
themselves (where each band's span lies after its take, which floats move where and in what order,
which ends are compacted), since the take follows the plan it is given (CAP-8..CAP-11)."""

from __future__ import annotations

import dataclasses

import pytest

from kvchain.alloc.pricing import (
    BandSnap,
    CapacityEpoch,
    ChainSnapshot,
    Extension,
    LayoutPlan,
    Relocation,
    Side,
    Step,
    feasible,
    first_plan,
    fits_bytes,
    growth_rooms,
    move_order,
    neighbour_bounds,
    plan,
    reclaimed_snapshot,
    take_layout,
)
from kvchain.errors import InputError, InvariantError
from kvchain.plan import Placement

UP, FLOAT, DOWN = Placement.UP_END, Placement.FLOAT, Placement.DOWN_END


def band(index=0, placement=FLOAT, page_bytes=16, origin=0, first_id=0, n_grid=64, lo=-1, hi=-1, parked=False,
         live=0, holes=0, pending=0, fixed=0, fixed_far=0, pinned=False) -> BandSnap:
    return BandSnap(index, placement, page_bytes, origin, first_id, n_grid, lo, hi, parked, live, holes, pending,
                    fixed, fixed_far, pinned)


def parked(index, page_bytes=16, origin=0, n_grid=64) -> BandSnap:
    return band(index, FLOAT, page_bytes, origin, 0, n_grid, -1, -1, True)


def test_capacity_epoch_counts_bumps():
    """CAP-6: the epoch starts at 0 and moves by one per change."""
    e = CapacityEpoch()
    assert e.value == 0
    e.bump()
    e.bump()
    assert e.value == 2


def test_band_snapshot_geometry():
    """LIFE-26: holes and pending pages are the free pages; spans are grid ids on the band's grid."""
    b = band(page_bytes=16, origin=8, lo=2, hi=5, live=0, holes=1, pending=2)
    assert (b.free, b.bottom, b.top, b.span) == (3, 40, 88, 3)
    assert parked(1).span == 0


def test_neighbour_bounds_see_through_parked_floats():
    """A band's room ends at the nearest placed band on each side; parked floats hold no bytes."""
    bands = [band(0, UP, lo=0, hi=4), parked(1), band(2, lo=10, hi=12), parked(3), band(4, DOWN, lo=50, hi=64)]
    got = [neighbour_bounds(bands, i, 16, 1024) for i in range(5)]
    assert got == [(16, 160), (64, 160), (64, 800), (192, 800), (192, 1024)]


def test_growth_rooms_between_neighbours_on_the_bands_grid():
    """Pages from the band's span to the first whole page past each neighbour, within its grid."""
    b = band(page_bytes=32, origin=8, first_id=1, n_grid=30, lo=5, hi=8)
    assert growth_rooms(b, 100, 500) == (2, 7)  # floor ceil(92/32) = 3, ceiling 492 // 32 = 15
    assert growth_rooms(b, 0, 10_000) == (4, 22)  # the grid's first id and its end bound instead


def test_a_take_reuses_holes_then_pending_pages():
    """LIFE-26: a take is served from holes first, then pending pages, without growing."""
    b = band(0, UP, lo=0, hi=10, live=5, holes=2, pending=3)
    assert take_layout(b, 0, 0, 1024) is b and take_layout(b, -2, 0, 1024) is b
    assert take_layout(b, 1, 0, 1024) == b._replace(live=6, holes=1)
    assert take_layout(b, 4, 0, 1024) == b._replace(live=9, holes=0, pending=1)
    assert take_layout(b, 5, 0, 1024) == b._replace(live=10, holes=0, pending=0)


def test_ends_grow_toward_the_middle_up_to_their_neighbour():
    """An up end grows its top, a down end its bottom, by what its free pages lack."""
    up = band(0, UP, lo=0, hi=4, live=2, holes=1, pending=1)
    assert take_layout(up, 5, 0, 160) == up._replace(hi=7, live=7, holes=0, pending=0)
    assert take_layout(up, 8, 0, 160) == up._replace(hi=10, live=10, holes=0, pending=0)
    assert take_layout(up, 9, 0, 160) is None
    down = band(2, DOWN, page_bytes=64, n_grid=16, lo=10, hi=16, live=5, holes=1)
    assert take_layout(down, 3, 500, 1024) == down._replace(lo=8, live=8, holes=0)
    assert take_layout(down, 4, 500, 1024) is None


def test_a_placed_float_grows_toward_its_larger_gap():
    """The float extends on the side with more room, up when the rooms are equal."""
    f = band(1, page_bytes=32, n_grid=32, lo=10, hi=12, live=2)
    assert take_layout(f, 3, 224, 512) == f._replace(hi=15, live=5)  # down 3 < up 4
    assert take_layout(f, 4, 224, 512) == f._replace(hi=16, live=6)
    assert take_layout(f, 5, 224, 512) is None
    assert take_layout(f, 4, 192, 512) == f._replace(hi=16, live=6)  # down 4 == up 4
    assert take_layout(f, 5, 160, 512) == f._replace(lo=5, live=7)  # down 5 > up 4
    assert take_layout(f, 6, 160, 512) is None


def test_a_parked_float_takes_the_middle_of_its_region():
    """The region runs from the first whole page above the band below to the band above; the new
    span is centred in it, its spare page (odd room) above."""
    p = parked(1, page_bytes=32, n_grid=32)
    placed = dict(parked=False, holes=0, pending=0)
    assert take_layout(p, 5, 100, 700) == p._replace(lo=10, hi=15, live=5, **placed)  # region 4..21
    assert take_layout(p, 4, 100, 700) == p._replace(lo=10, hi=14, live=4, **placed)
    assert take_layout(p, 17, 100, 700) == p._replace(lo=4, hi=21, live=17, **placed)
    assert take_layout(p, 18, 100, 700) is None
    late = p._replace(first_id=6)
    assert take_layout(late, 5, 100, 700) == late._replace(lo=11, hi=16, live=5, **placed)  # region 6..21
    assert take_layout(p, 3, 100, 2000) == p._replace(lo=16, hi=19, live=3, **placed)  # region 4..32


def _chain() -> ChainSnapshot:
    """An up end (16-byte pages) with 2 holes and 2 pending pages, a float (32-byte pages) with a
    hole, a float in place with no free page (16-byte pages), a down end (64-byte pages)."""
    return ChainSnapshot(
        (
            band(0, UP, lo=0, hi=8, live=4, holes=2, pending=2),
            band(1, page_bytes=32, n_grid=32, lo=4, hi=8, live=3, holes=1),
            band(2, lo=16, hi=20, live=4),
            band(3, DOWN, page_bytes=64, n_grid=16, lo=12, hi=16, live=4),
        ),
        0, 1024,
    )


def test_no_move_takes_in_place():
    """CAP-8: NO_MOVE: the up end takes from its holes and pending pages, the float from its hole,
    the down end grows down (the float in place above it leaves 7 pages of room)."""
    snap = _chain()
    got = plan(snap, (4, 1, 0, 1), Step.NO_MOVE)
    b = snap.bands
    assert got == LayoutPlan(Step.NO_MOVE, (4, 1, 0, 1), (), (), (), (
        b[0]._replace(live=8, holes=0, pending=0),
        b[1]._replace(live=4, holes=0),
        b[2],
        b[3]._replace(lo=11, live=5),
    ))
    assert plan(snap, (5, 0, 0, 0), Step.NO_MOVE) is None  # the up end cannot grow into the float
    assert plan(snap, (0, 2, 0, 0), Step.NO_MOVE) is None  # the float is boxed in


def test_flush_ends_packs_the_ends_then_takes():
    """CAP-8: FLUSH_ENDS settles pending pages and packs each end's live pages toward its base:
    the up end shrinks to its 4 live pages (top at byte 64), so the float can grow down into the
    first two 32-byte pages freed (ids 2..4), toward its larger gap."""
    snap = _chain()
    got = plan(snap, (0, 2, 0, 0), Step.FLUSH_ENDS)
    b = snap.bands
    assert got == LayoutPlan(Step.FLUSH_ENDS, (0, 2, 0, 0), (0, 3), (), (), (
        b[0]._replace(hi=4, holes=0, pending=0),
        b[1]._replace(lo=3, live=5, holes=0),
        b[2],
        b[3],
    ))
    assert first_plan(snap, (0, 2, 0, 0)) == got
    assert plan(snap, (5, 0, 0, 0), Step.FLUSH_ENDS) is None  # 4 packed + 5 > the 8 below the float


def test_flushed_ends_keep_their_fixed_pages():
    """An end's fixed pages never move: it packs to max(live + fixed, farthest fixed page); what the
    fixed pages leave between them stays holes."""
    up = band(0, UP, lo=0, hi=10, live=3, holes=4, pending=2, fixed=1, fixed_far=6)
    down = band(1, DOWN, lo=6, hi=16, n_grid=16, live=3, holes=4, pending=2, fixed=1, fixed_far=6)
    snap = ChainSnapshot((up, down), 0, 256)
    got = plan(snap, (0, 0), Step.FLUSH_ENDS)
    assert got.after == (up._replace(hi=6, holes=2, pending=0, fixed_far=6),
                         down._replace(lo=10, holes=2, pending=0, fixed_far=6))
    loose = ChainSnapshot((up._replace(fixed=0, fixed_far=0, holes=5), down._replace(fixed=0, fixed_far=0, holes=5)),
                          0, 256)
    assert plan(loose, (0, 0), Step.FLUSH_ENDS).after == (
        loose.bands[0]._replace(hi=3, holes=0, pending=0), loose.bands[1]._replace(lo=13, holes=0, pending=0))


def test_relayout_packs_the_floats_above_the_compacted_up_end():
    """CAP-8: RELAYOUT: the up end packs to 4 pages and takes 2 (top at byte 96); the float moves to
    the first 32-byte page at or above it (id 3) with its 3 live pages and a take of 2; the next
    float is already where it belongs (id 16 = byte 256, no holes), so it does not move; the down
    end takes one page below its base."""
    snap = _chain()
    got = plan(snap, (2, 2, 0, 1), Step.RELAYOUT)
    b = snap.bands
    assert got == LayoutPlan(Step.RELAYOUT, (2, 2, 0, 1), (0, 3), (Relocation(1, 3, 5),), (), (
        b[0]._replace(hi=6, live=6, holes=0, pending=0),
        b[1]._replace(lo=3, hi=8, live=5, holes=0),
        b[2],
        b[3]._replace(lo=11, live=5),
    ))
    assert first_plan(snap, (2, 2, 0, 1)).step is Step.FLUSH_ENDS  # a flush already serves it
    assert first_plan(snap, (2, 2, 0, 1), steps=(Step.RELAYOUT,)) == got


def test_relayout_moves_a_float_with_holes_even_in_place_and_parks_an_empty_one():
    """A float already at its packed position but holding a hole is rewritten without it; a float
    left with nothing (live 0, no take) is parked; a parked float that takes is placed."""
    snap = ChainSnapshot(
        (
            band(0, UP, lo=0, hi=4, live=4),
            band(1, lo=4, hi=7, live=2, holes=1),
            band(2, lo=8, hi=9, live=0, pending=1),
            parked(3),
            band(4, DOWN, lo=60, hi=64, live=4),
        ),
        0, 1024,
    )
    got = plan(snap, (0, 0, 0, 3, 0), Step.RELAYOUT)
    assert got.relocations == (Relocation(1, 4, 2), Relocation(3, 6, 3))
    assert got.after[1] == snap.bands[1]._replace(hi=6, holes=0)
    assert got.after[2] == snap.bands[2]._replace(lo=-1, hi=-1, parked=True, pending=0)
    assert got.after[3] == snap.bands[3]._replace(lo=6, hi=9, parked=False, live=3)


def test_relayout_grows_a_pinned_float_on_one_side_down_first():
    """A pinned float (it holds fixed pages) stays and extends by what its free pages lack: down
    when the band below leaves room, else up; the extension is part of the plan."""
    pinned = band(1, lo=10, hi=12, live=1, fixed=1, pinned=True)
    down_end = band(2, DOWN, lo=60, hi=64, live=4)
    low = ChainSnapshot((band(0, UP, lo=0, hi=4, live=4), pinned, down_end), 0, 1024)
    got = plan(low, (0, 3, 0), Step.RELAYOUT)
    assert got.extensions == (Extension(1, Side.DOWN, 3),)
    assert got.after[1] == pinned._replace(lo=7, live=4)
    high = ChainSnapshot((band(0, UP, lo=0, hi=9, live=9), pinned, down_end), 0, 1024)
    got = plan(high, (0, 3, 0), Step.RELAYOUT)
    assert got.extensions == (Extension(1, Side.UP, 3),)
    assert got.after[1] == pinned._replace(hi=15, live=4)
    assert got.relocations == ()
    assert plan(high, (0, 3, 45), Step.RELAYOUT).after[2] == down_end._replace(lo=15, live=49)
    assert plan(high, (0, 3, 46), Step.RELAYOUT) is None  # the down end would pass the float's top (byte 240)


def test_a_pinned_float_with_enough_free_pages_does_not_extend():
    pinned = band(1, lo=10, hi=14, live=1, fixed=1, holes=2, pinned=True)
    snap = ChainSnapshot((band(0, UP, lo=0, hi=4, live=4), pinned, band(2, DOWN, lo=60, hi=64, live=4)), 0, 1024)
    got = plan(snap, (0, 2, 0), Step.RELAYOUT)
    assert got.extensions == () and got.after[1] == pinned._replace(live=3, holes=0)


def test_relayout_refuses_what_no_layout_serves():
    """CAP-9: the float's 3 + 30 pages do not fit its 32-page grid; packed, the floats end at byte
    224, so the down end (64-byte pages from id 12) reaches id 4 (byte 256) with 8 more pages, not
    id 3 (byte 192) with 9; the up end cannot pass its grid's 64 pages."""
    snap = _chain()
    assert plan(snap, (0, 30, 0, 0), Step.RELAYOUT) is None
    assert plan(snap, (0, 0, 0, 8), Step.RELAYOUT).after[3] == snap.bands[3]._replace(lo=4, live=12)
    assert plan(snap, (0, 0, 0, 9), Step.RELAYOUT) is None
    assert plan(snap, (60, 0, 0, 0), Step.RELAYOUT) is None  # 4 packed + 60 = 64: the float has no room
    assert plan(snap, (61, 0, 0, 0), Step.RELAYOUT) is None
    assert not feasible(snap, (0, 30, 0, 0)) and not feasible(snap, (0, 0, 0, 9))
    assert feasible(snap, (0, 0, 0, 0)) and feasible(snap, (-3, 0, 0, 0))


def test_feasible_asks_relayout_when_in_place_fails():
    """CAP-9, CAP-10: in place, the down end has 7 pages of room below the float at byte 320; only
    a relayout (floats packed down to byte 224) serves 8."""
    snap = _chain()
    assert plan(snap, (0, 0, 0, 8), Step.NO_MOVE) is None
    assert plan(snap, (0, 0, 0, 8), Step.FLUSH_ENDS) is None
    assert feasible(snap, (0, 0, 0, 8))
    assert first_plan(snap, (0, 0, 0, 8)).step is Step.RELAYOUT
    assert first_plan(snap, (0, 30, 0, 0)) is None


def test_fits_bytes_counts_every_bands_live_fixed_and_taken_pages_in_its_own_page_bytes():
    """CAP-9: the chain [64, 512) has 448 bytes. Held: 4 x 16 (3 live, 1 fixed) + 2 x 32 + 3 x 64
    (1 live, 2 fixed) = 320 bytes; a take of (2, 1, 1) adds 32 + 32 + 64 = 128: exactly 448 fits.
    One page more on any band does not; a band giving pages back (a negative entry) frees nothing
    for the others."""
    snap = ChainSnapshot((band(0, UP, origin=64, lo=0, hi=4, live=3, fixed=1),  # bytes 64..128
                          band(1, page_bytes=32, origin=64, lo=6, hi=8, live=2),  # 256..320
                          band(2, DOWN, page_bytes=64, n_grid=8, lo=5, hi=8, live=1, fixed=2)), 64, 512)
    assert fits_bytes(snap, (2, 1, 1))
    assert not fits_bytes(snap, (3, 1, 1))  # 464
    assert not fits_bytes(snap, (2, 2, 1))  # 480
    assert not fits_bytes(snap, (2, 1, 2))  # 512
    assert fits_bytes(snap, (3, -2, 1)) and not fits_bytes(snap, (3, -2, 2))  # 432, 496
    assert fits_bytes(snap, (0, 0, 0)) and fits_bytes(snap, (-4, -2, -3))  # 320


def test_feasible_refuses_what_the_bytes_hold_but_no_layout_serves():
    """CAP-9: an up end's fixed page at id 9 stays where it is, so its flushed span keeps 10 pages
    (160 bytes) although it holds 2; the down end (base id 12) grows down to id 10 and no further.
    A take of 3 fits the chain's bytes (2 + 7 of 16 pages) but no layout, in place or relaid."""
    up = band(0, UP, n_grid=16, lo=0, hi=10, live=1, holes=8, fixed=1, fixed_far=10)
    down = band(1, DOWN, n_grid=16, lo=12, hi=16, live=4)
    snap = ChainSnapshot((up, down), 0, 256)
    assert fits_bytes(snap, (0, 3))
    assert plan(snap, (0, 3), Step.NO_MOVE) is None and plan(snap, (0, 3), Step.RELAYOUT) is None
    assert not feasible(snap, (0, 3)) and not feasible(snap, (0, 3), in_place_short=True)
    assert feasible(snap, (0, 2))  # in place: down to id 10, the up end's top
    assert plan(snap, (0, 2), Step.NO_MOVE).after[1] == down._replace(lo=10, live=6)


def test_plan_refuses_a_demand_of_the_wrong_length():
    with pytest.raises(InputError, match=r"^demand has 3 entries for 4 bands$"):
        plan(_chain(), (0, 0, 0), Step.NO_MOVE)


def test_move_order_copies_a_float_only_into_a_free_block():
    """A float moving into bytes another float still holds waits for that one to move first;
    blocks that only touch do not wait."""
    f1 = band(1, lo=0, hi=4, live=4)  # bytes 0..64
    f2 = band(2, lo=4, hi=8, live=4)  # bytes 64..128
    current = [band(0, UP, lo=0, hi=0), f1, f2]
    into_f2, away = Relocation(1, 4, 4), Relocation(2, 10, 4)
    assert move_order(current, [into_f2, away]) == [away, into_f2]
    assert move_order(current, [away, into_f2]) == [away, into_f2]
    touch_below, touch_above = Relocation(1, 0, 4), Relocation(2, 4, 4)  # [0, 64) and [64, 128)
    assert move_order(current, [touch_below, touch_above]) == [touch_below, touch_above]
    f3 = band(2, lo=2, hi=8, live=4)  # bytes 32..128
    lower, upper = Relocation(1, 8, 4), Relocation(2, 12, 2)  # into [128, 192): touches f3's top
    assert move_order([current[0], f1, f3], [lower, upper]) == [lower, upper]
    with pytest.raises(InvariantError, match="float relocations form a cycle"):
        move_order(current, [Relocation(1, 4, 4), Relocation(2, 0, 4)])


def test_move_order_ignores_floats_that_hold_no_block():
    """A parked float (or one of zero span) holds no bytes: nothing waits for it."""
    ghost = band(2, origin=64, lo=-1, hi=-1, parked=True)  # its grid ids would put it at byte 48
    empty = band(2, lo=2, hi=2)
    mover = band(1, lo=8, hi=10, live=2)
    into, ghost_move = Relocation(1, 2, 2), Relocation(2, 0, 1)  # mover into bytes [32, 64)
    current = [band(0, UP, lo=0, hi=0), mover, ghost]
    assert move_order(current, [into, ghost_move]) == [into, ghost_move]
    assert move_order([current[0], mover, empty], [Relocation(1, 1, 2), Relocation(2, 6, 1)]) == [
        Relocation(1, 1, 2), Relocation(2, 6, 1)]


def test_reclaimed_snapshot_credits_what_the_cache_could_free():
    """ADM-6: a freed page becomes a hole, or a pending page while a forward is in flight; a band
    cannot free more than it holds live; a float left with nothing is parked."""
    snap = ChainSnapshot(
        (
            band(0, UP, lo=0, hi=8, live=6, holes=2),
            band(1, lo=10, hi=13, live=3),
            band(2, lo=20, hi=24, live=2, pending=2),
            band(3, DOWN, lo=60, hi=64, live=4),
        ),
        16, 1024, epoch=7,
    )
    got = reclaimed_snapshot(snap, (2, 5, 2, 0))
    b = snap.bands
    assert got == ChainSnapshot(
        (b[0]._replace(live=4, holes=4), b[1]._replace(lo=-1, hi=-1, parked=True, live=0, holes=0),
         b[2]._replace(live=0, holes=2), b[3]),
        16, 1024, -1, False,
    )
    pend = reclaimed_snapshot(dataclasses.replace(snap, frees_pend=True), (2, 3, -1, 4))
    assert pend == ChainSnapshot(
        (b[0]._replace(live=4, pending=2), b[1]._replace(live=0, pending=3), b[2], b[3]._replace(live=0, pending=4)),
        16, 1024, -1, True,
    )


def test_a_float_is_parked_only_when_it_holds_nothing_at_all():
    """ADM-6: a float that keeps a live, fixed or pending page stays placed after the credit; one
    freed of nothing is left as it is, even when it holds nothing live; a single page is credited."""
    snap = ChainSnapshot(
        (
            band(0, UP, lo=0, hi=8, live=6, holes=2),
            band(1, lo=10, hi=14, live=3, pending=1),  # frees 2: 1 live + 1 pending left
            band(2, lo=20, hi=25, live=1, fixed=2, pending=2),  # frees 1: 2 fixed + 2 pending left
            band(3, lo=30, hi=32, live=0, holes=2),  # frees nothing
            band(4, DOWN, lo=60, hi=64, live=4),
        ),
        0, 1024,
    )
    got = reclaimed_snapshot(snap, (1, 2, 1, 0, 0))
    b = snap.bands
    assert got.bands == (b[0]._replace(live=5, holes=3), b[1]._replace(live=1, holes=2),
                         b[2]._replace(live=0, holes=1), b[3], b[4])


def test_relayout_of_a_lone_band_grows_it_down_to_the_chain_start():
    """CAP-8: a chain of one band (full attention alone) is its down end: a relayout packs it and
    grows it down to the first whole page at or above the chain's start (byte 16, id 1)."""
    lone = band(0, DOWN, lo=60, hi=64, live=4, holes=0, pending=3)
    snap = ChainSnapshot((lone,), 16, 1024)
    got = plan(snap, (59,), Step.RELAYOUT)
    assert got == LayoutPlan(Step.RELAYOUT, (59,), (0,), (), (), (lone._replace(lo=1, live=63, pending=0),))
    assert plan(snap, (60,), Step.RELAYOUT) is None


def test_relayout_of_two_ends_moves_nothing():
    """CAP-8: with no float between them, a relayout compacts both ends and each grows toward the
    other: the up end's top reaches byte 96, the down end's base byte 176."""
    up = band(0, UP, lo=0, hi=6, live=4, holes=2)
    down = band(1, DOWN, n_grid=16, lo=12, hi=16, live=4)
    snap = ChainSnapshot((up, down), 0, 256)
    got = plan(snap, (2, 1), Step.RELAYOUT)
    assert got == LayoutPlan(Step.RELAYOUT, (2, 1), (0, 1), (), (),
                             (up._replace(live=6, holes=0), down._replace(lo=11, live=5)))
    assert plan(snap, (2, 6), Step.RELAYOUT).after[1] == down._replace(lo=6, live=10)  # base at byte 96
    assert plan(snap, (2, 7), Step.RELAYOUT) is None  # byte 80: below the up end's top


def test_flush_settles_a_floats_pending_pages_and_parks_an_empty_one():
    """CAP-8: a flush settles each float's pending pages into holes; a float left with no live or
    fixed page is parked. Fixed pages near an end's base pack to live + fixed."""
    f1 = band(1, lo=6, hi=9, live=1, holes=1, pending=1)
    f2 = band(2, lo=12, hi=14, live=0, holes=1, pending=1)
    up = band(0, UP, lo=0, hi=6, live=5, fixed=1, fixed_far=2)
    down = band(3, DOWN, lo=58, hi=64, live=5, fixed=1, fixed_far=2)
    got = plan(ChainSnapshot((up, f1, f2, down), 0, 1024), (0, 0, 0, 0), Step.FLUSH_ENDS)
    assert got.after == (up._replace(fixed_far=6), f1._replace(holes=2, pending=0),
                         f2._replace(lo=-1, hi=-1, parked=True, holes=0, pending=0), down._replace(fixed_far=6))


def test_a_parked_float_region_counts_from_its_grid_origin():
    """A grid that starts at byte 8: the region runs from id ceil(92/32) = 3 to 692 // 32 = 21."""
    p = band(1, page_bytes=32, origin=8, n_grid=32, parked=True)
    assert take_layout(p, 5, 100, 700) == p._replace(lo=9, hi=14, parked=False, live=5)
    assert growth_rooms(band(page_bytes=32, origin=8, first_id=1, n_grid=30, lo=5, hi=8), 100, 504) == (2, 7)


def test_relayout_places_floats_on_their_own_grids():
    """A float packs at the first page of its own grid at or above the cursor (origin 8: id
    ceil(56/32) = 2); one that would pass its grid's end is refused, one that ends on it is not;
    a float in place with a hole is rewritten without it."""
    up = band(0, UP, lo=0, hi=4, live=4)
    down = band(2, DOWN, lo=60, hi=64, live=4)
    shifted = ChainSnapshot((up, band(1, page_bytes=32, origin=8, lo=5, hi=7, live=2), down), 0, 1024)
    assert plan(shifted, (0, 0, 0), Step.RELAYOUT).relocations == (Relocation(1, 2, 2),)
    short = ChainSnapshot((up, band(1, n_grid=20, lo=4, hi=6, live=2), down), 0, 1024)
    assert plan(short, (0, 14, 0), Step.RELAYOUT).relocations == (Relocation(1, 4, 16),)
    assert plan(short, (0, 15, 0), Step.RELAYOUT) is None
    holed = ChainSnapshot((up, band(1, lo=4, hi=7, live=2, holes=1), down), 0, 1024)
    assert plan(holed, (0, 1, 0), Step.RELAYOUT).relocations == (Relocation(1, 4, 3),)


def test_relayout_tries_each_side_for_each_pinned_float_and_moves_the_floats_after_them():
    """Two pinned floats: the first extends down (to id 7), which leaves the second no room below
    (its base would pass the first's top, byte 192), so it extends up; the float above them moves
    down to the second's new top (id 17)."""
    up = band(0, UP, lo=0, hi=4, live=4)
    p1 = band(1, lo=10, hi=12, live=1, fixed=1, pinned=True)
    p2 = band(2, lo=13, hi=15, live=1, fixed=1, pinned=True)
    f = band(3, lo=30, hi=32, live=2)
    snap = ChainSnapshot((up, p1, p2, f, band(4, DOWN, lo=60, hi=64, live=4)), 0, 1024)
    got = plan(snap, (0, 3, 2, 0, 0), Step.RELAYOUT)
    assert got.extensions == (Extension(1, Side.DOWN, 3), Extension(2, Side.UP, 2))
    assert got.relocations == (Relocation(3, 17, 2),)
    assert got.after[1:4] == (p1._replace(lo=7, live=4), p2._replace(hi=17, live=3), f._replace(lo=17, hi=19))


def test_a_pinned_floats_extension_may_reach_its_neighbour_or_its_grid_end_exactly():
    """Down to the up end's top (byte 64) at the grid's first id; up from a base at the up end's
    top to the grid's end; not past either."""
    down = band(2, DOWN, lo=60, hi=64, live=4)
    low = band(1, first_id=4, lo=10, hi=12, live=1, fixed=1, pinned=True)
    got = plan(ChainSnapshot((band(0, UP, lo=0, hi=4, live=4), low, down), 0, 1024), (0, 6, 0), Step.RELAYOUT)
    assert got.extensions == (Extension(1, Side.DOWN, 6),)
    high = band(1, n_grid=15, lo=10, hi=12, live=1, fixed=1, pinned=True)
    touching = band(0, UP, lo=0, hi=10, live=10)
    got = plan(ChainSnapshot((touching, high, down), 0, 1024), (0, 3, 0), Step.RELAYOUT)
    assert got.extensions == (Extension(1, Side.UP, 3),)
    assert plan(ChainSnapshot((touching, high._replace(n_grid=14), down), 0, 1024), (0, 3, 0), Step.RELAYOUT) is None
    assert plan(ChainSnapshot((touching, high, down), 0, 1024), (1, 3, 0), Step.RELAYOUT) is None  # top 176


def test_a_down_end_may_reach_the_cursor_or_its_first_id_exactly():
    """CAP-9: a down end whose base sits on the up end's top still serves a take from its free
    pages; one growing to its grid's first id is served; a full chain refuses even one page."""
    up = band(0, UP, lo=0, hi=4, live=4)
    snug = band(1, DOWN, n_grid=16, lo=4, hi=16, live=10, fixed=1, fixed_far=12)  # 1 hole after packing
    snap = ChainSnapshot((up, snug), 0, 256)
    assert plan(snap, (0, 1), Step.RELAYOUT).after[1] == snug._replace(live=11, holes=0)
    assert plan(snap, (0, 2), Step.RELAYOUT) is None
    lone = band(0, DOWN, first_id=1, lo=60, hi=64, live=4)
    assert plan(ChainSnapshot((lone,), 16, 1024), (59,), Step.RELAYOUT).after[0] == lone._replace(lo=1, live=63)
    full = ChainSnapshot((band(0, UP, lo=0, hi=8, live=8), band(1, DOWN, n_grid=16, lo=8, hi=16, live=8)), 0, 256)
    assert not feasible(full, (0, 1)) and not feasible(full, (1, 0))


def test_a_parked_float_does_not_hide_the_float_behind_it():
    """A parked float met while checking a move does not end the check: the float after it still
    blocks a copy into its bytes."""
    mover = band(1, lo=0, hi=2, live=2)  # bytes 0..32
    ghost = band(2, lo=-1, hi=-1, parked=True)
    holder = band(3, lo=4, hi=6, live=2)  # bytes 64..96
    current = [band(0, UP, lo=0, hi=0), mover, ghost, holder]
    into, ghost_move, away = Relocation(1, 4, 2), Relocation(2, 10, 1), Relocation(3, 8, 2)
    assert move_order(current, [into, ghost_move, away]) == [ghost_move, away, into]
    with pytest.raises(InvariantError) as err:
        move_order(current, [Relocation(1, 4, 2), Relocation(3, 0, 2)])
    assert err.value.check == "pricing.move_order"
