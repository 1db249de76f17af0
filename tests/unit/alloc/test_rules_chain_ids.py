"""Ids and capacity decisions, rule by rule: virtual and physical ids per sub-pool, their
translation for writers, readers and kernels, and how capacity is asked and estimated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain import capacity
from kvchain.alloc import chain as chain_module
from kvchain.alloc.demand import KVDemand
from kvchain.alloc.id_space import UnitIds
from kvchain.alloc.pricing import ChainSnapshot, first_plan
from kvchain.errors import CapacityError, InvariantError
from support.chains import Payloads, admit_random, finish_random, grow_random, small_storage
from support.modeled import launch_forward, modeled_storage, process, request
from support.tree import patched


def _physical_tokens(band, vtok, ps):
    return band.ids.read_map[vtok // ps] * ps + vtok % ps


def _churned(seed=0, steps=120, each=None):
    """A storage after random admissions, growth, window retirement, finishes and reliefs;
    `each(storage, rows)` runs after every step."""
    storage = small_storage(page_size=2, chain_kib=10, windows=(16, 8), rows=16, context=96)
    payloads = Payloads(storage)
    rng = np.random.default_rng(seed)
    rows: list[int] = []
    for _ in range(steps):
        action = rng.integers(4)
        try:
            if action == 0:
                admit_random(storage, rng, rows, 30, payloads)
            elif action == 1 and rows:
                grow_random(storage, rng, rows, 16, payloads)
            elif action == 2 and rows:
                storage.advance(np.array(rows))
            elif rows:
                finish_random(storage, rng, rows)
        except CapacityError:
            pass
        if each is not None:
            each(storage, rows)
    return storage, rows, payloads


# -- ids ---------------------------------------------------------------------------------------


def test_tokens_have_a_virtual_id_in_the_table_and_a_physical_id_per_sub_pool():
    """IDS-1: `req_to_token` holds the virtual ids a take returned; each sub-pool's physical id for
    a token is its own page's, and after a move the virtual ids stay while the physical ones follow."""
    storage = small_storage(page_size=2, chain_kib=16)
    ps = storage.page_size
    rows = [storage.alloc_row() for _ in range(3)]
    vtok = storage.alloc_extend(np.array(rows), np.array([6, 6, 6]))
    last = vtok[:6]  # the first row's pages lie at the owner's frontier
    assert np.array_equal(storage.table.req_to_token(np.array([rows[0]]))[0], last)
    storage.free_rows(np.array(rows[1:]))
    owner = storage.allocator.owner
    before = storage.iteration_ids(last).locs[owner.name].copy()
    assert storage.allocator.relief_flush(owner) > 0
    assert np.array_equal(storage.table.req_to_token(np.array([rows[0]]))[0], last)
    ids = storage.iteration_ids(last)
    assert not np.array_equal(ids.locs[owner.name], before)
    for band in storage.allocator.token_bands:
        assert np.array_equal(ids.locs[band.name], _physical_tokens(band, last, ps))
    assert not np.array_equal(ids.locs[owner.name], last)


@pytest.mark.parametrize("seed", [0, 1])
def test_window_bands_bind_owner_virtual_pages_and_never_mint_their_own(seed):
    """IDS-2, IDS-3: after every step of a churn, every virtual page a window band binds is one the
    owner minted and binds, and every virtual page in use came from the owner's id space (the null
    page 0 never)."""
    windows_bound = []

    def check(storage, rows):
        chain = storage.allocator
        owner = chain.owner
        owner_bound = np.flatnonzero(owner.ids.v2p[:-1] >= 0)
        assert len(owner_bound) + len(chain.virtual_free) == chain.n_virtual - 1
        assert 0 not in owner_bound and owner.ids.n_virtual == chain.n_virtual
        for band in chain.window_bands:
            assert band.ids.n_virtual == chain.n_virtual
            bound = np.flatnonzero(band.ids.v2p[:-1] >= 0)
            windows_bound.append(len(bound))
            assert set(bound.tolist()) <= set(owner_bound.tolist()), band.name
        in_table = storage.table.own_pages(np.array(rows, dtype=np.int64))
        assert set(in_table.tolist()) == set(owner_bound.tolist())

    _storage, _rows, payloads = _churned(seed, each=check)
    assert max(windows_bound) > 0
    payloads.check()


