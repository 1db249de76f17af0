"""The pool's runtime checks (`KVCHAIN_INVARIANT_CHECK`).

Fatal checks fail at levels 1 and 2; the others log at 1 and raise at 2. At level 0 every check
here is skipped, so the hot path pays nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .. import env
from ..env import InvariantCheckLevel
from ..errors import InvariantError
from .id_space import UnitIds

log = logging.getLogger("kvchain.invariants")

FATAL = {
    "band.free_of_bound_page",
    "band.free_outside_reservation",
    "chain.window_segment_bound",
    "chain.window_segment_released",
    "chain.stage_capacity_agreement",
}
NON_FATAL = {"band.host_read_before_wait", "band.geometry_ready", "capacity.observe_only_read"}


#: whether an outermost allocator operation is running (`begin_operation` .. `end_operation`)
_in_operation = False
#: the level pinned for the running operation: read from the environment at its first check, not
#: at its start, so an operation that checks nothing (most hot-path calls at level 0) reads nothing
_operation_level: InvariantCheckLevel | None = None
#: whether the current allocator operation has queued a stream wait (LIFE-41)
_operation_waited = False


def level() -> InvariantCheckLevel:
    """The check level: read once per allocator operation (`allocator_operation`), at its first
    check, and kept for the rest of it; outside an operation, read now."""
    global _operation_level
    lvl = _operation_level
    if lvl is None:
        lvl = env.invariant_level()
        if _in_operation:
            _operation_level = lvl
    return lvl


def begin_operation() -> bool:
    """Open an outermost allocator operation; returns whether this call opened it."""
    global _in_operation, _operation_level, _operation_waited
    if _in_operation:
        return False
    _in_operation = True
    _operation_level = None
    _operation_waited = False
    return True


def end_operation(pinned: bool) -> None:
    global _in_operation, _operation_level, _operation_waited
    if pinned:
        _in_operation = False
        _operation_level = None
        _operation_waited = False


def before_wait() -> None:
    """A stream wait is about to be queued in the current allocator operation."""
    global _operation_waited
    if _in_operation:
        _operation_waited = True


def check_host_read(band: str, what: str) -> None:
    """`band.host_read_before_wait` (CHK-10): within one allocator operation every host read of
    device state precedes the first stream wait; a read behind a wait on a running forward would
    park the scheduler until that forward ends."""
    if _operation_waited:
        fail("band.host_read_before_wait", f"{band}: host read of {what} after a stream wait in the same operation")


def fail(check: str, message: str) -> None:
    """Report a broken check at the current level: raise when fatal or strict, else log."""
    lvl = level()
    if lvl is InvariantCheckLevel.OFF:
        return
    if check in FATAL or lvl is InvariantCheckLevel.STRICT:
        raise InvariantError(check, message)
    log.warning("%s: %s", check, message)


class _WindowBand(Protocol):
    name: str
    ids: UnitIds


class _WindowBands(Protocol):
    window_bands: Sequence[_WindowBand]


def check_windows_released(chain: _WindowBands, virtual: np.ndarray) -> None:
    """`chain.window_segment_released` (CHK-8): an owner free names only rows that every window
    already released."""
    if level() is InvariantCheckLevel.OFF:
        return
    for band in chain.window_bands:
        bound = band.ids.v2p[virtual] >= 0
        if bound.any():
            fail("chain.window_segment_released",
                 f"owner free of virtual pages {np.asarray(virtual)[bound][:8].tolist()} still bound in {band.name}")
