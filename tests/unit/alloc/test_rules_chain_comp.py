"""Compaction, rule by rule: lazy frees, where the opportunistic and the urgent flush are entered,
what each waits, what they leave alone, and how floats move."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.band import HOLE, PENDING
from kvchain.alloc.chain import ChainAllocator
from kvchain.device.modeled import clock_leq
from kvchain.errors import CapacityError
from kvchain.memory.copy import PageCopier
from kvchain.testing.overlap import OverlapDriver
from support.chains import Payloads, admit_random, finish_random, grow_random, small_storage
from support.modeled import launch_forward, modeled_storage, process, request
from support.tree import patched

_NONE = np.array([], dtype=np.int64)


def test_a_free_only_leaves_holes_which_a_later_flush_closes():
    """COMP-1: freeing a request in the middle of the owner copies nothing and keeps the span; its
    pages are holes until a flush closes them."""
    storage = small_storage(page_size=2, chain_kib=16)
    rows = [storage.alloc_row() for _ in range(3)]
    storage.alloc_extend(np.array(rows), np.array([8, 8, 8]))
    owner = storage.allocator.owner
    middle = owner.ids.v2p[storage.table.pages_of(rows[1])].copy()
    span, launches = (owner.lo, owner.hi), storage.device.counters.launches
    storage.free_rows(np.array([rows[1]]))
    assert (owner.lo, owner.hi) == span and owner.stats["moves"] == 0
    assert storage.device.counters.launches == launches
    assert (owner.state[middle] == HOLE).all() and owner.n_holes == len(middle)
    assert storage.allocator.flush(owner, max_moves=None) == len(middle)
    assert owner.n_holes == 0 and owner.span == owner.n_live


def _writers_scenario(monkeypatch):
    """Owner rows A (base) .. D (frontier). B is freed under forward f1 (pending); f2 then writes
    D's pages, the ones an urgent flush moves into B's pages. The flush is entered directly on a
    band with pending pages, which relief never does (its recovery settles first, and the checks
    flag such an entry), so the checks are off: what is held is the flush's own settle."""
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "0")
    storage, dev = modeled_storage(chain_kib=4)
    owner = storage.allocator.owner
    rows, vtoks = zip(*[request(storage, 8) for _ in range(4)])
    f1 = launch_forward(storage, np.array([], dtype=np.int64), _NONE)
    storage.free_rows(np.array([rows[1]]))
    f2 = launch_forward(storage, np.array([rows[3]]), vtoks[3])
    assert owner.n_pending == 2
    storage.allocator.decisions = []
    return storage, dev, owner, (f1, f2), rows


def test_urgent_moves_run_on_the_schedule_stream_after_the_forwards_touching_their_pages(monkeypatch):
    """COMP-2: each page copy of an urgent flush is launched on the schedule stream, ordered after
    the forward that writes its sources and the one its destinations were freed under."""
    storage, dev, owner, (f1, f2), _rows = _writers_scenario(monkeypatch)
    start = len(dev.history)
    assert storage.allocator.relief_flush(owner) > 0
    copies = [w for w in dev.history[start:] if w.label == "move"]
    assert copies
    for item in copies:
        assert item.stream == dev.schedule_stream.name
        assert clock_leq(f1.event.clock, item.clock) and clock_leq(f2.event.clock, item.clock)
    process(storage, f1)
    process(storage, f2)


def test_the_urgent_flush_waits_the_writers_of_what_it_moves_after_settling(monkeypatch):
    """COMP-6: the urgent flush first settles the band (a stream wait on f1, whose batch it holds),
    then waits f2, which writes the pages it moves, then copies; no host wait."""
    storage, dev, owner, (f1, f2), _rows = _writers_scenario(monkeypatch)
    blocked = dev.counters.host_waits_blocked
    storage.allocator.relief_flush(owner)
    log = [(d[0], d[3] if d[0] == "stream_wait" else None) for d in storage.allocator.decisions
           if d[0] in ("stream_wait", "move")]
    assert log[:3] == [("stream_wait", f1.event.label), ("stream_wait", f2.event.label), ("move", None)]
    assert dev.counters.host_waits_blocked == blocked
    process(storage, f1)
    process(storage, f2)


