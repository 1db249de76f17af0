"""A plain static paged pool: one fixed free list per sub-pool, as engines that split memory into
fixed per-kind pools do (vLLM's and SGLang's hybrid allocators: a full-attention pool, a
sliding-window pool and a Mamba state pool, each sized at start-up and never lent to another). The
baseline `kvchain bench alloc` measures the chain allocator against.

It does the same per-iteration work a forward needs from its pool: pages for the new tokens,
window pages retired as requests advance, a state slot per request, write locations and batch page
tables per sub-pool. Nothing moves, nothing is priced: a take either finds free pages or fails."""

from __future__ import annotations

import numpy as np

from ..advance import window_keep_from
from ..alloc.id_space import IdStack
from ..errors import CapacityError
from ..plan import KVStoragePlan, PoolKind
from ..requests import expand_runs
from ..sizing import PlanSizing


class StaticPagedPool:
    def __init__(self, plan: KVStoragePlan, sizing: PlanSizing, pages: dict[str, int] | None = None) -> None:
        """Pools of `pages[name]` pages each (default: the sizing's boot targets)."""
        self.plan = plan
        self.ps = plan.page_size
        rows = sizing.max_running_requests + 1
        self.max_pages = -(-sizing.context_len // self.ps)
        self.pools = []
        for pool, target in zip(plan.sub_pools, sizing.targets):
            n = (pages or {}).get(pool.name, target.pages) + 1  # page 0 is the padding page
            self.pools.append({
                "pool": pool,
                "free": IdStack(n, np.arange(n - 1, 0, -1, dtype=np.int64)),  # page 0: padding
                "table": np.zeros((rows, 1 if pool.kind is PoolKind.STATE else self.max_pages), dtype=np.int64),
                "lo": np.zeros(rows, dtype=np.int64),
                "capacity": n - 1,
            })
        self.seq_lens = np.zeros(rows, dtype=np.int64)
        self.rows = IdStack(rows, np.arange(rows - 1, 0, -1, dtype=np.int64))

    def pages_in_use(self) -> dict[str, int]:
        return {p["pool"].name: p["capacity"] - len(p["free"]) for p in self.pools}

    def pool_bytes(self) -> int:
        """Bytes of every page the pools hold, used or free (the padding pages not counted)."""
        return sum(p["capacity"] * p["pool"].page_bytes for p in self.pools)

    def alloc_row(self) -> int:
        return int(self.rows.pop(1)[0])

    def alloc_extend(self, rows: np.ndarray, new_lens: np.ndarray) -> dict[str, np.ndarray]:
        ps = self.ps
        old = self.seq_lens[rows]
        old_pages = (old + ps - 1) // ps
        counts = (new_lens + ps - 1) // ps - old_pages
        n = int(counts.sum())
        fresh = rows[old == 0]
        for p in self.pools:
            need = len(fresh) if p["pool"].kind is PoolKind.STATE else n
            if need > len(p["free"]):
                raise CapacityError(f"static pool {p['pool'].name} is out of pages")
        row_idx, col = expand_runs(rows, old_pages, counts)
        for p in self.pools:
            if p["pool"].kind is PoolKind.STATE:
                p["table"][fresh, 0] = p["free"].pop(len(fresh))
            else:
                p["table"][row_idx, col] = p["free"].pop(n)
        self.seq_lens[rows] = new_lens
        tok = new_lens - old
        if (tok == 1).all():
            return {p["pool"].name: p["table"][rows, old // ps] * ps + old % ps
                    for p in self.pools if p["pool"].kind is not PoolKind.STATE}
        total = int(tok.sum())
        tstarts = np.cumsum(tok) - tok
        pos = np.repeat(old, tok) + (np.arange(total) - np.repeat(tstarts, tok))
        trow = np.repeat(rows, tok)
        return {p["pool"].name: p["table"][trow, pos // ps] * ps + pos % ps
                for p in self.pools if p["pool"].kind is not PoolKind.STATE}

    def alloc_decode(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return self.alloc_extend(rows, self.seq_lens[rows] + 1)

    def page_tables(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        n = int(((self.seq_lens[rows] + self.ps - 1) // self.ps).max(initial=0))
        return {p["pool"].name: p["table"][rows, : (1 if p["pool"].kind is PoolKind.STATE else n)]
                for p in self.pools}

    def advance(self, rows: np.ndarray) -> None:
        ps = self.ps
        seq = self.seq_lens[rows]
        last = np.maximum((seq + ps - 1) // ps - 1, 0)
        for p in self.pools:
            pool = p["pool"]
            if pool.kind is not PoolKind.WINDOW:
                continue
            new_lo = np.minimum(window_keep_from(seq, pool.window, pool.lifetime.chunked) // ps, last)
            old_lo = p["lo"][rows]
            counts = np.maximum(new_lo - old_lo, 0)
            n = int(counts.sum())
            if n:
                ridx, col = expand_runs(rows, old_lo, counts)
                p["free"].push(p["table"][ridx, col])
                p["table"][ridx, col] = 0
            p["lo"][rows] = np.maximum(old_lo, new_lo)

    def free_rows(self, rows: np.ndarray) -> None:
        ps = self.ps
        counts = (self.seq_lens[rows] + ps - 1) // ps
        mask = np.arange(self.max_pages)[None, :] < counts[:, None]
        for p in self.pools:
            pool = p["pool"]
            if pool.kind is PoolKind.STATE:
                p["free"].push(p["table"][rows, 0])
                p["table"][rows, 0] = 0
                continue
            held = mask & (np.arange(self.max_pages)[None, :] >= p["lo"][rows][:, None])
            p["free"].push(p["table"][rows][held])
            p["table"][rows] = 0
            p["lo"][rows] = 0
        self.seq_lens[rows] = 0
        self.rows.push(rows)


class PeakTrackingPool(StaticPagedPool):
    """A static pool that records the most pages each sub-pool held at once, and the most bytes all
    of them held at once: a dry run of a workload through it sizes the pools that serve it (each
    kind's own peak, as an engine with fixed per-kind pools must provision) and the one budget a
    shared arena needs (the peak of the sum, never above the sum of the peaks)."""

    def __init__(self, plan: KVStoragePlan, sizing: PlanSizing, pages: dict[str, int] | None = None) -> None:
        super().__init__(plan, sizing, pages)
        self.peak_pages = {p["pool"].name: 0 for p in self.pools}
        self.peak_bytes = 0

    def alloc_extend(self, rows: np.ndarray, new_lens: np.ndarray) -> dict[str, np.ndarray]:
        out = super().alloc_extend(rows, new_lens)
        used = self.pages_in_use()
        for name, n in used.items():
            self.peak_pages[name] = max(self.peak_pages[name], n)
        self.peak_bytes = max(self.peak_bytes, sum(n * self.plan.by_name(name).page_bytes for name, n in used.items()))
        return out
