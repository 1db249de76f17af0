"""`KVArena`: every byte of KV state in one `uint8` tensor, and the page grid of each band in it.

Each band indexes pages of its own page-byte size on a grid: grid id g covers bytes
`[origin + g * page_bytes, origin + (g + 1) * page_bytes)`. The grow-up end and the floats use
origin 0; the grow-down end aligns its grid to the arena's top byte. Below the chain, a small sink
region holds one sink page per attention band: the page an unbound virtual page reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BudgetError
from ..plan import KVStoragePlan, Placement
from ..units import zeros

#: Arena sizes are rounded down to this, so every grid origin allows a wide (int64) view.
ARENA_ALIGN = 16


@dataclass(frozen=True)
class BandGrid:
    """Where one band's page grid sits in the arena."""

    index: int
    page_bytes: int
    origin: int
    n_grid: int
    sink_id: int | None
    first_id: int  # lowest grid id above the sink region

    def byte_offset(self, grid_id: int) -> int:
        return self.origin + grid_id * self.page_bytes


@dataclass(frozen=True)
class ArenaLayout:
    """The arena's size, the end of its sink region, and each band's grid (chain order)."""

    arena_bytes: int
    chain_lo: int
    grids: tuple[BandGrid, ...]

    @property
    def sink_bytes(self) -> int:
        return self.chain_lo

    @property
    def chain_bytes(self) -> int:
        return self.arena_bytes - self.chain_lo


def arena_layout(plan: KVStoragePlan, arena_bytes: int) -> ArenaLayout:
    """Place every band's grid and the sink pages in an arena of `arena_bytes` (rounded down)."""
    arena_bytes -= arena_bytes % ARENA_ALIGN
    origins = []
    for pool in plan.sub_pools:
        pb = pool.page_bytes
        origin = arena_bytes % pb if pool.placement is Placement.DOWN_END else 0
        origins.append(origin)
    cursor = 0
    sinks: list[int | None] = []
    for pool, origin in zip(plan.sub_pools, origins):
        if not pool.is_attention:
            sinks.append(None)
            continue
        pb = pool.page_bytes
        g = max(0, -(-(cursor - origin) // pb))
        sinks.append(g)
        cursor = origin + (g + 1) * pb
    if cursor > arena_bytes:
        raise BudgetError(f"arena of {arena_bytes} bytes cannot hold the sink pages ({cursor} bytes)")
    grids = []
    for pool, origin, sink in zip(plan.sub_pools, origins, sinks):
        pb = pool.page_bytes
        n_grid = (arena_bytes - origin) // pb
        first = max(0, -(-(cursor - origin) // pb))
        grids.append(BandGrid(pool.index, pb, origin, n_grid, sink, first))
    return ArenaLayout(arena_bytes, cursor, tuple(grids))


class KVArena:
    """One uint8 tensor on a device (cpu, cuda, or meta for planning at real scale with no memory)."""

    def __init__(self, plan: KVStoragePlan, arena_bytes: int, device: str | torch.device = "cpu") -> None:
        self.plan = plan
        self.layout = arena_layout(plan, arena_bytes)
        self.device = torch.device(device)
        # zeros, not empty: a page handed out before its first write must not hold NaN bytes.
        if self.device.type == "meta":
            self.data = torch.empty(self.layout.arena_bytes, dtype=torch.uint8, device=self.device)
        else:
            self.data = zeros(self.layout.arena_bytes, torch.uint8, self.device, what="the arena")

    @property
    def nbytes(self) -> int:
        return self.layout.arena_bytes

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def page_bytes_view(self, index: int) -> torch.Tensor:
        """Band `index`'s grid as a [n_grid, page_bytes] uint8 view."""
        g = self.layout.grids[index]
        return self.data[g.origin : g.origin + g.n_grid * g.page_bytes].view(g.n_grid, g.page_bytes)

    def page_words_view(self, index: int) -> torch.Tensor:
        """The same grid as [n_grid, page_bytes / 8] int64: page copies through a wide dtype run several
        times faster than through uint8 on CPU."""
        return self.page_bytes_view(index).view(torch.int64)