def test_the_urgent_flush_settles_a_band_before_working_on_it(monkeypatch):
    """COMP-13: entered on a band with pending pages, the urgent flush settles them (stream wait)
    before its first move, and packs the band once they are holes."""
    storage, _dev, owner, (f1, f2), _rows = _writers_scenario(monkeypatch)
    entered = []

    def spy(original):
        def flush(self, band, max_moves, relief=False, hold_network=False):
            if relief:
                entered.append(band.n_pending)
            return original(self, band, max_moves, relief, hold_network)
        return flush

    with patched(ChainAllocator, "flush", spy):
        moved = storage.allocator.relief_flush(owner)
    assert entered == [0] and moved > 0 and owner.n_pending == 0 and owner.n_holes == 0
    kinds = [d[0] for d in storage.allocator.decisions]
    assert kinds.index("stream_wait") < kinds.index("move")
    process(storage, f1)
    process(storage, f2)


def test_opportunistic_flush_enters_through_flush_opportunistic():
    """COMP-3: under an overlap run with flushes between steps and at idle, every opportunistic
    band flush is entered through `ChainAllocator.flush_opportunistic` (storage's maintenance
    call included)."""
    storage, _dev = modeled_storage(chain_kib=6)
    depth = [0]
    outside, inside = [], []

    def spy_entry(original):
        def flush_opportunistic(self, *args, **kwargs):
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return flush_opportunistic

    def spy_flush(original):
        def flush(self, band, max_moves, relief=False, hold_network=False):
            if not relief:
                (inside if depth[0] else outside).append(band.name)
            return original(self, band, max_moves, relief, hold_network)
        return flush

    driver = OverlapDriver(storage, seed=1, flush_every=1, flush_moves=4)
    with patched(ChainAllocator, "flush_opportunistic", spy_entry), \
            patched(ChainAllocator, "flush", spy_flush):
        for _ in range(30):
            driver.step()
        driver.drain()
        at_idle = len(inside)
        storage.flush_opportunistic()  # at idle
    assert inside and len(inside) > at_idle and not outside


def test_the_urgent_flush_is_entered_only_from_relief():
    """COMP-4: over a churn with opportunistic flushes and reliefs, every urgent flush runs inside
    a relief and through `ChainAllocator.relief_flush`, and some did run."""
    storage = small_storage(page_size=2, chain_kib=10, windows=(48, 16), rows=32, context=128)
    chain = storage.allocator
    stack: list[str] = []
    urgent_at: list[tuple[str, ...]] = []

    def enter(tag):
        def wrap(original):
            def fn(self, *args, **kwargs):
                stack.append(tag)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    stack.pop()
            return fn
        return wrap

    def spy_flush(original):
        def flush(self, band, max_moves, relief=False, hold_network=False):
            if relief:
                urgent_at.append(tuple(stack))
            return original(self, band, max_moves, relief, hold_network)
        return flush

    rng = np.random.default_rng(5)
    rows: list[int] = []
    with patched(ChainAllocator, "_relieve", enter("relief")), \
            patched(ChainAllocator, "relief_flush", enter("relief_flush")), \
            patched(ChainAllocator, "flush", spy_flush):
        for _ in range(600):
            action = rng.integers(4)
            try:
                if action == 0:
                    admit_random(storage, rng, rows, 40)
                elif action == 1 and rows:
                    grow_random(storage, rng, rows, 24)
                elif action == 2 and rows:
                    finish_random(storage, rng, rows)
                else:
                    chain.flush_opportunistic(8)
            except CapacityError:
                pass
    assert urgent_at, "the churn never relieved"
    assert all(s[:1] == ("relief",) and s[-1] == "relief_flush" for s in urgent_at), urgent_at
    storage.check_idle()


def test_the_opportunistic_flush_only_absorbs_boundary_holes_on_a_band_with_pending_pages():
    """COMP-12: owner rows A (base) .. E (frontier); B and E freed idle (holes), D under a forward
    (pending). The opportunistic flush moves nothing (C stays out of B's holes) and retreats the
    frontier over E's holes only, stopping at D's pending pages."""
    storage, _dev = modeled_storage(chain_kib=4)
    owner = storage.allocator.owner
    rows = [request(storage, 8)[0] for _ in range(5)]
    pages = [owner.ids.v2p[storage.table.pages_of(r)].copy() for r in rows]
    storage.free_rows(np.array([rows[1], rows[4]]))
    rec = launch_forward(storage, np.array([], dtype=np.int64), _NONE)
    storage.free_rows(np.array([rows[3]]))
    live_c = pages[2].copy()
    moved = storage.allocator.flush(owner, max_moves=64)
    assert moved == 0
    assert owner.lo == pages[3].min() and (owner.state[pages[3]] == PENDING).all()
    assert (owner.state[pages[1]] == HOLE).all()
    assert np.array_equal(owner.ids.v2p[storage.table.pages_of(rows[2])], live_c)
    process(storage, rec)


