"""Construction and the split of work around the pool: plan, size, build; one allocator over every
band; the prefix cache picks eviction victims and the allocator only answers yes or no."""

from __future__ import annotations

import numpy as np
import torch

from kvchain.alloc.band import Band
from kvchain.alloc.chain import ChainAllocator
from kvchain.build import build_kv_storage
from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from kvchain.capacity import evict_until_fits
from kvchain.errors import CapacityError
from kvchain.layout.views import SubPoolView
from kvchain.memory.arena import KVArena
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.requests import RequestTable
from kvchain.routed_cache import RoutedKVCache
from kvchain.sizing import size_plan
from kvchain.storage import KVStorage
from support.chains import hybrid_decls, small_storage
from support.simworld import workload, world
from support.tree import cache_sequence

# -- construction -----------------------------------------------------------------------------------


def _plan_size_build(budget_kib=24, rows=8, context=128):
    plan = plan_kv_storage(hybrid_decls(), page_size=2)
    probe = size_plan(plan, 64 * 2**20, context_len=context, max_running_requests=rows, state_slots=rows)
    sizing = size_plan(plan, probe.fixed.total + budget_kib * 1024, context_len=context,
                       max_running_requests=rows, state_slots=rows)
    return plan, sizing, build_kv_storage(plan, sizing, "cpu")


def test_build_allocates_what_sizing_budgeted():
    """DECL-15: build runs on the sized plan: the arena is the size the sizing solved for, fixed
    allocations and arena stay within the budget, the request table has the sized rows and
    context, and every boot target fits the built chain at once."""
    plan, sizing, storage = _plan_size_build()
    assert storage.plan is plan and storage.sizing is sizing
    assert storage.arena.nbytes == sizing.arena_bytes
    assert sizing.fixed.total + storage.arena.nbytes <= sizing.budget_bytes
    assert storage.table.rows == sizing.max_running_requests + 1
    assert storage.table.context_len == sizing.context_len
    boot = tuple(sizing.target(p.name).pages for p in plan.sub_pools)
    assert all(boot)
    assert storage.allocator.units_fit(boot)
    taken = storage.allocator.take(boot)
    assert [len(t) for t in taken] == list(boot)


def test_build_returns_one_kvstorage_with_every_part():
    """DECL-16: `build_kv_storage` returns a KVStorage holding the uint8 arena, one view per
    sub-pool over the arena's bytes, a RoutedKVCache routing each layer to its token view, one
    ChainAllocator over that arena, and the RequestTable."""
    plan, sizing, storage = _plan_size_build()
    assert type(storage) is KVStorage
    arena = storage.arena
    assert isinstance(arena, KVArena) and arena.data.dtype == torch.uint8
    assert sorted(storage.views) == sorted(p.name for p in plan.sub_pools)
    lo, hi = arena.data.data_ptr(), arena.data.data_ptr() + arena.nbytes
    for pool in plan.sub_pools:
        view = storage.view(pool.name)
        assert isinstance(view, SubPoolView) and view.pool is pool
        ptr = view.pages.data_ptr()
        assert lo <= ptr and ptr + view.pages.numel() <= hi, f"{pool.name}: view outside the arena"
    assert isinstance(storage.routed, RoutedKVCache)
    for pool in plan.sub_pools:
        for layer in pool.layer_ids:
            route = storage.routed.route(layer)
            if pool.kind is PoolKind.STATE:
                assert route.state == pool.name
            else:
                assert route.attention == pool.name
                assert storage.routed.views[route.attention] is storage.view(pool.name)
    assert isinstance(storage.allocator, ChainAllocator)
    assert storage.allocator.arena is arena and storage.allocator.plan is plan
    assert isinstance(storage.table, RequestTable)
    assert storage.table.rows == sizing.max_running_requests + 1


