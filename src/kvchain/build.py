"""`build_kv_storage`: plan, size, then construct the arena, one view per sub-pool (with the
routed cache over them), the `ChainAllocator` and the `RequestTable`, returned as one `KVStorage`."""

from __future__ import annotations

import torch

from .alloc.chain import ChainAllocator
from .device.base import Device
from .device.immediate import ImmediateDevice
from .errors import BudgetError, InputError
from .layout.views import SubPoolView
from .memory.arena import KVArena
from .plan import MAX_TOKEN_OWNER_PAGES, KVStoragePlan, TokenIds
from .requests import RequestTable
from .sizing import PlanSizing
from .storage import KVStorage


def build_kv_storage(
    plan: KVStoragePlan,
    sizing: PlanSizing,
    device: str | torch.device = "cpu",
    *,
    backend: Device | None = None,
) -> KVStorage:
    """Allocate everything `sizing` budgeted. `device` holds the arena (`meta` for planning and
    simulation at real scale with no memory); `backend` runs allocator work (default: immediate).
    Raises `InputError` when `sizing` was made for another plan or `device` names no torch device."""
    planned = [p.name for p in plan.sub_pools]
    sized = [t.name for t in sizing.targets]
    if sized != planned:
        raise InputError(f"the sizing budgets sub-pools {sized}, the plan has {planned}: size this plan")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"no torch device {device!r}: {e}") from None
    _check_token_owner_pages(plan, sizing)
    arena = KVArena(plan, sizing.arena_bytes, device)
    allocator = ChainAllocator(plan, arena, backend or ImmediateDevice(), scratch_bytes=sizing.fixed.scratch)
    table = RequestTable(sizing.max_running_requests + 1, sizing.context_len, plan.page_size, len(plan.windows))
    views = {pool.name: SubPoolView(pool, arena.page_bytes_view(pool.index)) for pool in plan.sub_pools}
    storage = KVStorage(plan, sizing, arena, allocator, table, views)
    allocator.prewarm_compaction()
    return storage


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
