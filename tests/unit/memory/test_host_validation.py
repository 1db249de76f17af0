"""A host pool's `alloc` and `free` refuse what would corrupt its free list: a page freed twice (in
one call or across calls), a page never handed out, an id outside the pool, a count that is not a
non-negative whole number. Each refusal is an `InputError` naming the argument, raised before the
free list changes, so the pool goes on handing out each page once."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.errors import InputError, KVChainError
from kvchain.memory.host import HostPools
from support.chains import boundary_plan

A = np.array


@pytest.fixture
def pool():
    plan = boundary_plan()
    return HostPools(plan, 2**20, pin=False).pool("full")


def _refused(pool, call, *words):
    before = (pool.n_free, pool.alloc(0).tolist())
    with pytest.raises(InputError) as info:
        call()
    assert isinstance(info.value, KVChainError)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    assert pool.n_free == before[0]
    return message


def _hands_out_each_page_once(pool, held):
    """Everything still free, taken now, is disjoint from `held` and has no repeats."""
    rest = pool.alloc(pool.n_free)
    assert len(set(rest.tolist())) == len(rest)
    assert not set(rest.tolist()) & set(np.asarray(held).tolist())
    assert len(rest) + len(held) == pool.n_pages


def test_a_page_named_twice_in_one_free_is_refused(pool):
    a = pool.alloc(4)
    _refused(pool, lambda: pool.free(A([a[0], a[0]])), "ids", str(a[0]))
    _hands_out_each_page_once(pool, a)


def test_a_page_freed_twice_across_calls_is_refused(pool):
    a = pool.alloc(4)
    pool.free(a[:1])
    _refused(pool, lambda: pool.free(a[:2]), "ids", "not allocated", str(a[0]))
    _hands_out_each_page_once(pool, a[1:])


def test_a_page_never_handed_out_is_refused(pool):
    a = pool.alloc(4)
    _refused(pool, lambda: pool.free(A([50])), "ids", "50", "not allocated")
    _hands_out_each_page_once(pool, a)


@pytest.mark.parametrize("bad", [-3, 55, 2**40])
def test_ids_outside_the_pool_are_refused(pool, bad):
    a = pool.alloc(4)
    _refused(pool, lambda: pool.free(A([a[1], bad])), "ids", str(bad))
    _hands_out_each_page_once(pool, a)


@pytest.mark.parametrize("bad", [A([1.5]), A([True]), ["x"]])
def test_non_integer_ids_are_refused(pool, bad):
    a = pool.alloc(4)
    _refused(pool, lambda: pool.free(bad), "ids")
    _hands_out_each_page_once(pool, a)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_a_count_that_is_not_a_non_negative_integer_is_refused(pool, bad):
    a = pool.alloc(4)
    _refused(pool, lambda: pool.alloc(bad), "count", repr(bad))
    _hands_out_each_page_once(pool, a)


def test_valid_use_is_unchanged(pool):
    """Pages come off the stack in order, an empty free is a no-op, a numpy count is a count, and a
    page freed goes back on top."""
    a = pool.alloc(3)
    assert a.tolist() == [0, 1, 2]
    pool.free(np.empty(0, dtype=np.int64))
    pool.free([])
    b = pool.alloc(np.int64(2))
    assert b.tolist() == [3, 4]
    pool.free(a[[1]])
    assert pool.alloc(1).tolist() == [1]
    pool.free(np.concatenate([a, b]).astype(np.int32))
    assert pool.n_free == pool.n_pages
    assert sorted(pool.alloc(pool.n_pages).tolist()) == list(range(pool.n_pages))
