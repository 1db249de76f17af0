"""The pool's runtime checks (`KVCHAIN_INVARIANT_CHECK`).

Fatal checks fail at levels 1 and 2; the others log at 1 and raise at 2. At level 0 every check
here is skipped, so the hot path pays nothing."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from .. import env
from ..env import InvariantCheckLevel
from ..errors import InvariantError

if TYPE_CHECKING:
    from .band import Band
    from .chain import ChainAllocator

log = logging.getLogger("kvchain.invariants")

FATAL = {
    "band.free_of_bound_page",
    "band.free_outside_reservation",
    "chain.window_segment_bound",
    "chain.window_segment_released",
    "chain.stage_capacity_agreement",
}
NON_FATAL = {"band.host_read_before_wait", "band.geometry_ready", "capacity.observe_only_read"}


_operation_level: InvariantCheckLevel | None = None
#: whether the current allocator operation has queued a stream wait (LIFE-41)
_operation_waited = False


def level() -> InvariantCheckLevel:
    """The check level: read once per allocator operation (`allocator_operation`), else now."""
    if _operation_level is not None:
        return _operation_level
    return env.invariant_level()


def begin_operation() -> bool:
    """Pin the level for an outermost allocator operation; returns whether this call pinned it."""
    global _operation_level, _operation_waited
    if _operation_level is not None:
        return False
    _operation_level = env.invariant_level()
    _operation_waited = False
    return True


def end_operation(pinned: bool) -> None:
    global _operation_level, _operation_waited
    if pinned:
        _operation_level = None
        _operation_waited = False


def before_wait() -> None:
    """A stream wait is about to be queued in the current allocator operation."""
    global _operation_waited
    if _operation_level is not None:
        _operation_waited = True


def check_host_read(band: Band, what: str) -> None:
    """`band.host_read_before_wait` (CHK-10): within one allocator operation every host read of
    device state precedes the first stream wait; a read behind a wait on a running forward would
    park the scheduler until that forward ends."""
    if _operation_waited:
        fail("band.host_read_before_wait", f"{band.name}: host read of {what} after a stream wait in the same operation")


def fail(check: str, message: str) -> None:
    """Report a broken check at the current level: raise when fatal or strict, else log."""
    lvl = level()
    if lvl is InvariantCheckLevel.OFF:
        return
    if check in FATAL or lvl is InvariantCheckLevel.STRICT:
        raise InvariantError(check, message)
    log.warning("%s: %s", check, message)


def check_freed_pages(band: Band, ids: np.ndarray) -> None:
    """`band.free_of_bound_page` (CHK-5): every page a free names is live and bound, so a double
    free or a free of a page never allocated fails instead of returning a tombstone to the holes."""
    if level() is InvariantCheckLevel.OFF:
        return
    from .band import LIVE

    ids = np.asarray(ids)
    in_grid = (ids >= 0) & (ids < band.grid.n_grid)
    bad = ~in_grid
    if in_grid.all():
        bad = (band.state[ids] != LIVE) | (band.ids.p2v[ids] < 0)
        if len(np.unique(ids)) != len(ids):
            fail("band.free_of_bound_page", f"{band.name}: a free names the same page twice")
    if bad.any():
        fail("band.free_of_bound_page", f"{band.name}: free of unbound pages {ids[bad][:8].tolist()}")
    if band.n_fixed and band.fixed_mask[ids[in_grid]].any():
        fail("band.free_outside_reservation", f"{band.name}: a free names pages reserved for a host-tier load")


def check_virtual_bound(band: Band, virtual: np.ndarray) -> None:
    """A window free names rows still bound to the window (`chain.window_segment_bound`); other
    bands' frees of unbound ids are `band.free_of_bound_page`."""
    if level() is InvariantCheckLevel.OFF:
        return
    v = np.asarray(virtual)
    bad = (v < 0) | (v >= band.ids.n_virtual)
    if not bad.any():
        bad = band.ids.v2p[v] < 0
    if bad.any():
        check = "chain.window_segment_bound" if band.pool.window is not None else "band.free_of_bound_page"
        fail(check, f"{band.name}: free of virtual pages not bound here {v[bad][:8].tolist()}")


def check_windows_released(chain: ChainAllocator, virtual: np.ndarray) -> None:
    """`chain.window_segment_released` (CHK-8): an owner free names only rows that every window
    already released."""
    if level() is InvariantCheckLevel.OFF:
        return
    for band in chain.window_bands:
        bound = band.ids.v2p[virtual] >= 0
        if bound.any():
            fail("chain.window_segment_released",
                 f"owner free of virtual pages {np.asarray(virtual)[bound][:8].tolist()} still bound in {band.name}")


def geometry_ready(band: Band) -> None:
    """`band.geometry_ready` (CHK-11): layout-changing geometry sees a band with no pending page."""
    if band.n_pending and level() is not InvariantCheckLevel.OFF:
        fail("band.geometry_ready", f"{band.name}: {band.n_pending} pending pages under a layout change")
