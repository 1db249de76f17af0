"""Windows, the prefix tree and checkpoints: one focused test per WIN rule."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchain.alloc.band import HOLE, PENDING
from kvchain.alloc.demand import DemandPurpose, request_demand, retained_window
from kvchain.build import build_kv_storage
from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from kvchain.decl import MHA, FullLifetime, KVPart, WindowLifetime, kv_layer_decls
from kvchain.device.base import PageAccess
from kvchain.device.modeled import clock_leq
from kvchain.engine.request import ScheduledRequest
from kvchain.errors import CapacityError
from kvchain.plan import plan_kv_storage
from kvchain.prefill_budget import Decision, mamba_prefill_chunk_grid
from kvchain.sizing import size_plan
from kvchain.testing.checks import META_BAND, Granules, OverlapTracker
from support.chains import small_storage
from support.modeled import launch_forward, modeled_storage, process, request
from support.simworld import world
from support.tree import cache_sequence

# -- helpers ------------------------------------------------------------------------------------------


def _counts(band):
    return band.n_live, band.n_holes, band.n_pending


def _window_band(storage, i=0):
    return storage.allocator.window_bands[i]


def _untouched_but_ids(storage):
    """Everything a take or a free would change, apart from the virtual-to-physical maps."""
    chain = storage.allocator
    out = [chain.virtual_free.view().copy(), chain.slot_free.view().copy()]
    for b in chain.bands:
        out.append((b.lo, b.hi, b.n_live, b.n_holes, b.n_pending, b.n_vacated, b.state.copy(),
                    np.sort(b.holes.view().copy()), [(x.key, x.size) for x in b.pending]))
    return out


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                assert np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v
        else:
            assert np.array_equal(x, y)


def _tokens(n, start=1):
    return np.arange(start, start + n, dtype=np.int32)


# -- WIN-1: window retirement is an ordinary logical free ------------------------------------------------


def test_advance_frees_the_rows_out_of_the_window_logically():
    """WIN-1: `advance` frees exactly the window pages wholly before the window; under a forward in
    flight they pend on it, with nothing in flight they are holes at once."""
    storage, dev = modeled_storage(windows=(16,), state=False, chain_kib=48)
    band = _window_band(storage)
    owner = storage.allocator.owner
    ps = storage.page_size
    row, _ = request(storage, 40)
    vtok = storage.alloc_extend(np.array([row]), np.array([41]))
    rec = launch_forward(storage, np.array([row]), vtok)
    live, holes, pending = _counts(band)
    vpages = storage.table.page_table[row, :11].copy()
    waits = dev.counters.host_waits
    freed = storage.advance(np.array([row]))
    gone = (41 - 16) // ps  # pages wholly before the window
    assert freed == gone == 6
    assert _counts(band) == (live - gone, holes, pending + gone)
    assert (band.ids.v2p[vpages[:gone]] < 0).all() and (band.ids.v2p[vpages[gone:]] >= 0).all()
    assert (owner.ids.v2p[vpages] >= 0).all()  # full attention keeps every row
    assert dev.counters.host_waits == waits
    process(storage, rec)
    assert _counts(band) == (live - gone, holes + gone, pending)
    storage.alloc_extend(np.array([row]), np.array([49]))
    live, holes, pending = _counts(band)
    assert storage.advance(np.array([row])) == 2  # keep from 33: pages 6 and 7 leave
    assert _counts(band) == (live - 2, holes + 2, pending)
    storage.free_rows(np.array([row]))
    storage.check_idle()


# -- WIN-3: the primary window takes the tree's generic window slot -----------------------------------


def test_the_tree_puts_the_primary_window_first_even_with_a_longer_draft_window():
    """WIN-2, WIN-3: the tree's slots are full, the target's primary window (its generic window
    slot), then the draft's longer window, even though the draft window comes first in the chain."""
    mha = MHA(1, 8)
    target = kv_layer_decls([KVPart(mha, FullLifetime()), KVPart(mha, WindowLifetime(16))])
    draft = kv_layer_decls([KVPart(mha, WindowLifetime(64))])
    plan = plan_kv_storage(target, page_size=2, draft=draft)
    probe = size_plan(plan, 2**26, context_len=64, max_running_requests=4)
    sizing = size_plan(plan, probe.fixed.total + 16 * 1024, context_len=64, max_running_requests=4)
    storage = build_kv_storage(plan, sizing, "cpu")
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    assert [p.name for p in plan.sub_pools][:2] == ["draft_window64", "window16"]
    assert tree.slots == ["full", "window16", "draft_window64"]


