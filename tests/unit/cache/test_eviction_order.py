"""What the prefix tree evicts first: a checkpoint a deeper one superseded goes before pages and
states still in use, and a plan counts each node's rows once."""

from __future__ import annotations

import numpy as np

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
