"""What the prefix tree evicts first: a checkpoint a deeper one superseded goes before pages and
states still in use, and a plan counts each node's rows once."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from support.chains import small_storage
from support.tree import cache_sequence


def _checkpointed(storage, tree, tokens):
    """Cache `tokens` (whole pages) with a state at their end, as a checkpoint does."""
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([len(tokens)]))
    slot = int(storage.alloc_state_slots(1)[0])
    n = len(tokens) // storage.page_size
    table = storage.table
    result = tree.insert(tokens, table.page_table[row, :n].copy(), table.window_lo[row], slot)
    assert result.state_taken
    storage.release_to_tree(row, n, result.duplicates)
    storage.free_rows(np.array([row]))
    return result.node


def test_a_superseded_checkpoint_goes_before_the_conversation_it_leads_to():
    """Turn 2 matched turn 1's checkpoint and left a deeper one: asked for one state slot, the
    tree gives turn 1's (no match will end there again) and keeps every page and turn 2's state."""
    storage = small_storage(page_size=2, windows=(), state=True, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 16)
    state = tree.plan.state.name
    tokens = np.arange(1, 65, dtype=np.int32)
    first = _checkpointed(storage, tree, tokens[:32])
    assert tree.match_prefix(tokens[:40]).node is first  # turn 2 lands on turn 1's checkpoint
    second = _checkpointed(storage, tree, tokens[:64])
    held = tree.held_pages()
    freed = tree.evict(lambda pages: pages.get(state, 0) >= 1)
    assert freed.pages == {state: 1}
    assert first.state_slot < 0 and second.state_slot >= 0
    assert tree.held_pages()[tree.plan.owner.name] == held[tree.plan.owner.name]
    assert tree.match_prefix(tokens).length == 64
    tree.verify()


def test_a_plan_counts_window_rows_once_when_a_node_goes_whole_after_them():
    """A parent whose window rows are planned away before its leaf child, then itself as a leaf,
    counts those rows once: a demand above everything the tree holds evicts nothing (ADM-8)."""
    storage = small_storage(page_size=2, windows=(8,), state=False, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    window = tree.windows[0].name
    tokens = np.arange(1, 49, dtype=np.int32)
    cache_sequence(storage, tree, tokens[:32])
    cache_sequence(storage, tree, tokens)  # a child below the first node
    held = tree.held_pages()
    freed = tree.evict(lambda pages: pages.get(window, 0) > held[window])
    assert freed.pages == {} and tree.held_pages() == held
    freed = tree.evict(lambda pages: pages.get(window, 0) >= held[window])
    assert freed.pages[window] == held[window]
    tree.verify()


def test_what_a_known_future_match_needs_goes_after_every_other_victim():
    """A (16 tokens) is cached before B (16 others), so least recently used alone gives A's 8
    pages first. Told that a waiting request will match A (`reuse`), the tree gives B's and
    keeps A, whose match then still finds all 16 tokens."""
    storage = small_storage(page_size=2, windows=(), state=False, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    owner = tree.plan.owner.name
    a = np.arange(1, 17, dtype=np.int32)
    b = np.arange(100, 116, dtype=np.int32)
    node_a = cache_sequence(storage, tree, a)
    node_b = cache_sequence(storage, tree, b)
    assert tree.match_needs(np.concatenate([a, [7, 7]])) == [node_a]
    tree.reuse = lambda: {id(node_a): 0}
    freed = tree.evict(lambda pages: pages.get(owner, 0) >= 8)
    assert freed.pages == {owner: 8}
    assert node_b.parent is None and tree.match_prefix(a).length == 16
    tree.verify()


def test_among_known_future_matches_the_one_needed_latest_goes_first():
    """A, then B, both matched by waiting requests: A's by the head (rank 0), B's by the one
    behind it (rank 1). Asked for 8 pages the tree gives B's, though A's are the older."""
    storage = small_storage(page_size=2, windows=(), state=False, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    owner = tree.plan.owner.name
    a = np.arange(1, 17, dtype=np.int32)
    b = np.arange(100, 116, dtype=np.int32)
    node_a = cache_sequence(storage, tree, a)
    node_b = cache_sequence(storage, tree, b)
    tree.reuse = lambda: {id(node_a): 0, id(node_b): 1}
    tree.evict(lambda pages: pages.get(owner, 0) >= 8)
    assert node_b.parent is None and tree.match_prefix(a).length == 16
    tree.verify()


def test_a_future_match_needs_the_nodes_holding_the_window_rows_behind_its_end():
    """Window of 8 tokens, pages of 2: a 24-token sequence cached as a 16-token node and an
    8-token child. A match at 24 reads the window rows of tokens 16..23, all in the child, so it
    needs the child alone; a match at 20 (a 20-token node split off the child) reads 12..19,
    which reach into the parent, so it needs both."""
    storage = small_storage(page_size=2, windows=(8,), state=False, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    tokens = np.arange(1, 25, dtype=np.int32)
    parent = cache_sequence(storage, tree, tokens[:16])
    child = cache_sequence(storage, tree, tokens)
    assert child.parent is parent
    assert tree.match_needs(np.concatenate([tokens, [9, 9]])) == [child]
    needs = tree.match_needs(np.concatenate([tokens[:20], [9, 9]]))
    assert needs == [child, parent]
    assert tree.match_prefix(np.concatenate([tokens, [9, 9]])).length == 24  # match_needs split nothing


def _a_cached_first(unmatchable_first: bool, b_tokens: int):
    """A state tree (pages of 2 tokens, a checkpoint every 8) holding A's 16 tokens checkpointed
    at their end, and B's `b_tokens` tokens still to cache."""
    storage = small_storage(page_size=2, windows=(), state=True, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 8)
    tree.unmatchable_first = unmatchable_first
    a = np.arange(1, 17, dtype=np.int32)
    return storage, tree, a, np.arange(100, 100 + b_tokens, dtype=np.int32), _checkpointed(storage, tree, a)