def test_every_sub_pool_may_take_bytes_beyond_its_boot_target():
    """DECL-14: the sized targets are boot targets only: on an empty arena each sub-pool alone
    takes more pages than its target (nearly all of the chain's bytes), and state slots beyond
    the sized count are handed out."""
    n_bands = len(small_storage().allocator.bands)
    for i in range(n_bands):
        storage = small_storage()
        chain = storage.allocator
        band = chain.bands[i]
        target = storage.sizing.target(band.name).pages

        def alone(n, i=i):
            demand = [0] * n_bands
            demand[i] = n
            return demand

        most = 0
        while chain.units_fit(alone(most + 1)):
            most += 1
        assert most > target, f"{band.name}: at most {most} pages against a boot target of {target}"
        assert most * band.page_bytes > 0.9 * chain.layout.chain_bytes, (band.name, most)
        assert len(chain.take(alone(most))[i]) == most
    storage = small_storage()
    extra = storage.sizing.state_slots * 4
    assert len(storage.alloc_state_slots(extra)) == extra


# -- one allocator, one interface ----------------------------------------------------------------------


# `_plan_and_take` is the body of every take: `take` checks the demand and calls it, and the
# allocator's own fixed-shape demands call it directly
_ALLOCATOR_CHANGES = ((ChainAllocator, "_plan_and_take"), (Band, "hand_out"), (Band, "bind"), (Band, "free"),
              (ChainAllocator, "free_virtual"))


class _Watch:
    """Counts calls to KVStorage's public methods in progress and records the allocator mutations
    made while none is."""

    def __init__(self, monkeypatch) -> None:
        self.depth = 0
        self.take_depth = 0
        self.outside: list[str] = []
        self.acquired_outside_take: list[str] = []
        for name, fn in list(vars(KVStorage).items()):
            if callable(fn) and not name.startswith("_"):
                monkeypatch.setattr(KVStorage, name, self._interface(fn))
        for cls, name in _ALLOCATOR_CHANGES:
            monkeypatch.setattr(cls, name, self._mutation(getattr(cls, name), name))

    def _interface(self, fn):
        def wrapper(*args, **kwargs):
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapper

    def _mutation(self, fn, name):
        def wrapper(*args, **kwargs):
            if self.depth == 0:
                self.outside.append(name)
            if name == "hand_out" and self.take_depth == 0:
                self.acquired_outside_take.append(name)
            if name == "_plan_and_take":
                self.take_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                if name == "_plan_and_take":
                    self.take_depth -= 1

        return wrapper


def _run_workload(pool, seed=1, n=30):
    from kvchain.engine.scheduler import Scheduler

    sched = Scheduler(pool, max_batched_tokens=64, max_running=8)
    sched.add(workload(seed, n=n))
    sched.run()
    assert sched.stats.finished == n
    pool.check_idle()
    return sched


def test_one_chain_allocator_spans_every_band_and_performs_every_take(monkeypatch):
    """DECL-18: one ChainAllocator holds a band for every sub-pool in chain order, and over a
    scheduler workload every page any band hands out is handed out inside that allocator's take."""
    pool = world()
    chain = pool.storage.allocator
    assert [b.pool for b in chain.bands] == list(pool.plan.sub_pools)
    assert all(b.epoch is chain.epoch for b in chain.bands)
    watch = _Watch(monkeypatch)
    _run_workload(pool)
    assert not watch.acquired_outside_take, "pages were handed out outside ChainAllocator.take"


def test_scheduler_and_prefix_tree_allocate_through_kvstorage(monkeypatch):
    """DECL-19: the scheduler's pool and the prefix tree share one KVStorage, and every take and
    binding they cause over a workload happens inside a KVStorage method."""
    pool = world()
    assert pool.tree.storage is pool.storage
    watch = _Watch(monkeypatch)
    _run_workload(pool)
    assert not [m for m in watch.outside if m in ("_plan_and_take", "hand_out", "bind")], watch.outside


