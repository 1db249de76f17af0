"""Capacity entry points above the allocator: the prefix cache's eviction combined with the
allocator's answer.

The decision/estimate split itself (`capacity_decision`, `observe_only_read`) lives with the
allocator in `alloc/decisions.py`; it is re-exported here for callers above the allocator."""

from __future__ import annotations

from .alloc.decisions import capacity_decision, in_capacity_decision, observe_only_read

__all__ = ["capacity_decision", "evict_until_fits", "in_capacity_decision", "observe_only_read", "reclaimable_pages"]


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