@pytest.mark.parametrize("unmatchable_first", [True, False])
def test_a_leaf_past_the_last_checkpoint_goes_first_whatever_its_recency(unmatchable_first):
    """WIN-9: a match on a model with state ends only where a state is held. A (checkpointed at
    16 tokens) is cached before B, whose 16 tokens run 8 past its checkpoint at 8, so B's last 8
    tokens are a leaf that holds no state. Asked for 4 pages, the tree gives B's stateless leaf,
    and both A and B still match to their states. An engine that evicts by recency alone
    (`unmatchable_first` off) gives A's pages and state (the older) and loses A's hit instead."""
    storage, tree, a, b, node_a = _a_cached_first(unmatchable_first, 16)
    owner = tree.plan.owner.name
    _checkpointed(storage, tree, b[:8])
    tail = cache_sequence(storage, tree, b)  # past B's checkpoint: no state at its end
    assert tail.state_slot < 0 and not tail.children
    freed = tree.evict(lambda pages: pages.get(owner, 0) >= 4)
    if unmatchable_first:
        assert freed.pages == {owner: 4}
        assert tail.parent is None and node_a.parent is not None
        assert tree.match_prefix(np.concatenate([a, [7, 7]])).length == 16
    else:
        assert freed.pages == {owner: 8, tree.plan.state.name: 1}
        assert node_a.parent is None and tail.parent is not None
        assert tree.match_prefix(np.concatenate([a, [7, 7]])).length == 0
    assert tree.match_prefix(np.concatenate([b, [7, 7]])).length == 8
    tree.verify()


@pytest.mark.parametrize("unmatchable_first", [True, False])
def test_a_checkpoint_in_a_request_s_own_output_goes_first_once_a_later_one_supersedes_it(unmatchable_first):
    """A (16 tokens, checkpointed at 16) is cached first. B's prompt is 8 tokens; it checkpoints
    at 8, then in its own output at 16 and 24. Once the one at 24 is in, the one at 16 can end no
    match (only B's next turn reaches past 8, and it reaches 24), so asked for one state slot the
    tree gives it, though A's state is older; A and B still match to 16 and 24. Inside the prompt
    (at 8) a checkpoint is left to age as before: another prompt may leave B's there. With
    recency alone A goes, pages and state."""
    storage, tree, a, b, node_a = _a_cached_first(unmatchable_first, 24)
    state = tree.plan.state.name
    at_8 = _checkpointed(storage, tree, b[:8])
    at_16 = _checkpointed(storage, tree, b[:16])
    tree.supersede_output_checkpoint(at_16, 8)  # its parent's state (at 8) is inside B's prompt
    assert at_8.state_used != 0
    at_24 = _checkpointed(storage, tree, b[:24])
    tree.supersede_output_checkpoint(at_24, 8)
    freed = tree.evict(lambda pages: pages.get(state, 0) >= 1)
    if unmatchable_first:
        assert freed.pages == {state: 1}
        assert at_16.state_slot < 0 and node_a.state_slot >= 0 and at_8.state_slot >= 0
        assert tree.match_prefix(np.concatenate([a, [7, 7]])).length == 16
    else:  # A, the least recently used, goes whole
        assert freed.pages == {state: 1, tree.plan.owner.name: 8}
        assert node_a.state_slot < 0 and at_16.state_slot >= 0
    assert tree.match_prefix(np.concatenate([b, [7, 7]])).length == 24
    tree.verify()
