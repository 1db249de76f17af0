"""The prefix tree's matching: page-granular walks and where a match may end on a window model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from support.chains import small_storage


def _naive_covered(tree, bound, n_pages):
    """Where a match may end, one end at a time: each window's rows bound for `window` tokens back."""
    out = np.zeros(n_pages + 1, dtype=bool)
    for end in range(1, n_pages + 1):
        out[end] = all(bound[w][max(0, end * tree.ps - pool.window) // tree.ps: end].all()
                       for w, pool in enumerate(tree.windows))
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_covered_ends_match_a_per_end_check(data):
    """The vectorised coverage equals checking every end on its own."""
    storage = small_storage(windows=(32, 8), state=False)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    n = data.draw(st.integers(0, 40))
    bound = [np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
             for _ in tree.windows]
    assert np.array_equal(tree._covered_ends(bound, n), _naive_covered(tree, bound, n))


def _cache_sequence(storage, tree, tokens):
    """Prefill `tokens` in a row and hand its whole pages to the tree, as a finished request does."""
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([len(tokens)]))
    n = len(tokens) // storage.page_size
    table = storage.table
    result = tree.insert(tokens[: n * storage.page_size], table.page_table[row, :n].copy(), table.window_lo[row], -1)
    if len(result.duplicates):
        storage.free_virtual_pages(result.duplicates)
    storage.release_to_tree(row, n)
    storage.free_rows(np.array([row]))


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
            _cache_sequence(storage, tree, seq)
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
