"""`build_kv_storage`: plan, size, then construct the arena, one view per sub-pool (with the
routed cache over them), the `ChainAllocator` and the `RequestTable`, returned as one `KVStorage`."""

from __future__ import annotations

import torch

from .alloc.chain import ChainAllocator
from .device.base import Device
from .device.immediate import ImmediateDevice
from .errors import BudgetError, InputError
from .layout.views import SubPoolView
from .memory.arena import ARENA_ALIGN, KVArena
from .plan import MAX_TOKEN_OWNER_PAGES, KVStoragePlan, TokenIds, checked_plan
from .requests import RequestTable
from .sizing import PlanSizing
from .storage import KVStorage

#: Most pages one sub-pool's grid may span when built: the allocator keeps host arrays of that length
#: per band (about 40 bytes a page, some 10 GiB at this limit). The presets at 141 GiB, even at page
#: size 1, need at most about 26 million.
MAX_BAND_PAGES = 1 << 28


def build_kv_storage(
    plan: KVStoragePlan,
    sizing: PlanSizing,
    device: str | torch.device = "cpu",
    *,
    backend: Device | None = None,
) -> KVStorage:
    """Allocate everything `sizing` budgeted. `device` holds the arena (`meta` for planning and
    simulation at real scale with no memory); `backend` runs allocator work (default: immediate).
    Raises `InputError`, before allocating anything, when `plan` is not a plan, `sizing` is not a
    `PlanSizing` or was made for another plan (other sub-pools, page size, page or unit bytes),
    `backend` is not a `Device`, or `device` names no torch device or one this torch cannot
    allocate on (`cuda` without CUDA); `BudgetError` when a sub-pool's grid would span more pages
    than the allocator's id arrays are built for (`MAX_BAND_PAGES`), or the host cannot hold them."""
    checked_plan(plan)
    if not isinstance(sizing, PlanSizing):
        raise InputError(f"sizing must be a PlanSizing (from size_plan(plan, ...)), got {sizing!r}")
    _check_sizing_plan(plan, sizing)
    if backend is not None and not isinstance(backend, Device):
        raise InputError(f"backend must be a kvchain Device (such as ImmediateDevice or ModeledDevice) or None, "
                         f"got {backend!r}")
    device = _torch_device(device)
    _check_token_owner_pages(plan, sizing)
    _check_band_pages(plan, sizing)
    arena = KVArena(plan, sizing.arena_bytes, device)
    try:
        allocator = ChainAllocator(plan, arena, backend or ImmediateDevice(), scratch_bytes=sizing.fixed.scratch)
        table = RequestTable(sizing.max_running_requests + 1, sizing.context_len, plan.page_size, len(plan.windows))
    except MemoryError as e:
        raise BudgetError(f"the host memory cannot hold the allocator's id arrays and request table for "
                          f"{sizing.arena_bytes:,} arena bytes: {_first_line(e)}") from None
    views = {pool.name: SubPoolView(pool, arena.page_bytes_view(pool.index)) for pool in plan.sub_pools}
    storage = KVStorage(plan, sizing, arena, allocator, table, views)
    allocator.prewarm_compaction()
    return storage


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _torch_device(device: object) -> torch.device:
    """`device` as a torch device this torch can allocate on (a zero-size probe: `cuda` without
    CUDA, or an index past the last GPU, is refused here rather than by the arena)."""
    try:
        out = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as e:  # ValueError: an index past an int64
        raise InputError(f"no torch device {device!r}: {_first_line(e)}") from None
    try:
        torch.empty(0, dtype=torch.uint8, device=out)
    except (RuntimeError, AssertionError) as e:
        raise InputError(f"device {device!r} cannot hold the arena here: {_first_line(e)}") from None
    return out


def _check_sizing_plan(plan: KVStoragePlan, sizing: PlanSizing) -> None:
    """Refuse a sizing made for another plan: other sub-pools, another page size, or a sub-pool
    whose pages or units hold other bytes (another geometry, dtype or layer count)."""
    planned = [p.name for p in plan.sub_pools]
    sized = [t.name for t in sizing.targets]
    if sized != planned:
        raise InputError(f"the sizing budgets sub-pools {sized}, the plan has {planned}: size this plan")
    if sizing.page_size != plan.page_size:
        raise InputError(f"the sizing was made for page size {sizing.page_size}, the plan pages {plan.page_size} "
                         "tokens: size this plan")
    for pool, target in zip(plan.sub_pools, sizing.targets):
        if (target.kind, target.page_bytes, target.unit_bytes) != (pool.kind, pool.page_bytes, pool.unit_bytes):
            raise InputError(
                f"the sizing was made for another plan: its sub-pool {pool.name!r} ({target.kind.value}) has pages "
                f"of {target.page_bytes:,} bytes and units of {target.unit_bytes:,}, the plan's ({pool.kind.value}) "
                f"{pool.page_bytes:,} and {pool.unit_bytes:,}: size this plan")


def _check_band_pages(plan: KVStoragePlan, sizing: PlanSizing) -> None:
    """Refuse a sizing whose arena would give a sub-pool (the one of the smallest pages) a grid of
    more than `MAX_BAND_PAGES` pages, before the arena or any id array is allocated."""
    pool = min(plan.sub_pools, key=lambda p: p.page_bytes)
    pages = sizing.arena_bytes // pool.page_bytes
    if pages > MAX_BAND_PAGES:
        arena = ((MAX_BAND_PAGES + 1) * pool.page_bytes - 1) // ARENA_ALIGN * ARENA_ALIGN
        raise BudgetError(
            f"sub-pool {pool.name!r} would span {pages:,} pages of {pool.page_bytes:,} bytes in an arena of "
            f"{sizing.arena_bytes:,} bytes; a sub-pool builds with at most {MAX_BAND_PAGES:,} pages (the "
            f"allocator's id arrays), an arena of at most {arena:,} bytes, a budget of at most "
            f"{arena + ARENA_ALIGN - 1 + sizing.fixed.total:,} with this sizing's fixed allocations"
        )


def _check_token_owner_pages(plan: KVStoragePlan, sizing: PlanSizing) -> None:
    """Refuse to build a chain whose token-id owner would index more virtual pages than
    the allocator's id arrays should hold (planning and sizing it at any budget still work)."""
    owner = plan.owner
    if not isinstance(owner.geometry, TokenIds):
        return
    pages = sizing.arena_bytes // owner.page_bytes
    if pages > MAX_TOKEN_OWNER_PAGES:
        raise BudgetError(
            f"a token-id owner's ids at {sizing.arena_bytes:,} arena bytes are {pages:,} virtual pages; "
            f"it builds with at most {MAX_TOKEN_OWNER_PAGES:,} (an arena of at most "
            f"{MAX_TOKEN_OWNER_PAGES * owner.page_bytes:,} bytes, a budget of at most "
            f"{MAX_TOKEN_OWNER_PAGES * owner.page_bytes + sizing.fixed.total:,} with this sizing's fixed allocations)"
        )
