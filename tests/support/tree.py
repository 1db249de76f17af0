"""Small helpers around the prefix tree and monkeypatching shared by the rule tests."""

from __future__ import annotations

import contextlib

import numpy as np


def cache_sequence(storage, tree, tokens, advance=False):
    """Prefill `tokens` in a row (retiring its windows first when `advance`) and hand its whole
    pages to the tree, as a finished request does. Returns the node the insert ended at."""
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([len(tokens)]))
    if advance:
        storage.advance(np.array([row]))
    n = len(tokens) // storage.page_size
    table = storage.table
    result = tree.insert(tokens[: n * storage.page_size], table.page_table[row, :n].copy(), table.window_lo[row], -1)
    storage.release_to_tree(row, n, result.duplicates)
    storage.free_rows(np.array([row]))
    return result.node


@contextlib.contextmanager
def patched(obj, name, wrapper):
    """Replace `obj.name` with `wrapper(original)` for the block."""
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        setattr(obj, name, original)
