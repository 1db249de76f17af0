"""`kvchain bench alloc`: host microseconds per decode iteration, chain allocator vs a static pool.

Both replay the same seeded stream of requests (batch 256, page size 64, a hybrid model with full,
window and state sub-pools; requests finish and new ones arrive) on a `meta` arena, so only host
work is timed: pages for the new tokens, window retirement, frees, arrivals' prefills, write
locations and batch page tables per sub-pool, and (for kvchain) translation and opportunistic
compaction. Only time inside the pools counts. The two run in alternating blocks of iterations so
machine noise hits both alike."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import numpy as np

from ..build import build_kv_storage
from ..decl import MHA, State, StateTensor
from ..models.small import small_hybrid
from ..plan import KVStoragePlan, plan_kv_storage
from ..sizing import size_plan
from .static_pool import StaticPagedPool
from .workload import decode_heavy


def bench_plan(page_size: int = 64) -> KVStoragePlan:
    """A 32-layer hybrid: 8 full-attention layers, 8 sliding-window (1024) layers, 16 Mamba2 layers."""
    mamba = State((StateTensor("conv", (2304, 3)), StateTensor("ssm", (32, 64, 16), "float32")))
    decls = small_hybrid(MHA(8, 128), (1024,), state=mamba, state_layers=True, blocks=8)  # F S W S, 8 times
    return plan_kv_storage(decls, page_size=page_size)


@dataclass
class _Driver:
    """Keeps `batch` requests running on one pool, replaying the shared request stream. `pool_ns`
    accumulates the time spent inside the pool only, not in this driver's own bookkeeping."""

    pool: object
    kvchain: bool
    batch: int
    stream: list
    next_req: int = 0
    pool_ns: int = 0

    def __post_init__(self) -> None:
        self.rows: list[int] = []
        self.remaining: dict[int, int] = {}
        self.fill()

    def fill(self) -> None:
        arrivals = []
        while len(self.rows) + len(arrivals) < self.batch:
            arrivals.append(self.stream[self.next_req % len(self.stream)])
            self.next_req += 1
        if not arrivals:
            return
        lens = np.array([r.prompt for r in arrivals])
        t0 = time.perf_counter_ns()
        new_rows = [self.pool.alloc_row() for _ in arrivals]
        self.pool.alloc_extend(np.array(new_rows), lens)
        self.pool_ns += time.perf_counter_ns() - t0
        for row, req in zip(new_rows, arrivals):
            self.rows.append(row)
            self.remaining[row] = req.output

    def step(self) -> None:
        pool = self.pool
        rows = np.array(self.rows)
        t0 = time.perf_counter_ns()
        if self.kvchain:
            vtok = pool.alloc_decode(rows)
            pool.iteration_ids(vtok, rows)
            pool.runner_ids(rows)
            pool.advance(rows)
        else:
            pool.alloc_decode(rows)
            pool.page_tables(rows)
            pool.advance(rows)
        self.pool_ns += time.perf_counter_ns() - t0
        done = []
        for row in self.rows:
            self.remaining[row] -= 1
            if self.remaining[row] <= 0:
                done.append(row)
        if done:
            t0 = time.perf_counter_ns()
            pool.free_rows(np.array(done))
            self.pool_ns += time.perf_counter_ns() - t0
            for row in done:
                self.rows.remove(row)
                del self.remaining[row]
        self.fill()
        if self.kvchain:
            t0 = time.perf_counter_ns()
            pool.flush_opportunistic()
            self.pool_ns += time.perf_counter_ns() - t0


def run_alloc_bench(iters: int = 1000, batch: int = 256, page_size: int = 64, seed: int = 0,
                    budget: int = 80 * 2**30, block: int = 50, progress=None) -> dict:
    plan = bench_plan(page_size)
    context = 8192
    sizing = size_plan(plan, budget, context_len=context, max_running_requests=batch)
    stream = decode_heavy(4096, seed, context)
    kv = _Driver(build_kv_storage(plan, sizing, "meta"), True, batch, stream)
    # The static pool's timing does not depend on its sizes; give its window pools as many pages
    # as full attention so that a prompt's transient window tail never runs it dry.
    full_pages = sizing.target(plan.owner.name).pages
    static_pool = StaticPagedPool(plan, sizing, {w.name: full_pages for w in plan.windows})
    static = _Driver(static_pool, False, batch, stream)
    for _ in range(min(100, iters)):  # warm-up
        kv.step()
        static.step()
    # Serving engines freeze the objects that live for the whole process after start-up, so a
    # full collection does not walk torch's module graph in the middle of a step; do the same.
    gc.collect()
    gc.freeze()
    kv.pool_ns = static.pool_ns = 0
    done = 0
    while done < iters:
        n = min(block, iters - done)
        for driver in (kv, static):
            for _ in range(n):
                driver.step()
        done += n
        if progress is not None:
            progress(n)
    gc.unfreeze()
    kv_us = kv.pool_ns / iters / 1e3
    st_us = static.pool_ns / iters / 1e3
    stats = kv.pool.stats()
    return {
        "iters": iters,
        "batch": batch,
        "page_size": page_size,
        "kvchain_us_per_iter": round(kv_us, 2),
        "static_us_per_iter": round(st_us, 2),
        "ratio": round(kv_us / st_us, 3),
        "requests_served": kv.next_req,
        "kvchain_moves": stats.moves,
        "kvchain_utilisation": round(stats.utilisation, 4),
    }
