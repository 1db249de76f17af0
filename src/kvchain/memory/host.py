"""Host pools: the host tier's memory, one pool per sub-pool laid out page by page like its device
view, so a host copy moves whole page envelopes and a host page reads through the same typed views.

The two end sub-pools share one page-envelope backing when both hold MHA pages (HIC-11): their host
pages come from one free list of envelopes of the larger size, so the budget serves whichever end
is evicted more. A float always keeps a pool of its own (HIC-12). The memory is pinned when CUDA is
present, so copies from and to the device run asynchronously on the copy stream; plain CPU memory
otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CapacityError, InputError
from ..ids import id_array
from ..layout.entry import HostLayout
from ..plan import KVStoragePlan, PoolKind, SubPool, checked_plan, page_envelope_pair
from ..units import is_integer

__all__ = ["HostLayout", "HostPool", "HostPools", "HostSizing", "host_sizing", "page_envelope_pair",
           "stage_host_groups"]





class HostPool:
    """One host backing: `[n_pages, page_bytes]` uint8 and a free list of its pages. `alloc` and
    `free` refuse (InputError, before the free list changes) a count that is not a whole number
    >= 0, and ids outside the pool, named twice, or not handed out (an allocated mask, checked
    vectorised), so no page is ever handed out twice."""

    def __init__(self, layout: HostLayout, pin: bool | None = None) -> None:
        self.layout = layout
        self.data = layout.allocate(pin)
        self.pinned = bool(self.data.is_pinned()) if layout.n_pages else False
        self._free = np.arange(layout.n_pages - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self._n_free = layout.n_pages
        self._allocated = np.zeros(layout.n_pages, dtype=bool)  # handed out and not freed since

    @property
    def n_pages(self) -> int:
        return self.layout.n_pages

    @property
    def n_free(self) -> int:
        return self._n_free

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def _name(self) -> str:
        return f"host pool {'+'.join(self.layout.sub_pools)}"

    def alloc(self, n: int) -> np.ndarray:
        """`n` free host pages; raises CapacityError, taking none, when fewer are free, and
        InputError for a count that is not a whole number >= 0."""
        if type(n) is not int:
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, np.integer):
                raise InputError(f"{self._name()}: an alloc count is a whole number of pages, got {n!r}")
            n = int(n)
        if n < 0:
            raise InputError(f"{self._name()}: an alloc count is a whole number of pages >= 0, got {n!r}")
        if n > self._n_free:
            raise CapacityError(f"{self._name()}: {self._n_free} free pages, {n} needed")
        self._n_free -= n
        ids = self._free[self._n_free : self._n_free + n][::-1].copy()
        self._allocated[ids] = True
        return ids

    def free(self, ids: np.ndarray) -> None:
        """Give back pages `alloc` handed out. InputError, freeing none, for ids that are not
        integers, lie outside the pool, are named twice or are not allocated now."""
        ids = self._free_ids(ids)
        n = len(ids)
        if not n:
            return
        total = self.layout.n_pages
        if n == 1:  # a record's one page (the host tier frees page by page): scalar reads
            i = ids.item()
            if not 0 <= i < total:
                raise InputError(f"{self._name()}: free ids [{i}] outside 0..{total - 1}")
            if not self._allocated.item(i):
                raise InputError(f"{self._name()}: free ids [{i}] are not allocated (never handed out, "
                                 "or freed already)")
        else:
            if (ids.view(np.uint64) >= total).any():  # seen unsigned, a negative id is huge
                bad = ids[(ids < 0) | (ids >= total)]
                raise InputError(f"{self._name()}: free ids {bad[:8].tolist()} outside 0..{total - 1}")
            taken = self._allocated[ids]
            if not taken.all():
                raise InputError(f"{self._name()}: free ids {ids[~taken][:8].tolist()} are not allocated "
                                 "(never handed out, or freed already)")
            ordered = np.sort(ids)
            twice = ordered[1:] == ordered[:-1]
            if twice.any():
                raise InputError(f"{self._name()}: free ids named more than once: "
                                 f"{np.unique(ordered[1:][twice])[:8].tolist()}")
        self._allocated[ids] = False
        self._free[self._n_free : self._n_free + n] = ids
        self._n_free += n

    def _free_ids(self, ids) -> np.ndarray:
        """`ids` as a flat int64 array (`ids.id_array`); anything but integers is refused."""
        return id_array(ids, f"{self._name()}: free ids")

    def pages(self, pool: SubPool) -> torch.Tensor:
        """This backing's pages as `pool`'s page envelopes: `[n_pages, pool.page_bytes]` (a column
        slice when a shared backing's envelope is larger)."""
        if pool.name not in self.layout.sub_pools:
            raise InputError(f"host pool {self.layout.sub_pools} does not back sub-pool {pool.name!r}")
        return self.data[:, : pool.page_bytes]


@dataclass(frozen=True)
class HostSizing:
    """Host pages per sub-pool a budget buys: token sub-pools get `token_pages` each, the state
    sub-pool one slot per `pages_per_state` token pages (a checkpoint interval), so a backed-up
    prefix finds a host state slot at its checkpoints."""

    token_pages: int
    state_slots: int
    pages_per_state: int
    group_bytes: int  # host bytes of `pages_per_state` token pages of every sub-pool and one state slot


def _token_page_bytes(plan: KVStoragePlan) -> int:
    """Host bytes one page of every token sub-pool takes (a shared backing: two larger envelopes)."""
    pair = page_envelope_pair(plan)
    total = 0
    for pool in plan.sub_pools:
        if pool.kind is PoolKind.STATE:
            continue
        total += max(pair[0].page_bytes, pair[1].page_bytes) if pair and pool in pair else pool.page_bytes
    return total


def host_sizing(plan: KVStoragePlan, budget_bytes: int, pages_per_state: int = 1,
                max_groups: int | None = None) -> HostSizing:
    """Split `budget_bytes` of host memory into whole groups of `pages_per_state` token pages of every
    sub-pool plus one state slot, at most `max_groups` of them (`stage_host_groups`). Raises
    InputError for a budget under one group."""
    checked_plan(plan)
    if not is_integer(budget_bytes) or budget_bytes < 0:
        raise InputError(f"a host budget is a number of bytes >= 0, got {budget_bytes!r}")
    if not is_integer(pages_per_state) or pages_per_state < 1:
        raise InputError(f"pages per host state slot must be a whole number >= 1, got {pages_per_state!r}")
    if max_groups is not None and (not is_integer(max_groups) or max_groups < 1):
        raise InputError(f"max_groups must be None or an integer >= 1, got {max_groups!r}")
    budget_bytes, pages_per_state = int(budget_bytes), int(pages_per_state)
    state = plan.state
    k = pages_per_state if state is not None else 1
    group = k * _token_page_bytes(plan) + (state.page_bytes if state is not None else 0)
    groups = budget_bytes // group
    if groups < 1:
        raise InputError(f"a host budget of {budget_bytes} bytes holds no host page: one group of {k} "
                         f"page(s) of every sub-pool{' and a state slot' if state is not None else ''} "
                         f"needs {group} bytes")
    if max_groups is not None:
        groups = min(groups, max_groups)
    return HostSizing(groups * k, groups if state is not None else 0, k, group)


def stage_host_groups(plans: list[KVStoragePlan], budget_bytes: int, pages_per_state: int = 1) -> int:
    """The host groups every pipeline stage's `budget_bytes` holds: the least over the stages' plans.
    Stages keep other layers, so one budget buys each a different count of its own pages; sized to
    the least, every stage's host pools hold as many pages per sub-pool, and the host tier's
    decisions (what fits on the host, which record is freed for a backup) are the same on every
    stage, as the chain's are (PP-7)."""
    sizings = [host_sizing(plan, budget_bytes, pages_per_state) for plan in plans]
    return min(s.token_pages // s.pages_per_state for s in sizings)


class HostPools:
    """Every sub-pool's host pool (HIC-10), sized from a host budget in bytes; the end sub-pools
    share one backing when `page_envelope_pair` pairs them (HIC-11), a float never shares (HIC-12)."""

    def __init__(self, plan: KVStoragePlan, budget_bytes: int, *, pages_per_state: int = 1,
                 pin: bool | None = None, max_groups: int | None = None) -> None:
        if pin is not None and not isinstance(pin, bool):
            raise InputError(f"pin must be a bool or None (pin where the device is CUDA), got {pin!r}")
        self.plan = plan
        self.sizing = host_sizing(plan, budget_bytes, pages_per_state, max_groups)
        self.budget_bytes = budget_bytes
        pair = page_envelope_pair(plan)
        self._of: dict[str, HostPool] = {}
        n = self.sizing.token_pages
        if pair is not None:
            up, down = pair
            big = up if up.page_bytes >= down.page_bytes else down
            shared = HostPool(HostLayout((up.name, down.name), big.envelope, 2 * n), pin)
            self._of[up.name] = self._of[down.name] = shared
        for pool in plan.sub_pools:
            if pool.name in self._of:
                continue
            pages = self.sizing.state_slots if pool.kind is PoolKind.STATE else n
            self._of[pool.name] = HostPool(HostLayout((pool.name,), pool.envelope, pages), pin)

    def pool(self, sub_pool: str) -> HostPool:
        self.plan.by_name(sub_pool)
        return self._of[sub_pool]

    @property
    def backings(self) -> list[HostPool]:
        """Each distinct backing once, in chain order of its first sub-pool."""
        out: list[HostPool] = []
        for pool in self.plan.sub_pools:
            backing = self._of[pool.name]
            if all(backing is not b for b in out):
                out.append(backing)
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.backings)

    @property
    def pinned(self) -> bool:
        return all(b.pinned for b in self.backings if b.n_pages)

    def pages(self, sub_pool: str) -> torch.Tensor:
        """Host pages of `sub_pool` as `[n, page_bytes]` envelopes, the layout of its device view."""
        return self.pool(sub_pool).pages(self.plan.by_name(sub_pool))
