"""A band alone: no chain, no device, no page copier. What a band needs comes in as arguments (the
planned layout, the forward in flight) and what must happen outside it comes back as values (the
waits a settle needs, the fences pages leave): this file is the proof that a band is passive."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.band import HOLE, LIVE, OUT, PENDING, VACATED, Band, FloatBand
from kvchain.alloc.forward_steps import LaunchRecord
from kvchain.alloc.page_usage import Clear, Hazard, PageUse
from kvchain.alloc.pricing import CapacityEpoch, take_layout
from kvchain.alloc.signals import NetworkTransfer
from kvchain.device.base import Event
from kvchain.errors import InvariantError
from kvchain.memory.arena import arena_layout
from kvchain.plan import Placement, plan_kv_storage
from support.chains import hybrid_decls


def _alone(placement: Placement = Placement.DOWN_END, arena_kib: int = 64):
    """One band of a hybrid plan's layout, with its own capacity epoch and nothing else."""
    plan = plan_kv_storage(hybrid_decls(), page_size=2)
    layout = arena_layout(plan, arena_kib * 1024)
    pool = next(p for p in plan.sub_pools if p.placement is placement)
    grid = layout.grids[pool.index]
    cls = FloatBand if placement is Placement.FLOAT else Band
    band = cls(pool, grid, CapacityEpoch(), grid.n_grid + 1)
    return band, layout


def _take(band, layout, n: int) -> np.ndarray:
    """A hand-out grown alone between the chain's ends, as `take_layout` plans it."""
    after = take_layout(band.snapshot(), n, layout.chain_lo, layout.arena_bytes)
    ids, _grown, waits = band.hand_out(n, after)
    assert not waits
    band.bind(np.arange(1, n + 1) + band.n_live - n, ids)
    return ids


def _forward(step: int) -> LaunchRecord:
    return LaunchRecord(step, True, event=Event(label=f"forward_done:{step}"), recorded=True)


def test_a_band_holds_nothing_of_the_chain():
    """A band's attributes are its own arrays, counts and static description: no chain, device,
    copier or forward steps to call into."""
    band, _ = _alone()
    assert not {"chain", "device", "copier", "forward_steps", "fences"} & set(vars(band))


def test_a_hand_out_grows_to_the_planned_layout_and_moves_the_epoch():
    """ALLOC-8, CAP-7: growth lands exactly on `take_layout`'s frontiers, and every count it
    changes moves the capacity epoch."""
    band, layout = _alone()
    before = band.epoch.value
    after = take_layout(band.snapshot(), 5, layout.chain_lo, layout.arena_bytes)
    ids, grown, waits = band.hand_out(5, after)
    assert grown is ids and not waits and len(ids) == 5
    assert (band.lo, band.hi, band.n_live) == (after.lo, after.hi, 5)
    assert (band.state[ids] == LIVE).all() and band.epoch.value > before


def test_a_growth_with_no_planned_layout_is_refused():
    """ALLOC-7: a band never decides growth itself; without the caller's plan it refuses."""
    band, _ = _alone()
    before, states = band.snapshot(), band.state.copy()
    with pytest.raises(InvariantError, match=r"band\.hand_out"):
        band.hand_out(3, None)
    assert band.snapshot() == before and np.array_equal(band.state, states)


def test_a_free_under_a_forward_pends_and_its_settle_returns_the_stream_wait():
    """LIFE-24, LIFE-29, LEDG-9: pages freed under the forward in flight pend on it; settling them
    makes them holes and returns the schedule stream's wait on its event, derived from CLEARANCE,
    for the caller to queue: the band waits nothing itself."""
    band, layout = _alone()
    ids = _take(band, layout, 4)
    key = _forward(3)
    assert band.free(ids[:2], key) == ()
    assert (band.state[ids[:2]] == PENDING).all() and band.n_pending == 2 and band.n_holes == 0
    waits, fences = band.settle_pending()
    assert [(w.clear, w.use.event, w.use.step) for w in waits] == [(Clear.STREAM_WAIT, key.event, 3)]
    assert "settle pending under step 3" in waits[0].why and fences == ()
    assert (band.state[ids[:2]] == HOLE).all() and band.n_pending == 0 and band.n_holes == 2


def test_a_free_with_no_forward_in_flight_leaves_holes():
    """LIFE-25: with no recorded forward in flight a freed page is a hole at once."""
    band, layout = _alone()
    ids = _take(band, layout, 3)
    band.free(ids[:1], None)
    assert band.state[ids[0]] == HOLE and band.n_holes == 1 and band.n_pending == 0


def test_a_processed_forward_releases_its_batches_and_no_later_one():
    """LIFE-27: `release_pending_through(step)` returns batches keyed at or before `step`."""
    band, layout = _alone()
    ids = _take(band, layout, 4)
    band.free(ids[:1], _forward(1))
    band.free(ids[1:3], _forward(2))
    band.release_pending_through(1)
    assert band.state[ids[0]] == HOLE and (band.state[ids[1:3]] == PENDING).all()
    band.release_pending_through(2)
    assert (band.state[ids[:3]] == HOLE).all() and band.n_pending == 0


def test_a_float_emptied_parks_and_returns_the_fences_its_pages_leave():
    """COMP-24, COMP-20: a float left empty parks, and the unfinished uses on the pages leaving it
    come back as fences over their bytes (for the chain to keep), no longer in its ledger."""
    band, layout = _alone(Placement.FLOAT)
    assert band.parked
    ids = _take(band, layout, 3)
    assert not band.parked
    band.set_inflight_forward(7, Event(label="forward_done:7"), ids)
    fences = band.free(ids, None)
    assert band.parked and band.span == 0 and (band.state[ids] == OUT).all()
    assert len(fences) == 3 and {f.use.step for f in fences} == {7}
    lo, hi = band.byte_ranges(ids)
    assert sorted((f.lo, f.hi) for f in fences) == sorted(zip(lo.tolist(), hi.tolist()))
    assert not band.usage.uses


def test_pages_a_send_reads_are_vacated_until_the_transfer_ends():
    """PD-1, COMP-18: a freed page a network send reads is vacated; once the transfer's use ends
    the band returns it (here as a hole: no forward in flight)."""
    band, layout = _alone()
    ids = _take(band, layout, 3)
    send = NetworkTransfer("send", sends=True, done=Event(label="send done"))
    band.usage.record(PageUse(Hazard.NETWORK, ids[:2], writes=False, transfer=send, label="send"))
    band.free(ids, None)
    assert (band.state[ids[:2]] == VACATED).all() and band.n_vacated == 2 and band.n_holes == 1
    assert band.take_ready_vacated(None) == () and band.n_vacated == 2  # the send still reads them
    band.usage.end_transfer(send)
    band.take_ready_vacated(None)
    assert (band.state[ids] == HOLE).all() and band.n_vacated == 0 and band.n_holes == 3


def test_committed_moves_rebind_and_leave_sources_a_forward_hazard():
    """COMP-16, COMP-18: after the caller copied `src` onto `dst`, the band rebinds the virtual
    ids and the sources become holes carrying the forward in flight's hazard."""
    band, layout = _alone()
    ids = _take(band, layout, 4)
    band.free(ids[:2], None)
    src, dst = ids[2:], ids[:2]
    virtual = band.ids.p2v[src].copy()
    key = _forward(5)
    band.commit_moves(src, dst, key)
    assert (band.ids.v2p[virtual] == dst).all()
    assert (band.state[src] == HOLE).all() and (band.state[dst] == LIVE).all()
    [use] = band.usage.on(src)
    assert use.hazard is Hazard.FORWARD and use.vacated and use.step == 5 and not use.writes
