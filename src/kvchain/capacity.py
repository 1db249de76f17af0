"""Capacity entry points: decisions versus estimates.

Every capacity decision asks whether a concrete demand fits (`ChainAllocator.admits`, `units_fit`,
`ensure_capacity`, `fits_after_frees`). The scalar estimates (`available_size` and friends) ignore
alignment, fixed and pending pages and serve stats, logs and error text only. Decision paths are
marked with `capacity_decision`; an estimate read inside one is flagged by `observe_only_read`
(it raises at KVCHAIN_INVARIANT_CHECK=2 and logs once per estimate at 1)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from .env import InvariantCheckLevel

log = logging.getLogger("kvchain.capacity")
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
    from .alloc.invariants import fail, level

    lvl = level()
    if lvl is InvariantCheckLevel.OFF:
        return
    if lvl is InvariantCheckLevel.WARN:
        if estimate in _logged:
            return
        _logged.add(estimate)
    fail("capacity.observe_only_read", f"estimate {estimate!r} read inside a capacity decision")


def evict_until_fits(storage, tree, pages) -> bool:
    """Combine the prefix cache's eviction with the allocator's answer (CAP-2): the cache walks its
    victims in its own order (ADM-7), asking `fits_after_frees` after each, and frees nothing unless
    the walk reaches a yes (ADM-8). True when a take of `pages` then fits."""
    chain = storage.allocator
    if chain.units_fit(pages):
        return True
    if tree is None:
        return False
    names = [p.name for p in storage.plan.sub_pools]
    tree.evict(lambda freed: chain.fits_after_frees(pages, [freed.get(n, 0) for n in names]))
    return chain.units_fit(pages)


def reclaimable_pages(storage, tree) -> tuple[int, ...] | None:
    """What the prefix cache could evict now, per band in chain order (for `admits`, ADM-6)."""
    if tree is None:
        return None
    r = tree.reclaimable()
    return tuple(r[p.name] for p in storage.plan.sub_pools)