def test_a_page_a_window_has_not_bound_reads_the_sink():
    """IDS-4: after a window retires a long row's early pages, and for the null page, reads of
    those virtual pages in that window resolve to its sink, in `RunnerIds` and `IterationIds`."""
    storage = small_storage(page_size=2, chain_kib=16, windows=(32, 8))
    chain = storage.allocator
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([40]))
    storage.advance(np.array([row]))
    short = chain.window_bands[-1]
    sink = short.grid.sink_id
    vpages = storage.table.pages_of(row)
    retired = vpages[short.ids.v2p[vpages] < 0]
    assert len(retired) and sink is not None
    table = storage.runner_ids(np.array([row])).page_tables[short.name][0]
    assert (table[: len(retired)] == sink).all() and (table[len(retired) :] != sink).all()
    locs = storage.iteration_ids(np.concatenate([retired, [0]]) * storage.page_size).locs[short.name]
    assert (locs // storage.page_size == sink).all()
    assert short.translate(np.array([0]))[0] == sink


def test_state_slots_come_from_their_own_id_space():
    """IDS-5: state slots are drawn from the state band's slot ids, sized by its grid; taking slots
    spends no virtual token id, and taking token pages for a row with a slot spends no slot id."""
    storage = small_storage(page_size=2, chain_kib=16)
    chain = storage.allocator
    state = chain.state_band
    assert state.ids.n_virtual == state.grid.n_grid != chain.n_virtual
    vfree, sfree = len(chain.virtual_free), len(chain.slot_free)
    slots = storage.alloc_state_slots(3)
    assert len(chain.virtual_free) == vfree and len(chain.slot_free) == sfree - 3
    assert (slots >= 0).all() and (slots < state.grid.n_grid).all()
    assert (state.ids.v2p[slots] >= 0).all()
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([4]))
    sfree = len(chain.slot_free)
    storage.alloc_extend(np.array([row]), np.array([12]))
    assert len(chain.slot_free) == sfree and len(chain.virtual_free) < vfree
    storage.free_state_slots(slots)
    storage.free_rows(np.array([row]))
    storage.check_idle()


def test_each_band_maps_ids_through_its_own_unit_ids():
    """IDS-6: every band keeps its map in a `UnitIds`, and the translation a forward uses is that
    map: after takes, moves and window retirement, each sub-pool's translated ids are what its
    `UnitIds` gives."""
    storage, rows, _ = _churned(2)
    chain = storage.allocator
    assert all(isinstance(b.ids, UnitIds) for b in chain.bands)
    vtok = storage.table.req_to_token(np.array(rows)).ravel() if rows else np.empty(0, np.int64)
    vtok = vtok[vtok >= storage.page_size]
    ids = storage.iteration_ids(vtok, np.array(rows))
    for band in chain.token_bands:
        assert np.array_equal(ids.locs[band.name], _physical_tokens(band, vtok, storage.page_size))
    slots = storage.table.state_slot[np.array(rows)]
    assert np.array_equal(ids.state_slots, chain.state_band.ids.read_map[slots])


