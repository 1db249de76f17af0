"""Id arrays as the pool takes them: callers hand numpy arrays, lists or scalars of ids, and every
layer that indexes with them (the storage boundary, the host pools) needs the same answer first:
a flat int64 array, or `InputError` for anything that is not integers (a float would be truncated,
a bool or an object would index the wrong entry)."""

from __future__ import annotations

import numpy as np

from .errors import InputError

INT64 = np.dtype(np.int64)


def id_array(values, what: str) -> np.ndarray:
    """`values` as a flat int64 array; anything but integers (floats, bools, strings, objects,
    numbers past int64) is refused. An empty sequence of any type is an empty array."""
    if type(values) is np.ndarray and values.dtype is INT64:  # the hot path's arrays, as they are
        return values if values.ndim == 1 else values.reshape(-1)
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputError(f"{what} must be an array of integers ({exc})") from None
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind in "fO":
            return np.zeros(0, dtype=np.int64)
        raise InputError(f"{what} must be integers, not {arr.dtype} (got {arr.reshape(-1)[:4].tolist()})")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InputError(f"{what} {arr.max()} is past the int64 range")
    return arr.astype(np.int64, copy=False).reshape(-1)