# -- WIN-4: a window slot keeps the window's retained length ---------------------------------------------


def test_a_window_slot_keeps_each_windows_retained_length():
    """WIN-4: a node records, per window, where that window's retained rows begin: the tree holds,
    matches with and evicts exactly the rows each window still had, no more and no fewer."""
    storage = small_storage(windows=(32, 8), state=False, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    tokens = _tokens(40)
    node = cache_sequence(storage, tree, tokens, advance=True)
    retained = [(40 - 32) // ps, (40 - 8) // ps]  # first page each window still binds
    assert node.window_lo.tolist() == retained
    assert tree.held_pages() == {"window32": 20 - retained[0], "window8": 20 - retained[1], "full": 20}
    tree.verify()
    match = tree.match_prefix(tokens)
    assert match.length == 40 and match.window_lo.tolist() == retained
    freed = tree.evict_all()
    assert freed.pages == {"window32": 20 - retained[0], "window8": 20 - retained[1], "full": 20}


# -- WIN-5, WIN-6: eviction is a logical free ------------------------------------------------------------


def test_tree_eviction_is_a_logical_free():
    """WIN-5: evicted pages and state slots return as a free does: holes with nothing in flight,
    pending under a forward in flight, with no wait, no move and no device work."""
    storage, dev = modeled_storage(windows=(16,), state=True, chain_kib=48)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 16)
    bands = storage.allocator.bands
    keep, _ = request(storage, 8)  # keeps every band in use
    for in_flight in (False, True):
        base = 1000 * (1 + in_flight)
        row, _ = request(storage, 40)
        slot = storage.alloc_state_slots(1)
        n = 10
        res = tree.insert(_tokens(40, base), storage.table.page_table[row, :n].copy(), storage.table.window_lo[row],
                          int(slot[0]))
        assert res.state_taken
        storage.release_to_tree(row, n)
        storage.free_rows(np.array([row]))
        rec = None
        if in_flight:
            rec = launch_forward(storage, np.array([keep]), storage.alloc_extend(np.array([keep]), np.array([9])))
        before = {b.name: _counts(b) for b in bands}
        counters = (dev.counters.launches, dev.counters.stream_waits, dev.counters.host_waits)
        moves = storage.stats().moves
        freed = tree.evict_all()
        assert freed.pages == {"window16": 10, "full": 10, "state": 1}
        for b in bands:
            live, holes, pending = before[b.name]
            k = freed.pages[b.name]
            assert _counts(b) == ((live - k, holes, pending + k) if in_flight else (live - k, holes + k, pending))
        assert (dev.counters.launches, dev.counters.stream_waits, dev.counters.host_waits) == counters
        assert storage.stats().moves == moves
        if rec is not None:
            process(storage, rec)
            assert all(b.n_pending == 0 for b in bands)
    storage.free_rows(np.array([keep]))
    storage.check_idle(tree.held_pages())


def test_a_node_the_forward_in_flight_reads_may_be_evicted_and_pends_until_processed():
    """WIN-6: a prefix node the running forward reads is evicted once nothing locks it; its pages
    pend on that forward (never holes a take could reuse under it) until it is processed."""
    storage, dev = modeled_storage(windows=(16,), state=False, chain_kib=48)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    tokens = _tokens(40)
    cache_sequence(storage, tree, tokens)
    match = tree.match_prefix(tokens[:39])
    assert match.length == 36
    tree.lock(match.node)
    lock = tree.lock_window(match.node, match.length)
    row = storage.alloc_row()
    storage.assign_prefix(row, match.vpages, match.length, match.window_lo)
    vtok = storage.alloc_extend(np.array([row]), np.array([40]))
    read = storage.runner_ids(np.array([row])).page_tables  # what the forward reads
    rec = launch_forward(storage, np.array([row]), vtok)
    shared = {name: read[name][0, : match.length // ps].copy() for name in ("full", "window16")}
    # the request goes while its forward runs: nothing locks the prefix any more
    tree.unlock_window(lock)
    tree.unlock(match.node)
    storage.free_rows(np.array([row]))
    freed = tree.evict_all()
    assert freed.pages["full"] == 10 and freed.pages["window16"] == 10
    for name, pages in shared.items():
        band = storage.allocator.bands[storage.plan.by_name(name).index]
        assert (band.state[pages] == PENDING).all()
        assert [b.key for b in band.pending] == [rec.step]
    # a take while the forward runs gets none of the pages it reads without waiting for it
    waits = dev.counters.stream_waits
    other, _ = request(storage, 8)
    got = storage.allocator.owner.ids.v2p[storage.table.page_table[other, :2]]
    assert not np.isin(got, shared["full"]).any() or dev.counters.stream_waits > waits
    process(storage, rec)
    for name, pages in shared.items():
        band = storage.allocator.bands[storage.plan.by_name(name).index]
        assert not (band.state[pages] == PENDING).any()
        assert ((band.state[pages] == HOLE) | (band.ids.p2v[pages] >= 0)).all()
    storage.free_rows(np.array([other]))
    storage.check_idle(tree.held_pages())


# -- WIN-7, WIN-8: rehoming and binding window rows -------------------------------------------------------



def _tree_missing_window_rows(storage, *sequences):
    """A tree holding `sequences` whose window rows were evicted (each node locked, its window not),
    and a row that prefilled the first with its own pages: its insert rehomes them."""
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    nodes = [cache_sequence(storage, tree, tokens) for tokens in sequences]
    for node in nodes:
        tree.lock(node)
    assert tree.evict_all().pages == {"window16": sum(len(node.vpages) for node in nodes)}
    row, _ = request(storage, len(sequences[0]))
    return tree, nodes, row


def _named_by_tree(tree, node, w, lo):
    tree._account(node, -1)
    node.window_lo[w] = lo
    tree._account(node, 1)


def test_rehome_window_rebinds_rows_without_allocating():
    """WIN-7: an insert that revives the tree's evicted window rows from the inserter's duplicates
    moves their bindings onto the tree's pages: no page taken, freed or copied."""
    storage, dev = modeled_storage(windows=(16,), state=False, chain_kib=48)
    band = _window_band(storage)
    tokens = _tokens(40)
    tree, (node,), row = _tree_missing_window_rows(storage, tokens)
    n = len(node.vpages)
    mine = storage.table.page_table[row, :n].copy()
    physical = band.ids.v2p[mine].copy()
    before = _untouched_but_ids(storage)
    launches = dev.counters.launches
    result = tree.insert(tokens, mine, storage.table.window_lo[row], -1)
    _same(before, _untouched_but_ids(storage))
    assert dev.counters.launches == launches
    assert np.array_equal(band.ids.v2p[node.vpages], physical) and (band.ids.v2p[mine] < 0).all()
    assert node.window_lo.tolist() == [0]
    storage.release_to_tree(row, n, result.duplicates)
    storage.free_rows(np.array([row]))
    tree.unlock(node)
    tree.verify()
    storage.check_idle(tree.held_pages())


def test_bind_window_names_loaded_rows_without_allocating():
    """WIN-7: binding a load's reserved window pages to owner pages takes and frees nothing."""
    storage, dev = modeled_storage(windows=(16,), state=False, chain_kib=48)
    band = _window_band(storage)
    tree, (node,), row = _tree_missing_window_rows(storage, _tokens(40))
    storage.free_rows(np.array([row]))
    pages, reservation = storage.alloc_load("window16", 4)
    vpages = node.vpages[-4:]
    before = _untouched_but_ids(storage)
    fixed, launches = band.n_fixed, dev.counters.launches
    storage.bind_window("window16", vpages, pages)
    _same(before, _untouched_but_ids(storage))
    assert band.n_fixed == fixed and dev.counters.launches == launches
    assert np.array_equal(band.ids.v2p[vpages], pages)
    storage.end_load_reservations("window16", reservation)
    _named_by_tree(tree, node, 0, len(node.vpages) - 4)
    tree.verify()
    tree.unlock(node)
    storage.check_idle(tree.held_pages())


def _forward(storage, rows, vtok):
    """Upload the rows' page tables on the schedule stream, then a forward that reads them and the
    window pages they name, ending its shared reads before its writes."""
    dev = storage.device
    band = _window_band(storage)
    runner = storage.runner_ids(rows)
    meta = PageAccess(META_BAND, np.arange(len(rows)))
    dev.launch(dev.schedule_stream, None, writes=(meta,), label="upload")
    storage.order_forward_after_schedule()
    record = storage.forward_launched()
    pages = np.unique(runner.page_tables[band.name])
    dev.launch(dev.forward_stream, None, reads=(meta, PageAccess(band.index, pages)), label="forward:read")
    shared = dev.record(dev.forward_stream, "shared_read_done")
    dev.launch(dev.forward_stream, None, label="forward:write")
    storage.record_forward(record, dev.record(dev.forward_stream, "done"), storage.iteration_ids(vtok, rows),
                           shared_read_done=shared)
    return record, shared


def test_rehome_and_bind_are_ordered_by_the_war_barrier():
    """WIN-8: with a forward in flight that reads the rows and the barrier applied, `rehome_window`
    and `bind_window` put no work on the device outside the schedule stream or ahead of the barrier
    and block no host; the next upload of the rebound ids follows the running forward's shared
    reads, so no access goes unordered."""
    storage, dev = modeled_storage(windows=(16,), state=False, chain_kib=48)
    first, second = _tokens(40), _tokens(40, 500)
    tree, (node, loaded), row = _tree_missing_window_rows(storage, first, second)
    mine = storage.table.page_table[row, : len(node.vpages)].copy()
    load_pages, reservation = storage.alloc_load("window16", 2)
    other, _ = request(storage, 8)
    rows = np.array([row, other])
    rec, shared = _forward(storage, rows, storage.alloc_extend(rows, np.array([41, 9])))
    storage.apply_war_barrier()
    seen, host = len(dev.history), dev.counters.host_waits
    tree.insert(first, mine, storage.table.window_lo[row], -1)  # rehomes the row's window pages
    assert node.window_lo.tolist() == [0]
    storage.bind_window("window16", loaded.vpages[-2:], load_pages)
    storage.end_load_reservations("window16", reservation)
    assert dev.counters.host_waits == host
    for item in dev.history[seen:]:
        assert item.stream == "schedule" and clock_leq(shared.clock, item.clock), item.label
    _forward(storage, np.array([other]), storage.alloc_extend(np.array([other]), np.array([10])))
    problems = OverlapTracker(Granules(storage.arena.layout, meta_rows=8)).consume(dev.history)
    assert not problems, problems
    assert not rec.processed


# -- WIN-11, WIN-12: the retention floor ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 120), interval_pages=st.integers(1, 12), chunked=st.booleans())
def test_retirement_never_frees_past_the_window_behind_the_latest_checkpoint(length, interval_pages, chunked):
    """WIN-11: with the tree's floor (`swa_retain_floor`, the latest grid point) as the checkpoint,
    `advance` keeps every window's rows from `floor - window` on, and retires what lies before
    both that point and the window."""
    storage = small_storage(windows=(32, 8), state=True, chain_kib=64, chunked=chunked)
    ps = storage.page_size
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, interval_pages * ps)
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([length]))
    floor = tree.swa_retain_floor(length)
    assert floor == length // (interval_pages * ps) * (interval_pages * ps)
    storage.advance(np.array([row]), np.array([floor]))
    vpages = storage.table.page_table[row, : -(-length // ps)]
    for k, band in enumerate(storage.allocator.window_bands):
        w = band.pool.window
        reads_from = length // w * w if chunked else max(length - w, 0)
        kept_from = min(max(floor - w, 0), reads_from) // ps
        kept_from = min(kept_from, (length - 1) // ps)
        bound = band.ids.v2p[vpages] >= 0
        assert bound[kept_from:].all() and not bound[:kept_from].any(), (band.name, floor, kept_from)
        assert storage.table.window_lo[row, k] == kept_from


def test_the_floor_holds_back_retirement_that_would_otherwise_happen():
    """WIN-11: at 40 tokens with checkpoints every 16 the floor is 32, so an 8-token window keeps
    rows from 24 instead of 32; with the next checkpoint the floor moves on."""
    storage = small_storage(windows=(8,), state=True, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 16)
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([46]))
    storage.advance(np.array([row]), np.array([tree.swa_retain_floor(46)]))
    assert storage.table.window_lo[row, 0] == 24 // 2
    storage.alloc_extend(np.array([row]), np.array([50]))
    storage.advance(np.array([row]), np.array([tree.swa_retain_floor(50)]))
    assert storage.table.window_lo[row, 0] == 40 // 2


def _run_prefill(pool, req, steps):
    """Admit `req` with a first chunk of one interval, then grow it by each of `steps`, calling
    `processed` after each forward; returns the row's first window page after each."""
    ctx = pool.begin_pass([], frees_coming=False)
    assert pool.try_admit(ctx, req, pool.checkpoint_interval or 16).decision is Decision.ADMIT
    pool.processed([req])
    out = [int(pool.storage.table.window_lo[req.row, 0])]
    for n in steps:
        pool.extend([req], [req.computed + n])
        req.computed += n
        pool.processed([req])
        out.append(int(pool.storage.table.window_lo[req.row, 0]))
    return out


def test_the_floor_applies_only_when_the_cache_shares_prefixes():
    """WIN-12: without prefix sharing no floor applies: `swa_retain_floor` gives none, the pool
    retires each window eagerly and admission prices the window alone; with sharing, all three
    keep the window behind the checkpoint."""
    storage = small_storage(windows=(8,), state=True)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 16)
    assert tree.swa_retain_floor(40, shares_prefixes=False) is None
    assert tree.swa_retain_floor(40, shares_prefixes=True) == 32
    assert retained_window(8, 16, shares_prefixes=False) == 8
    assert retained_window(8, 16, shares_prefixes=True) == 24
    plan = storage.plan
    alone = request_demand(plan, DemandPurpose.CEILING, input_len=200, checkpoint_interval=16)
    shared = request_demand(plan, DemandPurpose.CEILING, input_len=200, checkpoint_interval=16,
                            shares_prefixes=True)
    bare = request_demand(plan, DemandPurpose.CEILING, input_len=200)
    window = plan.windows[0].index
    assert alone.pages[window] == bare.pages[window] < shared.pages[window]
    steps = [4, 8, 4, 12]  # lengths 16, 20, 28, 32, 44
    ps = 4
    eager = _run_prefill(world(chain_kib=64, window=8, interval=16, prefix_cache=False),
                         ScheduledRequest(0, 0, _tokens(64), 4, 4), steps)
    assert eager == [(n - 8) // ps for n in (16, 20, 28, 32, 44)]
    held = _run_prefill(world(chain_kib=64, window=8, interval=16), ScheduledRequest(0, 0, _tokens(64), 4, 4), steps)
    assert held == [(g - 8) // ps for g in (16, 16, 16, 32, 32)]


# -- WIN-14: a prefill frees window rows only at checkpoints --------------------------------------------


def _counting_advance(storage):
    """Record what each `advance` frees."""
    freed = []
    advance = storage.advance

    def counting(rows, checkpoints=None):
        freed.append(advance(rows, checkpoints))
        return freed[-1]

    storage.advance = counting
    return freed


def test_with_sharing_a_prefill_moves_its_window_only_when_the_tree_takes_a_checkpoint():
    """WIN-14: with prefix sharing, over prefill chunks that reach the grid or not, a row's window
    retirement point moves only in the steps where `checkpoint_into_tree` hands the tree a
    checkpoint, and then to the window behind it; other steps free no window row."""
    pool = world(chain_kib=64, window=8, interval=16)
    storage = pool.storage
    freed = _counting_advance(storage)
    req = ScheduledRequest(0, 0, _tokens(96), 4, 4)
    los = _run_prefill(pool, req, [])
    taken = [pool.stats_counters["checkpoints"]]
    for n in [4, 6, 6, 4, 10, 2, 16, 8]:  # lengths 20, 26, 32, 36, 46, 48, 64, 72
        before = pool.stats_counters["checkpoints"]
        los += _continue(pool, req, n)
        taken.append(pool.stats_counters["checkpoints"] - before)
        assert req.prefilling
    assert taken == [1, 0, 0, 1, 0, 0, 1, 1, 0]
    assert [i for i in range(1, len(los)) if los[i] != los[i - 1]] == [3, 6, 7]
    assert all(f == 0 for f, t in zip(freed, taken) if not t)
    assert los[-1] == (64 - 8) // storage.page_size


def test_a_stalled_checkpoint_is_abandoned_so_the_window_stays_within_its_price():
    """WIN-14 as the retention-bound decision amends it (docs/admission.md): a checkpoint the tree
    cannot take (no state slot, no room) is abandoned, not waited for: the floor moves to the grid
    point anyway, so the row keeps no more window rows than admission priced."""
    pool = world(chain_kib=64, window=8, interval=16)
    storage = pool.storage
    req = ScheduledRequest(0, 0, _tokens(96), 4, 4)
    ctx = pool.begin_pass([], frees_coming=False)
    assert pool.try_admit(ctx, req, 16).decision is Decision.ADMIT

    def exhausted(n):
        raise CapacityError("no state slot")

    storage.alloc_state_slots = exhausted  # no slot to take the checkpoint with, nor room for one
    pool._make_room = lambda pages: False
    freed = _counting_advance(storage)
    lo = int(storage.table.window_lo[req.row, 0])
    pool.processed([req])
    assert pool.stats_counters["checkpoints"] == 0 and pool.stats_counters["checkpoint_stalls"] == 1
    assert freed[0] > 0 and storage.table.window_lo[req.row, 0] > lo


def _continue(pool, req, n):
    pool.extend([req], [req.computed + n])
    req.computed += n
    pool.processed([req])
    return [int(pool.storage.table.window_lo[req.row, 0])]


# -- WIN-15, WIN-16: chunks on the checkpoint grid ------------------------------------------------------


def test_a_chunk_shorter_than_the_grid_tracks_no_checkpoint():
    """WIN-15: a budget short of the next grid point cuts no chunk (the request waits rather than
    prefill a chunk that tracks none), and a short step that reaches no grid point hands the tree
    no checkpoint."""
    assert mamba_prefill_chunk_grid(16, 15, 100, 16) == 0
    assert mamba_prefill_chunk_grid(0, 10, 100, 16) == 0
    pool = world(chain_kib=64, window=8, interval=16)
    req = ScheduledRequest(0, 0, _tokens(64), 4, 4)
    ctx = pool.begin_pass([], frees_coming=False)
    a = pool.try_admit(ctx, req, 12)
    assert a.decision is Decision.WAIT and req.row < 0
    assert pool.next_chunk(ScheduledRequest(1, 0, _tokens(64), 4, 4), 15) == 0
    _run_prefill(pool, req, [])
    nodes = sum(1 for _ in pool.tree._nodes())
    before = dict(pool.stats_counters)
    _continue(pool, req, 12)  # 16 -> 28: no grid point reached
    assert pool.stats_counters == before and sum(1 for _ in pool.tree._nodes()) == nodes
    assert req.pool_state["checkpoint"] == 16


@settings(max_examples=300, deadline=None)
@given(start_cells=st.integers(0, 8), limit=st.integers(1, 200), extra=st.integers(1, 300),
       interval=st.sampled_from([4, 16, 64]))
def test_every_chunk_but_a_prompts_last_ends_on_the_grid(start_cells, limit, extra, interval):
    """WIN-16: `mamba_prefill_chunk_grid` cuts a chunk that ends on the checkpoint grid unless it
    ends the prompt, and the longest such chunk the limit allows."""
    start = start_cells * interval
    prompt = start + extra
    chunk = mamba_prefill_chunk_grid(start, limit, prompt, interval)
    assert 0 <= chunk <= limit
    end = start + chunk
    if end == prompt:
        assert extra <= limit
    else:
        assert extra > limit and end % interval == 0
        assert end + interval > start + limit  # the next grid point is past the limit
    assert mamba_prefill_chunk_grid(start, limit, prompt, None) == min(limit, extra)
