"""The host tier's load-back under pipeline parallelism: the physical-take scope lays out all of a
load's takes, every sub-pool asked of every stage's snapshot, before it makes any (PP-12, PP-13)."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.pricing import feasible
from kvchain.cache.hicache import take_load_pages
from support.stages import stage_pools

#: a load of two window rows and eight owner pages: the window is the first sub-pool taken
LOAD = [2, 8]


@pytest.fixture(autouse=True)
def _checks(monkeypatch):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "1")


def _counts(pool) -> tuple:
    chain = pool.chain
    return (tuple((b.n_live, b.n_fixed, b.n_holes + b.n_pending) for b in chain.bands), len(chain.virtual_free),
            len(chain.slot_free))


def _fill_until_one_stage_refuses(pools, load):
    """The same takes on every stage, a page of tokens at a time, until exactly one stage's
    snapshot refuses `load` while every stage could still take its first sub-pool alone."""
    first = [load[0]] + [0] * (len(load) - 1)
    for _ in range(200):
        snaps = pools[0].chain.stage_capacity.snapshots()
        whole = [feasible(s, tuple(load)) for s in snaps]
        if not all(whole):
            assert whole.count(False) == 1 and all(feasible(s, tuple(first)) for s in snaps)
            return whole.index(False)
        for pool in pools:
            storage = pool.storage
            row = storage.alloc_row()
            storage.alloc_extend(np.array([row]), np.array([storage.page_size]))
    raise AssertionError("the load never stopped fitting")


def test_a_load_one_stage_cannot_serve_takes_nothing_on_any_stage():
    """PP-13: a load whose second sub-pool (the owner's pages) cannot be taken on one stage once
    its first (the window rows) is: the scope asks the whole load of every stage's snapshot before
    any take, so no stage takes anything, every pool is as it was, and the digests agree. Taking
    sub-pool by sub-pool would fix the window rows on both stages and then be refused."""
    pools = stage_pools(16)
    refusing = _fill_until_one_stage_refuses(pools, LOAD)
    snaps = pools[0].chain.stage_capacity.snapshots()
    assert feasible(snaps[1 - refusing], tuple(LOAD))  # the other stage alone would take it
    before = [_counts(p) for p in pools]
    for pool in pools:
        pool.chain.stage_capacity.take_digest()
    assert [take_load_pages(p.storage, LOAD) for p in pools] == [None, None]
    assert [_counts(p) for p in pools] == before
    digests = [p.chain.stage_capacity.take_digest() for p in pools]
    assert digests[0] == digests[1]


def test_a_load_every_stage_serves_takes_every_sub_pool_under_a_reservation():
    """PP-13: where every stage serves the whole load, the scope takes each sub-pool's pages, fixed
    under a load reservation on each stage, and the stages hold the same units."""
    pools = stage_pools(16)
    taken = [take_load_pages(p.storage, LOAD) for p in pools]
    for pool, t in zip(pools, taken):
        assert t is not None and [len(t[b.name][0]) for b in pool.chain.bands] == LOAD
        assert [b.n_fixed for b in pool.chain.bands] == LOAD
    digests = [p.chain.stage_capacity.take_digest() for p in pools]
    assert digests[0] == digests[1]


def _host_tier_stages():
    """Two stages with a host tier each, one 24-token prefix cached, backed up and evicted on both."""
    pools = stage_pools(16)
    tokens = np.arange(1, 25, dtype=np.int32)
    for pool in pools:
        pool.enable_host_tier(256 * 1024)
        storage, tree = pool.storage, pool.tree
        row = storage.alloc_row()
        storage.alloc_extend(np.array([row]), np.array([len(tokens)]))
        n = len(tokens) // storage.page_size
        result = tree.insert(tokens, storage.table.page_table[row, :n].copy(), storage.table.window_lo[row])
        storage.release_to_tree(row, n, result.duplicates)
        storage.free_rows(np.array([row]))
        tree.evict_all()
        pool.hicache.collect(wait=True)
    return pools, tokens


def _live(pool) -> list[int]:
    return [b.n_live for b in pool.chain.bands]


def test_a_match_whose_load_one_stage_cannot_serve_loads_nothing_anywhere():
    """PP-13 through a match: the host holds a prefix both stages evicted; the device is filled, the
    same on both, until one stage's snapshot refuses the load while both could take its window rows
    alone. The match loads nothing on either stage (the whole load is asked before any take), both
    count the skip, the pools are as they were and the digests agree."""
    probe, tokens = _host_tier_stages()
    loads = []
    for pool in probe:  # the load's pages per sub-pool, as a match on an emptied device takes them
        before = _live(pool)
        assert pool.tree.match_prefix(tokens).length == len(tokens)
        loads.append([a - b for a, b in zip(_live(pool), before)])
    assert loads[0] == loads[1] and all(loads[0])
    pools, tokens = _host_tier_stages()
    _fill_until_one_stage_refuses(pools, loads[0])
    before = [_counts(p) for p in pools]
    for pool in pools:
        pool.chain.stage_capacity.take_digest()
    assert [p.tree.match_prefix(tokens).length for p in pools] == [0, 0]
    assert [p.hicache.stats["load_skips"] for p in pools] == [1, 1]
    assert [_counts(p) for p in pools] == before
    digests = [p.chain.stage_capacity.take_digest() for p in pools]
    assert digests[0] == digests[1]