def test_iteration_ids_translate_writes_for_every_sub_pool_at_once():
    """IDS-8: one `IterationIds` for an iteration's written tokens carries, for every token
    sub-pool, that sub-pool's physical token ids, and the rows' physical state slots."""
    storage, rows, _ = _churned(3)
    chain = storage.allocator
    rows = np.array(rows)
    vtok = storage.alloc_decode(rows)
    ids = storage.iteration_ids(vtok, rows)
    assert set(ids.locs) == {b.name for b in chain.token_bands}
    for band in chain.token_bands:
        assert np.array_equal(ids.locs[band.name], _physical_tokens(band, vtok, storage.page_size))
    state = chain.state_band
    assert np.array_equal(ids.state_slots, state.ids.v2p[storage.table.state_slot[rows]])
    tensors = ids.to("cpu")
    assert all(torch.equal(tensors[n], torch.from_numpy(ids.locs[n])) for n in ids.locs)


def test_runner_ids_translate_reads_once_into_physical_page_tables():
    """IDS-9: `RunnerIds` gives, per token sub-pool, a physical page table over each row's virtual
    pages (unbound pages read the sink), and each row's physical state slot."""
    storage, rows, payloads = _churned(4)
    chain = storage.allocator
    rows = np.array(rows)
    runner = storage.runner_ids(rows)
    n_pages = runner.page_tables[chain.owner.name].shape[1]
    vpages = storage.table.page_table[rows, :n_pages]
    for band in chain.token_bands:
        want = np.where(band.ids.v2p[vpages] >= 0, band.ids.v2p[vpages], band.grid.sink_id)
        assert np.array_equal(runner.page_tables[band.name], want), band.name
    assert np.array_equal(runner.state_slots, chain.state_band.ids.v2p[storage.table.state_slot[rows]])
    payloads.check()


def test_the_page_copy_kernel_is_given_physical_ids():
    """IDS-10: the copy kernel indexes the physical ids it is given, never a band's id maps: with
    virtual id 5 bound to physical page 7, copying page 7 to page 9 copies page 7's bytes."""
    storage = small_storage(page_size=2, chain_kib=16)
    chain = storage.allocator
    owner = chain.owner
    words = storage.arena.page_words_view(owner.index)
    pages = storage.allocator.take_from(owner, 12)
    owner.bind(np.arange(1, 13), pages)
    src, dst = pages[6], pages[8]
    words[torch.from_numpy(pages)] = torch.arange(12, dtype=words.dtype)[:, None]
    chain.copier.move_pages(owner, np.array([src]), np.array([dst]))
    assert (words[int(dst)] == 6).all() and (words[int(pages[5])] == 5).all()


# -- capacity ----------------------------------------------------------------------------------


def _pinned_float():
    """A window float fixed in the middle of the arena (a host-tier load's reservation), with the
    owner short of room above it though the free bytes in all would hold far more."""
    storage = small_storage(page_size=2, chain_kib=16)
    chain = storage.allocator
    window = chain.bands[2]
    storage.alloc_load(window.name, 2)
    rows = [storage.alloc_row() for _ in range(2)]
    storage.alloc_extend(np.array(rows), np.array([10, 10]))
    owner = chain.owner
    prev_top, _ = chain.neighbour_bounds(owner.index)
    room = (owner.bottom - prev_top) // owner.page_bytes
    estimate = chain.estimated_units_available(owner) // owner.pool.units_per_page
    assert estimate > room + 10
    demand = [0] * len(chain.bands)
    demand[owner.index] = room + 10
    return storage, chain, demand, rows


def test_capacity_asks_whether_the_demand_fits_not_a_free_count():
    """CAP-1: the free-byte estimate says the owner could take the pages, but a float pinned in
    the middle leaves no layout for them: every decision says no and the take is refused."""
    _storage, chain, demand, _rows = _pinned_float()
    assert not chain.units_fit(demand)
    assert not chain.admits(KVDemand(tuple(demand), demand[chain.owner.index], 0))
    assert not chain.fits_after_frees(demand, [0] * len(demand))
    assert not chain.ensure_capacity(demand)
    with pytest.raises(CapacityError):
        chain.take(demand)


