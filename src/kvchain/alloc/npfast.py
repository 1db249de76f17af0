"""Small numpy helpers for the host's hot path.

A serving engine runs its forward on another Python thread, and numpy releases the interpreter lock
inside many of its kernels (sorts, hash-based `np.unique`, `ufunc.at`, large gathers). Each release
while the forward thread wants the lock hands it over, and the scheduler then waits for it back (up
to the interpreter's switch interval). For the short arrays of one step the same answers come from
a few list operations that keep the lock; long arrays take numpy's own path."""

from __future__ import annotations

import numpy as np

try:  # the C function itself: `np.count_nonzero`'s Python wrapper costs more than its count here
    from numpy._core.multiarray import count_nonzero as count_true
except ImportError:  # numpy 1.x
    count_true = np.count_nonzero

#: arrays up to this length take the list path
SHORT = 1024


def unique_sorted(values: np.ndarray) -> np.ndarray:
    """`np.unique(values)` for an integer array (flattened): its distinct values, ascending, in its
    dtype."""
    a = np.asarray(values).reshape(-1)
    if len(a) > SHORT:
        return np.unique(a)
    return np.array(sorted(set(a.tolist())), dtype=a.dtype)


def has_duplicates(values: np.ndarray) -> bool:
    """Whether an integer array holds any value twice (`len(np.unique(v)) != len(v)`)."""
    a = np.asarray(values).reshape(-1)
    if len(a) < 2:
        return False
    if len(a) > SHORT:
        return len(np.unique(a)) != len(a)
    return len(set(a.tolist())) != len(a)


def add_at(counts: np.ndarray, ids: np.ndarray, delta: int) -> None:
    """`np.add.at(counts, ids, delta)`: `delta` added once per occurrence of each id in `ids`."""
    if len(ids) <= SHORT and not has_duplicates(ids):
        counts[ids] += delta  # distinct ids: a plain indexed add is the same and keeps the lock
        return
    np.add.at(counts, ids, delta)
