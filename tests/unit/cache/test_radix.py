"""The prefix tree's matching: page-granular walks and where a match may end on a window model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from kvchain.errors import CapacityError
from support.chains import small_storage
from support.tree import cache_sequence


def _reads_from(pool, length):
    """First token a window reads at `length`: `window` tokens back, or its chunk's start."""
    if pool.lifetime.chunked:
        return length // pool.window * pool.window
    return max(0, length - pool.window)


def _naive_covered(tree, bound, n_pages):
    """Where a match may end, one end at a time: each window's rows bound from where it reads."""
    out = np.zeros(n_pages + 1, dtype=bool)
    for end in range(1, n_pages + 1):
        out[end] = all(bound[w][_reads_from(pool, end * tree.ps) // tree.ps: end].all()
                       for w, pool in enumerate(tree.windows))
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_covered_ends_match_a_per_end_check(data):
    """The vectorised coverage equals checking every end on its own (sliding or chunked windows)."""
    storage = small_storage(windows=(32, 8), state=False, chunked=data.draw(st.booleans()))
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    n = data.draw(st.integers(0, 40))
    bound = [np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
             for _ in tree.windows]
    assert np.array_equal(tree._covered_ends(bound, n), _naive_covered(tree, bound, n))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_match_finds_the_longest_cached_page_prefix(data):
    """A full-attention model matches the longest whole-page prefix any cached sequence shares."""
    storage = small_storage(windows=(), state=False, chain_kib=64, context=128)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    base = np.array(data.draw(st.lists(st.integers(1, 3), min_size=40, max_size=40)), dtype=np.int32)
    cached = []
    for _ in range(data.draw(st.integers(1, 4))):
        cut = data.draw(st.integers(0, 40))
        tail = np.array(data.draw(st.lists(st.integers(4, 6), min_size=0, max_size=20)), dtype=np.int32)
        seq = np.concatenate([base[:cut], tail])
        if len(seq) >= ps:
            cache_sequence(storage, tree, seq)
            cached.append(seq[: (len(seq) // ps) * ps])
    query = np.concatenate([base[: data.draw(st.integers(0, 40))],
                            np.array(data.draw(st.lists(st.integers(1, 6), max_size=10)), dtype=np.int32)])
    expect = 0
    for seq in cached:
        n = min(len(seq), len(query))
        diff = np.flatnonzero(seq[:n] != query[:n])
        common = int(diff[0]) if len(diff) else n
        expect = max(expect, (common // ps) * ps)
    match = tree.match_prefix(query)
    assert match.length == expect
    tree.verify()


def _path(node, root):
    out = []
    while node is not root:
        out.append(node)
        node = node.parent
    return out


def _end(node, ps):
    return node.start + node.n_pages * ps


def test_a_window_lock_survives_a_split_under_it():
    """A match that splits a window-locked node leaves no lock behind once the request unlocks:
    every window row is reclaimable and eviction frees it."""
    storage = small_storage(windows=(8,), state=False)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    tokens = np.arange(1, 8 * ps + 1, dtype=np.int32)
    cache_sequence(storage, tree, tokens)
    match = tree.match_prefix(tokens[: 8 * ps - 1])
    tree.lock(match.node)
    lock = tree.lock_window(match.node, match.length)
    assert lock is not None
    tree.match_prefix(tokens[: 5 * ps])  # ends inside the locked node: splits it
    tree.unlock_window(lock)
    tree.unlock(match.node)
    assert all(n.window_lock == 0 and n.lock_ref == 0 for n in tree._nodes())
    tree.verify()
    freed = tree.evict_all()
    assert tree.held_pages() == {p.name: 0 for p in tree.plan.sub_pools}
    assert freed.pages == {"window8": 8, "full": 8}


def test_a_window_lock_gives_back_what_the_request_has_left_behind():
    """Advancing a request releases the tree's window rows behind its window in coarse steps;
    the rows before its window at lock time were never locked."""
    storage = small_storage(windows=(16,), state=False, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    tokens = np.arange(1, 20 * ps + 1, dtype=np.int32)
    cache_sequence(storage, tree, tokens)
    match = tree.match_prefix(tokens[: 20 * ps - 1])  # 19 pages = 38 tokens
    tree.lock(match.node)
    lock = tree.lock_window(match.node, match.length)
    window = tree.plan.windows[0].name
    assert lock.floor == match.length - 16
    assert tree.reclaimable()[window] == 20 - 8  # the 8 pages of its window stay
    lock = tree.advance_window(lock, match.length + 1)  # not a whole step yet
    assert tree.reclaimable()[window] == 12
    lock = tree.advance_window(lock, match.length + 6)
    assert lock.floor == match.length + 6 - 16 and tree.reclaimable()[window] == 15
    lock = tree.advance_window(lock, match.length + 16)
    assert lock is None and tree.reclaimable()[window] == 20
    tree.unlock(match.node)
    tree.verify()


def test_a_chunked_window_lock_holds_only_the_current_chunk():
    """A chunked window reads from its chunk's start: the lock holds that chunk's rows alone and
    lets go of them all once the request enters the next chunk."""
    storage = small_storage(windows=(16,), state=False, context=128, chain_kib=64, chunked=True)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    tokens = np.arange(1, 20 * ps + 1, dtype=np.int32)
    cache_sequence(storage, tree, tokens)
    match = tree.match_prefix(tokens[: 20 * ps - 1])  # 38 tokens: its chunk began at 32
    tree.lock(match.node)
    lock = tree.lock_window(match.node, match.length)
    window = tree.plan.windows[0].name
    assert lock.floor == 32 and tree.reclaimable()[window] == 20 - 3
    assert tree.advance_window(lock, 47) is lock  # still in the same chunk
    assert tree.advance_window(lock, 48) is None and tree.reclaimable()[window] == 20
    tree.unlock(match.node)
    tree.verify()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_window_locks_protect_exactly_what_running_requests_read(data):
    """Under any mix of caching, matching (which splits), locking, advancing and unlocking: every
    node a running request's windows still read is protected and survives eviction, a node is
    protected only while some request reads it (give or take one release step), and nothing
    stays locked once every request has gone."""
    storage = small_storage(windows=(12, 4), state=False, context=128, chain_kib=96, rows=8,
                            chunked=data.draw(st.booleans()))
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    ps = storage.page_size
    step = tree._release_step

    def floor_of(length):
        return min(_reads_from(pool, length) for pool in tree.windows) // ps * ps
    base = np.array(data.draw(st.lists(st.integers(1, 2), min_size=48, max_size=48)), dtype=np.int32)
    running = []  # (node, length the request stands at, lock)

    def check():
        tree.verify()
        for node, length, _ in running:
            floor = floor_of(length)
            for n in _path(node, tree.root):
                if _end(n, ps) > floor:
                    assert n.window_lock > 0 and n.lock_ref > 0
        for n in tree._nodes():
            readers = sum(1 for node, length, _ in running if n in _path(node, tree.root)
                          and _end(n, ps) > floor_of(length) - step)
            assert n.window_lock <= readers

    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["cache", "run", "advance", "finish", "match", "evict"]))
        if op == "cache" and storage.table.free_rows:
            cut = data.draw(st.integers(ps, 48))
            tail = np.array(data.draw(st.lists(st.integers(3, 4), max_size=12)), dtype=np.int32)
            seq = np.concatenate([base[:cut], tail])
            try:
                cache_sequence(storage, tree, seq)
            except CapacityError:
                pytest.fail("the test's arena is too small for what it caches")
        elif op == "run":
            match = tree.match_prefix(base[: data.draw(st.integers(0, 48))])
            if match.length:
                tree.lock(match.node)
                running.append((match.node, match.length, tree.lock_window(match.node, match.length)))
        elif op == "advance" and running:
            i = data.draw(st.integers(0, len(running) - 1))
            node, length, lock = running[i]
            length += data.draw(st.integers(1, 10))
            running[i] = (node, length, tree.advance_window(lock, length))
        elif op == "finish" and running:
            node, _, lock = running.pop(data.draw(st.integers(0, len(running) - 1)))
            tree.unlock_window(lock)
            tree.unlock(node)
        elif op == "match":
            tree.match_prefix(base[: data.draw(st.integers(0, 48))])
        elif op == "evict":
            kept = {id(n): n.window_lo.copy() for n in tree._nodes() if n.window_lock and n.lock_ref}
            tree.evict_all()
            for n in tree._nodes():
                if id(n) in kept:
                    assert np.array_equal(n.window_lo, kept[id(n)])
        check()
    for node, _, lock in running:
        tree.unlock_window(lock)
        tree.unlock(node)
    assert all(n.window_lock == 0 and n.lock_ref == 0 for n in tree._nodes())
    tree.verify()
