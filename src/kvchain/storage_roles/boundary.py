"""Host checks of what callers hand the pool: the boundary every role's contract assumes.

The allocator indexes numpy arrays with the ids it is given, so a float is truncated, a bool or a
negative id indexes the wrong entry, and a duplicate frees a page twice, each corrupting the pool
before any check inside could see it. These checks run on the host, before anything changes, and
are always on, so they are priced like the hot path they guard (`bench.boundary_cost`). On the
short arrays a step passes, a numpy ufunc (a comparison, `.any()`, `.max()`) costs several times a
gather or `np.count_nonzero`, so the checks answer with `count_true` (the C `np.count_nonzero`),
run one pass per array, and `KVStorage` keeps what a step repeats from being checked twice. No
Python loop runs per id. Each raises `InputError`."""

from __future__ import annotations

import numpy as np

from ..alloc.npfast import count_true, has_duplicates
from ..errors import InputError
from ..ids import INT64
from ..ids import id_array as id_array  # the boundary's checks, one import for the roles

U64 = np.dtype(np.uint64)


def is_ids(values) -> bool:
    """Whether `values` is already what `id_array` returns (the hot path's arrays): no copy, no check."""
    return type(values) is np.ndarray and values.dtype is INT64 and values.ndim == 1


def index(value, what: str) -> int:
    """One integer (a Python or numpy int, never a bool or a float)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{what} must be an integer, got {value!r}")
    return int(value)


def count(value, what: str) -> int:
    """A non-negative integer."""
    n = index(value, what)
    if n < 0:
        raise InputError(f"{what} of {n}")
    return n


def outside(ids: np.ndarray, hi: int) -> bool:
    """Whether an int64 id lies outside [0, hi), in one pass: seen unsigned, a negative id is huge."""
    return count_true(ids.view(U64) >= hi) != 0


def in_range(ids: np.ndarray, lo: int, hi: int, what: str) -> None:
    """Every id in [lo, hi)."""
    if outside(ids - lo if lo else ids, hi - lo):
        bad = ids[(ids < lo) | (ids >= hi)]
        raise InputError(f"{what} {bad[:8].tolist()} outside {lo}..{hi - 1}")


def distinct(ids: np.ndarray, what: str) -> None:
    """No id named twice; `ids` must already be in range (non-negative)."""
    if len(ids) > 1 and has_duplicates(ids):
        seen = np.bincount(ids)
        if seen.max() > 1:
            raise InputError(f"{what} named more than once: {np.flatnonzero(seen > 1)[:8].tolist()}")


def same_count(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if len(a) != len(b):
        raise InputError(f"{what}: {len(a)} against {len(b)}")


def name(value, what: str = "sub-pool") -> str:
    if not isinstance(value, str):
        raise InputError(f"{what} name must be a string, got {value!r}")
    return value


def of_type(value, cls: type | tuple[type, ...], what: str):
    """An object of the kind the pool handed out (a launch record, a transfer, a reservation)."""
    if not isinstance(value, cls):
        want = cls[0].__name__ if isinstance(cls, tuple) else cls.__name__
        raise InputError(f"{what} must be a {want}, got {type(value).__name__}")
    return value
