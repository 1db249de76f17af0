"""The chain take, rule by rule: where `Band.hand_out` finds pages, how a float grows and is
placed, how pricing counts a take, and urgent recovery before a relief."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.band import Band
from kvchain.alloc.chain import ChainAllocator
from kvchain.alloc.pricing import take_layout
from kvchain.alloc.signals import NetworkTransfer
from kvchain.errors import CapacityError
from support.chains import admit_random, finish_random, small_storage
from support.modeled import launch_forward, modeled_storage, process, request


def _demand(chain, **by_name):
    pages = [0] * len(chain.bands)
    for band in chain.bands:
        pages[band.index] = by_name.get(band.name, 0)
    return pages


def _spans_in_order(chain):
    cursor = chain.layout.chain_lo
    for band in chain.bands:
        if not band.parked:
            assert band.bottom >= cursor, f"{band.name} overlaps its neighbour"
            cursor = band.top
    assert cursor <= chain.layout.arena_bytes


def _owner_holes_then_pending():
    """Owner rows A (base) .. D (frontier), two pages each: B freed idle (holes), then C freed under
    an in-flight forward that writes nothing (pending), D still live at the frontier."""
    storage, dev = modeled_storage(chain_kib=4)
    owner = storage.allocator.owner
    rows = [request(storage, 8)[0] for _ in range(4)]
    pages = {r: owner.ids.v2p[storage.table.pages_of(r)].copy() for r in rows}
    storage.free_rows(np.array([rows[1]]))
    rec = launch_forward(storage, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    storage.free_rows(np.array([rows[2]]))
    assert owner.n_holes == 2 and owner.n_pending == 2
    return storage, dev, rec, rows, pages


def test_take_uses_holes_before_pending_pages_and_growth():
    """ALLOC-2: holes come first: a take the holes cover hands out exactly the holes, settles no
    pending batch (no stream wait) and leaves the frontier where it was."""
    storage, dev, rec, rows, pages = _owner_holes_then_pending()
    chain, owner = storage.allocator, storage.allocator.owner
    lo, waits = owner.lo, dev.counters.stream_waits
    ids = chain.take(_demand(chain, full=2))[owner.index]
    assert sorted(ids.tolist()) == sorted(pages[rows[1]].tolist())
    assert owner.n_pending == 2 and owner.lo == lo
    assert dev.counters.stream_waits == waits
    process(storage, rec)


def test_take_grows_the_frontier_only_after_holes_and_settled_pending_pages():
    """ALLOC-4: a take of five pages over two holes and two pending pages uses all four, settles
    the batch with a stream wait, and grows the frontier by the one page left, no more."""
    storage, dev, rec, rows, pages = _owner_holes_then_pending()
    chain, owner = storage.allocator, storage.allocator.owner
    lo, waits = owner.lo, dev.counters.stream_waits
    ids = chain.take(_demand(chain, full=5))[owner.index]
    reused = set(pages[rows[1]].tolist()) | set(pages[rows[2]].tolist())
    assert reused <= set(ids.tolist())
    assert set(ids.tolist()) - reused == {lo - 1}
    assert owner.lo == lo - 1 and owner.n_pending == 0 and owner.n_holes == 0
    assert dev.counters.stream_waits > waits and not rec.processed
    process(storage, rec)


def test_only_band_acquire_hands_out_pages():
    """ALLOC-1: every virtual id a storage call newly binds is backed by a page that
    `Band.hand_out` handed out in that call, across prompts, decodes, slots and relief."""
    storage = small_storage(page_size=2, chain_kib=10, windows=(48, 16), rows=16, context=128)
    chain = storage.allocator
    handed: list[np.ndarray] = []
    original = Band.hand_out

    def spy(self, n, *args, **kwargs):
        out = original(self, n, *args, **kwargs)
        handed.append((self.index, out[0].copy()))
        return out

    Band.hand_out = spy
    try:
        rng = np.random.default_rng(3)
        rows: list[int] = []
        for _ in range(150):
            before = [b.ids.v2p.copy() for b in chain.bands]
            handed.clear()
            action = rng.integers(4)
            try:
                if action == 0:
                    admit_random(storage, rng, rows, 40)
                elif action == 1 and rows:
                    live = [r for r in rows if storage.table.seq_lens[r] < storage.table.context_len]
                    if live:
                        storage.alloc_decode(np.array(live))
                elif action == 2 and rows:
                    finish_random(storage, rng, rows)
                else:
                    storage.free_state_slots(storage.alloc_state_slots(1))
            except CapacityError:
                pass
            for band, old in zip(chain.bands, before):
                new = band.ids.v2p
                fresh = np.flatnonzero((old < 0) & (new >= 0))
                got = np.concatenate([ids for i, ids in handed if i == band.index] + [np.empty(0, np.int64)])
                assert set(new[fresh].tolist()) <= set(got.tolist()), f"{band.name}: pages bound without hand_out"
        storage.check_idle()
    finally:
        Band.hand_out = original


def _region(chain, band):
    prev_top, next_bottom = chain.neighbour_bounds(band.index)
    g = band.grid
    floor_id = max(g.first_id, -(-(prev_top - g.origin) // g.page_bytes))
    ceil_id = min(g.n_grid, (next_bottom - g.origin) // g.page_bytes)
    return floor_id, ceil_id


@pytest.mark.parametrize("n", [1, 3, 8])
def test_an_empty_float_is_placed_in_the_middle_of_its_region(n):
    """ALLOC-6: a parked float's first take puts its block in the middle of the free region
    between its neighbours, leaving room on both sides to grow."""
    storage = small_storage(page_size=2, chain_kib=24)
    chain = storage.allocator
    chain.take(_demand(chain, state=5, full=40))
    window = chain.window_bands[0]
    assert window.parked
    floor_id, ceil_id = _region(chain, window)
    chain.take(_demand(chain, **{window.name: n}))
    below, above = window.lo - floor_id, ceil_id - window.hi
    assert abs(below - above) <= 1 and below > 0


@pytest.mark.parametrize("crowd", ["full", "state"])
def test_a_float_grows_toward_its_larger_gap(crowd):
    """ALLOC-5: with its holes used up, a float grows its frontier on the side with the larger
    gap: down when the down end has crowded it, up when the up end has."""
    storage = small_storage(page_size=2, chain_kib=24)
    chain = storage.allocator
    window = chain.window_bands[0]
    chain.take(_demand(chain, **{window.name: 3}))
    floor_id, ceil_id = _region(chain, window)
    mid = (floor_id + ceil_id) // 2
    if crowd == "full":  # the down end grows to a few pages above the float
        owner = chain.owner
        target = (window.top + 4 * window.page_bytes - owner.grid.origin) // owner.page_bytes
        chain.take(_demand(chain, full=owner.lo - target))
    else:
        state = chain.state_band
        target = (window.bottom - 4 * window.page_bytes - state.grid.origin) // state.page_bytes
        chain.take(_demand(chain, state=target - state.hi))
    floor_id, ceil_id = _region(chain, window)
    down, up = window.lo - floor_id, ceil_id - window.hi
    assert (down > up) == (crowd == "full") and min(down, up) < max(down, up)
    lo, hi = window.lo, window.hi
    chain.take(_demand(chain, **{window.name: 2}))
    if crowd == "full":
        assert (window.lo, window.hi) == (lo - 2, hi)
    else:
        assert (window.lo, window.hi) == (lo, hi + 2)
    assert abs(mid - (lo + hi) // 2) <= 1


def test_pricing_counts_a_take_in_the_order_acquire_takes():
    """ALLOC-8: for takes served by holes, by holes and pending pages, and by all three with
    growth, `take_layout` on the snapshot before gives the band's frontiers, live and free pages
