"""Compaction's move plans, read from a band alone: which pages move where, decided from logical
state only, with nothing copied and nothing changed (the chain performs a plan)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchain.alloc.band import Band, FloatBand
from kvchain.alloc.compaction import plan_flush, plan_relocation
from kvchain.alloc.forward_steps import LaunchRecord
from kvchain.alloc.pricing import CapacityEpoch, take_layout
from kvchain.device.base import Event
from kvchain.errors import CapacityError, InvariantError
from kvchain.memory.arena import arena_layout
from kvchain.plan import Placement, plan_kv_storage
from support.chains import hybrid_decls


def _alone(placement: Placement = Placement.DOWN_END):
    plan = plan_kv_storage(hybrid_decls(), page_size=2)
    layout = arena_layout(plan, 64 * 1024)
    pool = next(p for p in plan.sub_pools if p.placement is placement)
    grid = layout.grids[pool.index]
    cls = FloatBand if placement is Placement.FLOAT else Band
    return cls(pool, grid, CapacityEpoch(), grid.n_grid + 1), layout


def _filled(n: int, placement: Placement = Placement.DOWN_END):
    band, layout = _alone(placement)
    after = take_layout(band.snapshot(), n, layout.chain_lo, layout.arena_bytes)
    ids, _, _ = band.hand_out(n, after)
    band.bind(np.arange(1, n + 1), ids)
    return band, np.sort(ids)


def _state(band):
    return band.state.copy(), band.holes.view().copy(), band.ids.v2p.copy(), band.epoch.value


def test_a_flush_plan_moves_the_frontier_pages_into_the_base_holes_and_changes_nothing():
    """COMP-8, COMP-16: an uncapped plan pairs the live pages nearest the frontier with the holes
    nearest the base; planning leaves the band as it was."""
    band, ids = _filled(8)  # the owner grows down from the top: ids[-1] is its base
    base_holes = ids[-3:]
    band.free(base_holes, None)
    before = _state(band)
    moves = plan_flush(band, None, relief=True)
    assert moves is not None
    assert sorted(moves.dst.tolist()) == sorted(base_holes.tolist())
    assert sorted(moves.src.tolist()) == sorted(ids[:3].tolist())
    after = _state(band)
    assert all(np.array_equal(a, b) for a, b in zip(before[:3], after[:3])) and before[3] == after[3]


def test_the_opportunistic_plan_is_capped_and_moves_nothing_with_pending_pages():
    """COMP-7, COMP-12: at most `max_moves` pairs; a band with pending pages plans no move."""
    band, ids = _filled(8)
    band.free(ids[-4:], None)
    moves = plan_flush(band, 2)
    assert moves is not None and len(moves.src) == 2
    band.free(ids[:1], LaunchRecord(1, True, event=Event(label="f1"), recorded=True))
    assert plan_flush(band, 2) is None


def test_the_opportunistic_plan_stops_at_a_source_a_forward_writes():
    """COMP-9: the scan from the frontier stops at the first page an unfinished forward writes."""
    band, ids = _filled(8)
    band.free(ids[-2:], None)
    band.set_inflight_forward(4, Event(label="f4"), ids[:1])  # the frontier page is being written
    assert plan_flush(band, 8) is None
    moves = plan_flush(band, None, relief=True)  # relief waits the writer instead
    assert moves is not None and ids[0] in moves.src


def test_a_relocation_plan_copies_only_the_pages_the_new_span_leaves_behind():
    """COMP-23: a float's live pages inside the new span stay where they are; each one outside it
    is copied to the lowest page of the span that holds no live page (never onto a live page, so
    the copy reads nothing it writes); a block too small, or a float holding fixed pages, is
    refused before anything is copied."""
    band, ids = _filled(6, Placement.FLOAT)
    band.free(ids[2:3], None)  # a hole inside the block
    live = band.live_pages()
    lo = band.lo + 2  # the span shifts up by two pages: the two lowest live pages leave it
    reloc = plan_relocation(band, lo, 6)
    assert reloc.src.tolist() == live[:2].tolist()
    open_ = [p for p in range(lo, lo + 6) if p not in set(live.tolist())]
    assert reloc.dst.tolist() == open_[:2]
    assert ids[2] in reloc.dst  # the hole inside the old block is reused first
    assert not set(reloc.dst.tolist()) & set(live.tolist())
    assert reloc.reused.tolist() == [int(ids[2])]
    assert reloc.fresh.tolist() == [band.hi, band.hi + 1]
    same = plan_relocation(band, band.lo, band.hi - band.lo)  # the span it has: nothing moves
    assert len(same.src) == 0 and len(same.dst) == 0
    with pytest.raises(CapacityError):
        plan_relocation(band, band.grid.first_id, 2)
    band.fix(live[:1], "load reservation")
    with pytest.raises(InvariantError, match=r"band\.relocate_fixed"):
        plan_relocation(band, lo, 6)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_relocation_moves_exactly_the_live_pages_outside_the_new_span(data):
    """COMP-16, COMP-23, over random floats and spans: the plan copies each live page outside the
    new span, and only those, into pages of the span that hold no live page, lowest first; after the
    band commits it, every live page lies in the span with its virtual id bound where it went, the
    others did not move, and the rest of the span is holes."""
    n = data.draw(st.integers(1, 12))
    band, ids = _filled(n, Placement.FLOAT)
    virtual = dict(zip(band.translate(np.arange(1, n + 1)).tolist(), range(1, n + 1)))  # page -> its virtual id
    freed = data.draw(st.lists(st.sampled_from(ids.tolist()), unique=True, max_size=n - 1))
    if freed:
        band.free(np.array(sorted(freed)), None)
    live = band.live_pages()
    size = data.draw(st.integers(len(live), len(live) + 6))
    lo = data.draw(st.integers(max(band.grid.first_id, band.lo - 8), band.hi + 2))
    if lo + size > band.grid.n_grid:
        return
    reloc = plan_relocation(band, lo, size)
    hi = lo + size
    outside = live[(live < lo) | (live >= hi)]
    assert reloc.src.tolist() == outside.tolist()
    open_ = [p for p in range(lo, hi) if p not in set(live.tolist())]
    assert reloc.dst.tolist() == open_[: len(outside)]
    band.relocate(reloc.src, reloc.dst, lo, size, None)
    after = band.live_pages()
    assert len(after) == len(live) and ((after >= lo) & (after < hi)).all()
    moved = dict(zip(reloc.src.tolist(), reloc.dst.tolist()))
    for page in live.tolist():
        v = np.array([virtual[page]])
        assert band.translate(v).tolist() == [moved.get(page, page)]
    assert band.n_holes == size - len(live) and (band.lo, band.hi) == (lo, hi)