def test_prefix_tree_frees_through_kvstorage(monkeypatch):
    """DECL-19: the prefix tree's evictions free pages through KVStorage like every other free."""
    pool = world()
    watch = _Watch(monkeypatch)
    _run_workload(pool)
    assert pool.tree.stats["evicted_window_pages"] > 0
    assert not watch.outside, watch.outside


# -- eviction: the cache chooses, the allocator answers ------------------------------------------------


def _full_tree(n_seqs=6, pages_each=8):
    """A full-attention chain whose free bytes are all taken by running rows, with `n_seqs`
    cached sequences of `pages_each` pages in the tree; the first sequence matched last."""
    storage = small_storage(windows=(), state=False, chain_kib=8)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    seqs = [np.full(pages_each * ps, 100 + k, dtype=np.int32) + np.arange(pages_each * ps, dtype=np.int32)
            for k in range(n_seqs)]
    for seq in seqs:
        cache_sequence(storage, tree, seq)
    tree.match_prefix(seqs[0])  # proven reuse: the cache keeps it longest
    full = False
    while not full:  # fill the chain, a row at a time
        row, length = storage.alloc_row(), 0
        while length + ps <= storage.table.context_len:
            try:
                storage.alloc_extend(np.array([row]), np.array([length + ps]))
            except CapacityError:
                full = True
                break
            length += ps
    assert not storage.allocator.units_fit([1])
    leaves = {int(n.key[0]): n for n in tree._nodes()}
    return storage, tree, seqs, leaves


def _answers(monkeypatch):
    """Record every allocator call and its answer while an eviction walk runs."""
    calls = []
    for name in ("fits_after_frees", "units_fit", "admits", "ensure_capacity", "take"):
        fn = getattr(ChainAllocator, name)

        def wrapper(self, *args, _fn=fn, _name=name, **kwargs):
            out = _fn(self, *args, **kwargs)
            calls.append((_name, args, out))
            return out

        monkeypatch.setattr(ChainAllocator, name, wrapper)
    return calls


def test_the_cache_chooses_victims_and_the_allocator_only_answers(monkeypatch):
    """ADM-7: making room for a demand asks the allocator only yes/no questions on page counts;
    the victims are the first ones of the cache's own order (least recently used, reused prefixes
    last), not chosen by the allocator."""
    storage, tree, seqs, leaves = _full_tree()
    order = [node for _kind, node in tree._victims()]
    assert order[-1] is leaves[int(seqs[0][0])]
    calls = _answers(monkeypatch)
    assert evict_until_fits(storage, tree, [12])
    assert {name for name, _a, _o in calls} <= {"units_fit", "fits_after_frees"}
    for _name, args, out in calls:
        assert isinstance(out, bool)
        assert all(isinstance(x, (int, np.integer)) for arg in args for x in arg), args
    gone = [n for n in order if n.parent is None]
    assert gone == order[: len(gone)] and len(gone) == 2, "victims left the cache's order"
    assert leaves[int(seqs[0][0])].parent is not None
    tree.verify()


def test_an_eviction_walk_stops_at_the_first_yes(monkeypatch):
    """ADM-8: the walk asks `fits_after_frees` after each planned victim and ends at the first yes:
    exactly the victims planned so far are freed and the rest stay cached. A walk that never gets
    a yes frees nothing."""
    storage, tree, _seqs, _leaves = _full_tree()
    calls = _answers(monkeypatch)
    held = tree.held_pages()["full"]
    assert evict_until_fits(storage, tree, [12])
    answers = [out for name, _a, out in calls if name == "fits_after_frees"]
    assert answers[-1] is True and not any(answers[:-1]), answers
    victims = len(answers) - 1  # the first question is asked before any victim is planned
    assert victims == 2
    assert tree.held_pages()["full"] == held - victims * 8
    assert tree.stats["evicted_pages"] == victims * 8

    storage, tree, _seqs, _leaves = _full_tree()
    calls.clear()
    held = tree.held_pages()
    assert not evict_until_fits(storage, tree, [10_000])
    assert tree.held_pages() == held and tree.stats["evicted_pages"] == 0