after `Band.hand_out`."""
    for n in (1, 2, 3, 4, 5, 7):
        storage, _dev, rec, _rows, _pages = _owner_holes_then_pending()
        chain, owner = storage.allocator, storage.allocator.owner
        prev_top, next_bottom = chain.neighbour_bounds(owner.index)
        want = take_layout(owner.snapshot(), n, prev_top, next_bottom)
        ids = storage.allocator.take_from(owner, n)
        assert len(ids) == n
        got = owner.snapshot()
        # a settle turns whole batches into holes, so only the free total is compared, not its split
        assert (got.lo, got.hi, got.live, got.free) == (want.lo, want.hi, want.live, want.free), n
        process(storage, rec)


def test_take_in_place_takes_directly_and_keeps_clear_of_network_reads():
    """ALLOC-9: a take the in-place plan serves (two bands growing) runs no relief and moves
    nothing; pages a network send still reads are never handed out, and the take does not wait
    the send."""
    storage = small_storage(page_size=2, chain_kib=24)
    chain = storage.allocator
    owner = chain.owner
    rows = [storage.alloc_row() for _ in range(3)]
    storage.alloc_extend(np.array(rows), np.array([8, 8, 8]))
    sent = owner.ids.v2p[storage.table.pages_of(rows[2])].copy()  # nearest the frontier
    send = NetworkTransfer("send", sends=True)
    storage.record_network_transfer(send, {owner.name: sent})
    storage.free_rows(np.array([rows[2]]))
    assert owner.n_vacated == len(sent)
    relieved = []
    original = ChainAllocator._relieve
    ChainAllocator._relieve = lambda self, pages: relieved.append(pages) or original(self, pages)
    try:
        moves = sum(b.stats["moves"] for b in chain.bands)
        taken = chain.take(_demand(chain, state=2, full=6))
    finally:
        ChainAllocator._relieve = original
    assert not relieved and sum(b.stats["moves"] for b in chain.bands) == moves
    assert len(taken[owner.index]) == 6 and not set(taken[owner.index].tolist()) & set(sent.tolist())
    assert not send.released and owner.n_vacated == len(sent)
    _spans_in_order(chain)


def _relief_under_a_forward():
    """Two requests, both freed under an in-flight forward: every band holds only pending pages.
    The owner's demand then needs the bytes the window float holds: not in place, so relief."""
    storage, dev = modeled_storage(chain_kib=4)
    chain = storage.allocator
    rows = [request(storage, 8)[0] for _ in range(2)]
    rec = launch_forward(storage, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    storage.free_rows(np.array(rows))
    assert all(b.n_pending and not b.n_live for b in chain.bands)
    demand = _demand(chain, full=26)
    assert not chain.in_place(demand) and chain.units_fit(demand)
    chain.decisions = []
    return storage, dev, rec, demand


def test_urgent_recovery_reads_ahead_before_any_stream_wait():
    """ALLOC-11: recovery runs every band's host read-ahead before the first stream wait it
    queues (a host read behind a wait on a running forward would stall the scheduler)."""
    storage, dev, rec, demand = _relief_under_a_forward()
    chain = storage.allocator
    events = []
    stream_wait = dev.stream_wait
    chain.host_read_observers.append(lambda what: events.append(("read", what.split("'")[0])))
    dev.stream_wait = lambda stream, event: events.append(("wait", event.label)) or stream_wait(stream, event)
    try:
        assert chain.ensure_capacity(demand)
    finally:
        chain.host_read_observers.clear()
        del dev.stream_wait
    kinds = [k for k, _ in events]
    assert "wait" in kinds
    first_wait = kinds.index("wait")
    assert sorted(n for k, n in events[:first_wait] if k == "read") == sorted(b.name for b in chain.bands)
    assert "read" not in kinds[first_wait:]
    process(storage, rec)


def test_urgent_recovery_settles_every_pending_batch_of_every_band():
    """ALLOC-12: recovery settles every band's pending batches by stream waits on the forward
    (the host never blocks, the forward stays unprocessed), whether or not the plan then touches
    that band."""
    storage, dev, rec, demand = _relief_under_a_forward()
    chain = storage.allocator
    blocked = dev.counters.host_waits_blocked
    assert chain.ensure_capacity(demand)
    assert all(b.n_pending == 0 for b in chain.bands)
    settled = {d[1] for d in chain.decisions if d[0] == "stream_wait" and "settle pending" in d[2]}
    assert settled == {b.name for b in chain.bands}
    assert dev.counters.host_waits_blocked == blocked and not rec.processed
    chain.take(demand)
    process(storage, rec)


def test_urgent_recovery_parks_floats_left_empty():
    """ALLOC-13: the window float held only pending pages; recovery settles them and parks it, so
    the owner grows over its bytes with no float in the way."""
    storage, _dev, rec, demand = _relief_under_a_forward()
    chain = storage.allocator
    window = chain.window_bands[0]
    old_bottom = window.bottom
    assert chain.ensure_capacity(demand)
    assert window.parked and window.n_holes == 0
    ids = chain.take(demand)[chain.owner.index]
    assert len(ids) == 26 and chain.owner.bottom < old_bottom
    _spans_in_order(chain)
    process(storage, rec)
