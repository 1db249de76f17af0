"""Capacity decisions versus estimates, as the allocator marks them.

Every capacity decision asks whether a concrete demand fits (`ChainAllocator.admits`, `units_fit`,
`ensure_capacity`, `fits_after_frees`). The scalar estimates (`available_size` and friends) ignore
alignment, fixed and pending pages and serve stats, logs and error text only. Decision paths are
marked with `capacity_decision`; an estimate read inside one is flagged by `observe_only_read`
(it raises at KVCHAIN_INVARIANT_CHECK=2 and logs once per estimate at 1)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

from ..env import InvariantCheckLevel
from .invariants import fail, level

F = TypeVar("F", bound=Callable)

_state = threading.local()
_logged: set[str] = set()


def in_capacity_decision() -> bool:
    return getattr(_state, "depth", 0) > 0


def capacity_decision(fn: F) -> F:
    """Mark a function as a capacity decision path (CAP-15)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.depth -= 1

    return wrapper  # type: ignore[return-value]


def observe_only_read(estimate: str) -> None:
    """Called by every availability estimate: flags a read inside a capacity decision (CHK-13)."""
    if not in_capacity_decision():
        return
    lvl = level()
    if lvl is InvariantCheckLevel.OFF:
        return
    if lvl is InvariantCheckLevel.WARN:
        if estimate in _logged:
            return
        _logged.add(estimate)
    fail("capacity.observe_only_read", f"estimate {estimate!r} read inside a capacity decision")
