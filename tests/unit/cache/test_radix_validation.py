"""The prefix tree refuses what would corrupt it, before anything changes: an unlock (or a window
unlock) with no lock left to give back, token ids it cannot store (not integers, or outside the
int32 range its keys hold), and an insert whose tokens do not cover its pages or whose pages the
owner does not bind. After each refusal `verify()` passes and the same match still works."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from kvchain.errors import InputError, InvariantError, KVChainError
from support.chains import boundary_storage

A = np.array
PS = 16


def _storage(state: bool = False):
    return boundary_storage(PS, state)


@pytest.fixture
def cached():
    """A stateless tree holding 64 tokens (four pages) a finished request handed it."""
    storage = _storage()
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER)
    row = storage.alloc_row()
    storage.alloc_extend(A([row]), A([64]))
    toks = np.arange(64, dtype=np.int32)
    table = storage.table
    vpages = table.page_table[row, :4].copy()
    result = tree.insert(toks, vpages, table.window_lo[row])
    storage.release_to_tree(row, 4, result.duplicates)
    storage.free_rows(A([row]))
    return SimpleNamespace(storage=storage, tree=tree, toks=toks, vpages=vpages, node=result.node)


def _unchanged(tree, toks, vpages):
    tree.verify()
    match = tree.match_prefix(toks)
    assert match.length == 64 and match.vpages.tolist() == vpages.tolist()


def _message(info, *words):
    assert isinstance(info.value, KVChainError)
    text = str(info.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text
    return text


# -- unbalanced locks ----------------------------------------------------------------------------------


def test_a_second_unlock_is_refused_before_the_count_goes_negative(cached):
    tree, toks, vpages, node = cached.tree, cached.toks, cached.vpages, cached.node
    tree.lock(node)
    tree.unlock(node)
    held = tree.reclaimable()
    with pytest.raises(InvariantError) as info:
        tree.unlock(node)
    _message(info, "unlock", repr(node))
    assert node.lock_ref == 0 and tree.reclaimable() == held
    _unchanged(tree, toks, vpages)


def test_an_unlock_is_refused_whole_when_a_node_above_is_not_locked(cached):
    """The path is checked before any count moves: a lower node that is locked keeps its lock."""
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    tree.match_prefix(toks[:32])  # splits the node after two pages
    lower = tree.match_prefix(toks).node
    assert lower.parent is not tree.root
    tree._account(lower, -1)
    lower.lock_ref += 1  # as if only the lower node had been locked
    tree._account(lower, 1)
    held = tree.reclaimable()
    with pytest.raises(InvariantError) as info:
        tree.unlock(lower)
    _message(info, "unlock", repr(lower.parent))
    assert lower.lock_ref == 1 and lower.parent.lock_ref == 0 and tree.reclaimable() == held
    tree.verify()
    tree._account(lower, -1)
    lower.lock_ref -= 1
    tree._account(lower, 1)
    _unchanged(tree, toks, vpages)


def test_a_second_window_unlock_is_refused(cached):
    tree, toks, vpages, node = cached.tree, cached.toks, cached.vpages, cached.node
    lock = tree.lock_window(node, 64)
    assert lock is not None
    tree.unlock_window(lock)
    with pytest.raises(InvariantError) as info:
        tree.unlock_window(lock)
    _message(info, "unlock")
    assert node.window_lock == 0
    _unchanged(tree, toks, vpages)


# -- token ids ------------------------------------------------------------------------------------------


def _bad_tokens(toks):
    return {
        "past int32": toks.astype(np.int64) + 2**32,
        "below int32": toks.astype(np.int64) - 2**31 - 1,
        "huge unsigned": toks.astype(np.uint64) + np.uint64(2**63),
        "floats": toks + 0.7,
        "whole floats": toks.astype(np.float64),
        "bools": np.ones(64, dtype=bool),
        "strings": np.array(["a"] * 64),
        "two-dimensional": toks.reshape(4, 16),
    }


@pytest.mark.parametrize("kind", list(_bad_tokens(np.arange(64, dtype=np.int32))))
def test_match_prefix_refuses_tokens_the_tree_cannot_store(cached, kind):
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    with pytest.raises(InputError) as info:
        tree.match_prefix(_bad_tokens(toks)[kind])
    _message(info, "tokens")
    _unchanged(tree, toks, vpages)


@pytest.mark.parametrize("kind", list(_bad_tokens(np.arange(64, dtype=np.int32))))
def test_insert_refuses_tokens_the_tree_cannot_store(cached, kind):
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    before = tree.held_pages()
    with pytest.raises(InputError) as info:
        tree.insert(_bad_tokens(toks)[kind], vpages, A([0]))
    _message(info, "tokens")
    assert tree.held_pages() == before
    _unchanged(tree, toks, vpages)


def test_token_ids_in_range_match_whatever_their_integer_type(cached):
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    for same in (toks.astype(np.int64), toks.astype(np.uint16), toks.tolist()):
        assert tree.match_prefix(same).length == 64
    assert tree.match_prefix(np.empty(0)).length == 0
    extreme = A([2**31 - 1, -(2**31)] * 8, dtype=np.int64)
    assert tree.match_prefix(extreme).length == 0
    _unchanged(tree, toks, vpages)


# -- insert's pages -------------------------------------------------------------------------------------


def test_insert_refuses_tokens_short_of_its_pages(cached):
    """The tree keys whole pages: `len(vpages)` pages need that many pages of tokens."""
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    with pytest.raises(InputError) as info:
        tree.insert(np.arange(10), A([60]), A([0]))
    _message(info, "tokens", "10", "16")
    with pytest.raises(InputError):
        tree.insert(np.arange(1000, 1031), A([60, 61]), A([0]))
    _unchanged(tree, toks, vpages)


def test_insert_refuses_pages_the_owner_does_not_bind(cached):
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    before = tree.held_pages()
    with pytest.raises(InputError) as info:
        tree.insert(np.arange(1000, 1016), A([60]), A([0]))
    _message(info, "vpages", "60", "full")
    with pytest.raises(InputError) as info:  # the null page
        tree.insert(np.arange(1000, 1016), A([0]), A([0]))
    _message(info, "vpages")
    assert tree.held_pages() == before
    assert tree.match_prefix(np.arange(1000, 1016)).length == 0
    _unchanged(tree, toks, vpages)


@pytest.mark.parametrize("bad", [A([-1]), A([10**9]), A([1.5]), A([True])])
def test_insert_refuses_page_ids_that_are_no_virtual_page(cached, bad):
    tree, toks, vpages = cached.tree, cached.toks, cached.vpages
    with pytest.raises(InputError) as info:
        tree.insert(np.arange(1000, 1016), bad, A([0]))
    _message(info, "vpages")
    _unchanged(tree, toks, vpages)


def test_insert_refuses_a_page_named_twice(cached):
    storage, tree, toks, vpages = cached.storage, cached.tree, cached.toks, cached.vpages
    row = storage.alloc_row()
    storage.alloc_extend(A([row]), A([32]))
    mine = storage.table.page_table[row, :1]
    with pytest.raises(InputError) as info:
        tree.insert(np.arange(1000, 1032), A([mine[0], mine[0]]), A([0]))
    _message(info, "vpages", str(mine[0]))
    _unchanged(tree, toks, vpages)


def test_insert_refuses_a_window_lo_per_window_missing(cached):
    storage, tree, toks, vpages = cached.storage, cached.tree, cached.toks, cached.vpages
    row = storage.alloc_row()
    storage.alloc_extend(A([row]), A([32]))
    mine = storage.table.page_table[row, :2].copy()
    for bad in (A([], dtype=np.int64), A([0, 0]), A([0.5])):
        with pytest.raises(InputError) as info:
            tree.insert(np.arange(1000, 1032), mine, bad)
        _message(info, "window_lo")
    _unchanged(tree, toks, vpages)


def test_insert_refuses_a_state_slot_on_a_stateless_plan_or_one_not_bound(cached):
    storage, tree, toks, vpages = cached.storage, cached.tree, cached.toks, cached.vpages
    row = storage.alloc_row()
    storage.alloc_extend(A([row]), A([32]))
    mine = storage.table.page_table[row, :2].copy()
    for bad in (0, 3, 1.0, True):
        with pytest.raises(InputError) as info:
            tree.insert(np.arange(1000, 1032), mine, A([0]), bad)
        _message(info, "state_slot")
    _unchanged(tree, toks, vpages)
    result = tree.insert(np.arange(1000, 1040), mine, A([0]), -1)  # extra tokens past the pages are cut
    assert result.new_pages == 2 and not result.state_taken
    storage.release_to_tree(row, 2, result.duplicates)
    tree.verify()
    assert tree.match_prefix(np.arange(1000, 1032)).length == 32


def test_insert_refuses_a_state_slot_the_state_band_does_not_bind():
    storage = _storage(state=True)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER)
    row = storage.alloc_row()
    storage.alloc_extend(A([row]), A([32]))
    mine = storage.table.page_table[row, :2].copy()
    lo = storage.table.window_lo[row]
    for bad in (10**6, 5):
        with pytest.raises(InputError) as info:
            tree.insert(np.arange(32), mine, lo, bad)
        _message(info, "state_slot", str(bad))
    assert tree.held_pages() == {p.name: 0 for p in storage.plan.sub_pools}
    slot = int(storage.alloc_state_slots(1)[0])
    result = tree.insert(np.arange(32), mine, lo, slot)
    assert result.state_taken
    storage.release_to_tree(row, 2, result.duplicates)
    tree.verify()
    assert tree.match_prefix(np.arange(32)).state_slot == slot