def _float_pages(storage):
    """Per float: its virtual page -> physical page bindings."""
    out = {}
    for band in storage.allocator.window_bands:
        bound = np.flatnonzero(band.ids.v2p[:-1] >= 0)
        out[band.index] = dict(zip(bound.tolist(), band.ids.v2p[bound].tolist()))
    return out


def test_a_float_moves_only_when_a_planned_layout_relocates_it():
    """COMP-23: over a churn with reliefs, opportunistic flushes and direct band flushes, a float's
    pages change place only in an operation whose relief plan relocates that float, and some did."""
    storage = small_storage(page_size=2, chain_kib=10, windows=(48, 16), rows=32, context=128)
    chain = storage.allocator
    payloads = Payloads(storage)
    rng = np.random.default_rng(11)
    rows: list[int] = []
    relocated_ops = 0
    for _ in range(800):
        before = _float_pages(storage)
        chain.decisions = []
        action = rng.integers(5)
        try:
            if action == 0:
                admit_random(storage, rng, rows, 40, payloads)
            elif action == 1 and rows:
                grow_random(storage, rng, rows, 24, payloads)
            elif action == 2 and rows:
                finish_random(storage, rng, rows)
            elif action == 3:
                chain.flush_opportunistic(8)
            else:
                for band in chain.bands:
                    chain.flush(band, 8)
        except CapacityError:
            pass
        planned = {r[0] for d in chain.decisions if d[0] == "relief" for r in d[2]}
        relocated = {d[1] for d in chain.decisions if d[0] == "relocate"}
        after = _float_pages(storage)
        for band in chain.window_bands:
            old, new = before[band.index], after[band.index]
            moved = [v for v in old.keys() & new.keys() if old[v] != new[v]]
            if moved:
                assert band.index in planned and band.name in relocated, f"{band.name} moved unplanned"
                relocated_ops += 1
        assert relocated <= {chain.bands[i].name for i in planned}
        payloads.check()
    assert relocated_ops
    storage.check_idle()


def test_an_empty_float_is_transparent_to_its_neighbours():
    """COMP-24: once its last request ends, the window float parks, and the owner sees through it:
    its neighbour is the state band, and it takes the float's old bytes in place, moving nothing."""
    storage = small_storage(page_size=2, chain_kib=8, windows=(16,))
    chain = storage.allocator
    window, owner, state = chain.window_bands[0], chain.owner, chain.state_band
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([6]))
    old_bottom = window.bottom
    storage.free_rows(np.array([row]))
    assert window.parked
    prev_top, _ = chain.neighbour_bounds(owner.index)
    assert prev_top == state.top
    room = (owner.bottom - state.top) // owner.page_bytes
    demand = [0] * len(chain.bands)
    demand[owner.index] = room
    assert chain.in_place(demand) and chain.units_fit(demand)
    moves = owner.stats["moves"]
    ids = chain.take(demand)[owner.index]
    assert len(ids) == room and owner.bottom < old_bottom and owner.stats["moves"] == moves


def test_prewarm_runs_the_page_copy_path_once_per_band_at_build():
    """COMP-25: building the storage copies one page of every band onto itself through the page
    copier, so the copy path has run before serving; the copy changes no byte."""
    seen = []

    def spy(original):
        def move_pages(self, grid, src, dst, label="move"):
            seen.append((grid.index, src.tolist(), dst.tolist(), label))
            return original(self, grid, src, dst, label)
        return move_pages

    with patched(PageCopier, "move_pages", spy):
        storage = small_storage(page_size=2, chain_kib=8)
    chain = storage.allocator
    prewarm = [s for s in seen if s[3] == "prewarm"]
    assert sorted(s[0] for s in prewarm) == sorted(b.index for b in chain.bands)
    for _name, src, dst, _ in prewarm:
        assert src == dst and len(src) == 1
    assert len(seen) == len(prewarm)