def test_evict_until_fits_combines_the_cache_walk_with_the_allocators_answer():
    """CAP-2: `capacity.evict_until_fits` lets the cache walk its victims, asks the allocator
    (`fits_after_frees`) after each, frees exactly the victims up to the first yes, and answers
    what the allocator answers then; a walk that never reaches a yes frees nothing."""
    storage, chain, demand, rows = _pinned_float()
    more = [storage.alloc_row() for _ in range(3)]
    storage.alloc_extend(np.array(more), np.array([30, 30, 30]))
    owner = chain.owner
    demand[owner.index] = (owner.bottom - chain.neighbour_bounds(owner.index)[0]) // owner.page_bytes + 18
    names = [p.name for p in storage.plan.sub_pools]

    class Tree:
        """Victims are whole rows, walked in order; nothing is freed unless the walk says yes."""

        def __init__(self, victims):
            self.victims, self.freed = victims, []

        def evict(self, wanted):
            freed = dict.fromkeys(names, 0)
            for k, row in enumerate(self.victims):
                for name, n in held_by(row).items():
                    freed[name] += n
                if wanted(freed):
                    self.freed = self.victims[: k + 1]
                    storage.free_rows(np.array(self.freed))
                    return

    def held_by(row):
        """Live pages per sub-pool one row holds."""
        pages = storage.table.pages_of(row)
        return {b.name: 1 if b is chain.state_band else int(np.count_nonzero(b.ids.v2p[pages] >= 0))
                for b in chain.bands}

    tree = Tree([more[0], rows[0], more[1], more[2], rows[1]])
    need = next(k for k in range(1, 6) if chain.fits_after_frees(demand, [
        sum(held_by(r)[n] for r in tree.victims[:k]) for n in names]))
    assert need >= 2 and not chain.units_fit(demand)
    assert capacity.evict_until_fits(storage, tree, demand)
    assert tree.freed == tree.victims[:need]
    chain.take(demand)
    huge = [0] * len(chain.bands)
    huge[chain.owner.index] = 10**6
    live = [b.n_live for b in chain.bands]
    assert not capacity.evict_until_fits(storage, Tree(list(tree.victims[need:])), huge)
    assert [b.n_live for b in chain.bands] == live


def test_each_capacity_question_is_one_layout_search_on_a_host_snapshot():
    """CAP-3: `units_fit`, `admits` and `fits_after_frees` each run `feasible` once, on a
    `ChainSnapshot` of host integers, for the joint demand: two bands that each fit alone but not
    together are refused."""
    storage = small_storage(page_size=2, chain_kib=8)
    chain = storage.allocator
    state, owner = chain.state_band, chain.owner
    calls = []

    def spy(original):
        def feasible(snapshot, demand):
            calls.append((snapshot, tuple(demand)))
            return original(snapshot, demand)
        return feasible

    def alone(band):
        d = [0] * len(chain.bands)
        k = 0
        while chain.units_fit([*d[:band.index], k + 1, *d[band.index + 1:]]):
            k += 1
        return k

    a, b = alone(state), alone(owner)
    joint = [0] * len(chain.bands)
    joint[state.index], joint[owner.index] = a, b
    with patched(chain_module, "feasible", spy):
        assert not chain.units_fit(joint)
        assert not chain.admits(KVDemand(tuple(joint), b, 0))
        assert not chain.fits_after_frees(joint, [0] * len(joint))
    assert len(calls) == 3 and all(d == tuple(joint) for _, d in calls)
    for snap, _ in calls:
        assert isinstance(snap, ChainSnapshot)
        for band in snap.bands:
            assert all(isinstance(v, (int, bool)) for v in band[6:])


def test_pricing_never_synchronizes_with_the_device():
    """CAP-5: with forwards in flight and pages pending, every capacity question and the plan
    search run without a host wait, a stream wait, an event query or a launch."""
    storage, dev = modeled_storage(chain_kib=4)
    chain = storage.allocator
    rows = [request(storage, 8) for _ in range(3)]
    f1 = launch_forward(storage, np.array([rows[0][0]]), rows[0][1])
    storage.free_rows(np.array([rows[1][0]]))
    f2 = launch_forward(storage, np.array([rows[2][0]]), rows[2][1])
    touched = []

    def spy(name):
        def wrap(original):
            def fn(*args, **kwargs):
                touched.append(name)
                return original(*args, **kwargs)
            return fn
        return wrap

    demands = [[0, 0, k] for k in (1, 5, 20, 40)] + [[2, 2, 2], [0, 3, 0]]
    with patched(dev, "host_wait", spy("host_wait")), patched(dev, "stream_wait", spy("stream_wait")), \
            patched(dev, "query", spy("query")), patched(dev, "launch", spy("launch")), \
            patched(dev, "synchronize", spy("synchronize")):
        for d in demands:
            chain.units_fit(d)
            chain.in_place(d)
            chain.admits(KVDemand(tuple(d), d[-1], 0))
            chain.fits_after_frees(d, [0, 1, 2])
            first_plan(chain.pricing_snapshot(), d)
        chain.max_new_tokens_for_memory(16, 64)
    assert touched == []
    assert chain.pricing_snapshot().bands[chain.owner.index].pending == 2
    process(storage, f1)
    process(storage, f2)


def test_availability_estimates_count_free_bytes_and_ids_ignoring_pending_and_fixed_pages():
    """CAP-12: each estimate is free bytes (gaps plus holes and pending pages) over the band's page
    bytes, capped by free owner ids for the owner, in units; a page that pends counts as a hole
    does, and a fixed float is counted as if it could move."""
    storage, _dev = modeled_storage(chain_kib=4)
    chain = storage.allocator
    rows = [request(storage, 8)[0] for _ in range(3)]

    def want(band):
        gaps = chain.layout.chain_bytes - sum(b.span * b.page_bytes for b in chain.bands)
        free = gaps + sum((b.n_holes + b.n_pending) * b.page_bytes for b in chain.bands)
        pages = free // band.page_bytes
        if band is chain.owner:
            pages = min(pages, len(chain.virtual_free))
        return pages * band.pool.units_per_page

    def check():
        for band in chain.bands:
            assert chain.estimated_units_available(band) == want(band), band.name
        assert chain.available_size() == chain.full_available_size() == want(chain.owner)
        assert chain.window_available_size() == {b.name: want(b) for b in chain.window_bands}
        live = sum(b.n_live * b.page_bytes for b in chain.bands)
        assert chain.usage() == pytest.approx(live / chain.layout.chain_bytes)

    check()
    rec = launch_forward(storage, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    storage.free_rows(np.array([rows[1]]))
    assert chain.owner.n_pending
    pending_estimate = chain.available_size()
    check()
    process(storage, rec)
    assert chain.owner.n_pending == 0 and chain.available_size() == pending_estimate
    check()
    _ids, reservation = storage.alloc_load(chain.window_bands[0].name, 1)
    check()
    storage.end_load_reservations(chain.window_bands[0].name, reservation)


def test_live_unit_counts_are_exact_so_leak_checks_are_exact():
    """CAP-14: after a churn each band's live count equals its live pages and what the rows hold;
    one page taken and never bound is caught in exactly that band, and freeing it clears it."""
    storage, _rows, _ = _churned(5)
    chain = storage.allocator
    expected = storage.expected_live_pages()
    for band in chain.bands:
        assert band.n_live == len(band.live_pages()) == expected[band.name], band.name
    storage.check_idle()
    window = chain.window_bands[-1]
    leaked = storage.allocator.take_from(window, 1)
    with pytest.raises(InvariantError, match="idle_leak") as err:
        storage.check_idle()
    message = str(err.value)
    assert f"{window.name}: {expected[window.name] + 1} live pages" in message
    assert all(b.name not in message for b in chain.bands if b is not window)
    window.ids.bind(np.array([chain.n_virtual - 1]), leaked)
    storage.allocator.free(window, leaked)
    storage.check_idle()
