"""Side by side: the same trace, byte budget and scheduler loop through each pool."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from ..decl import KVLayerDecl
from ..engine.request import ScheduledRequest
from ..engine.scheduler import StepRecord
from ..errors import InputError
from .baselines import (
    DEFAULT_POOLS,
    POOLS,
    PoolConfig,
    StaticSplit,
    ideal_pool,
    kvchain_pool,
    sglang_static_pool,
    static_best_split,
    static_pool,
    uniform_pool,
    vllm_hybrid_pool,
)
from .runner import PoolResult, StepTimeModel, run_pool

#: static-best sweeps its split on the first requests of the trace, then runs the best on all of it
SWEEP_REQUESTS = 400


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 8192
    max_running: int = 256
    step_time: StepTimeModel | None = None
    #: priority scheduling: waiting requests by priority, and preemption of less important work
    priority: bool = False


@dataclass
class Comparison:
    results: list[PoolResult]
    histories: dict[str, list[StepRecord]]
    static_best: StaticSplit | None = None
    sweep: dict[str, float] = field(default_factory=dict)

    def result(self, pool: str) -> PoolResult:
        return next(r for r in self.results if r.pool == pool)

    def ratios(self, metric: str = "steps", base: str = "kvchain") -> dict[str, float]:
        """Each pool's `metric` over `base`'s (default: whole-run steps over kvchain's)."""
        if base not in {r.pool for r in self.results}:
            return {}
        b = getattr(self.result(base), metric) or 0.0
        return {r.pool: (getattr(r, metric) / b if b else float("nan")) for r in self.results}


def _make(name: str, decls, cfg: PoolConfig, split: StaticSplit | None):
    if name == "kvchain":
        return kvchain_pool(decls, cfg)
    if name == "kvchain-exact":
        pool = kvchain_pool(decls, dataclasses.replace(cfg, admission="exact"))
        pool.name = "kvchain-exact"
        return pool
    if name == "static-default":
        return static_pool(decls, cfg)
    if name == "static-best":
        return static_pool(decls, cfg, split or StaticSplit(), name="static-best")
    if name == "uniform-page":
        return uniform_pool(decls, cfg)
    if name == "vllm-hybrid":
        return vllm_hybrid_pool(decls, cfg)
    if name == "sglang-static":
        return sglang_static_pool(decls, cfg)
    if name == "ideal":
        return ideal_pool(decls, cfg)
    raise InputError(f"unknown pool {name!r} (known: {', '.join(POOLS)})")


def _run_one(args) -> tuple[PoolResult, list[StepRecord]]:
    name, decls, cfg, split, requests, sched = args
    pool = _make(name, decls, cfg, split)
    result, stats = run_pool(pool, requests, max_batched_tokens=sched.max_batched_tokens,
                             max_running=sched.max_running, step_time=sched.step_time, priority=sched.priority)
    return result, stats.history


def _sweep_score(args) -> tuple[float, float, float]:
    """Fewest whole-run steps, ties broken by throughput at saturation, then by the shorter queue."""
    split, decls, cfg, requests, sched = args
    pool = static_pool(decls, cfg, split, name="static-best")
    result, _ = run_pool(pool, requests, max_batched_tokens=sched.max_batched_tokens, max_running=sched.max_running,
                         priority=sched.priority)
    return -result.steps, round(result.throughput, 6), -result.queue_delay


def compare(decls: Sequence[KVLayerDecl], cfg: PoolConfig, requests: list[ScheduledRequest], pools: Sequence[str] = DEFAULT_POOLS,
            sched: SchedulerConfig = SchedulerConfig(), jobs: int | None = None,
            progress: Callable[[str], None] | None = None) -> Comparison:
    """Run every pool in `pools` over `requests`; `jobs` worker processes (default: the cores)."""
    for name in pools:
        if name not in POOLS:
            raise InputError(f"unknown pool {name!r} (known: {', '.join(POOLS)})")
    jobs = jobs or min(len(pools), os.cpu_count() or 1)
    decls = list(decls)
    best = None
    sweep: dict[str, float] = {}
    executor = ProcessPoolExecutor(jobs) if jobs > 1 else None
    try:
        if "static-best" in pools:
            from ..plan import plan_kv_storage
            from .baselines import static_grid

            grid = static_grid(plan_kv_storage(decls, page_size=cfg.page_size))
            sample = requests[:SWEEP_REQUESTS]
            tasks = [(split, decls, cfg, sample, sched) for split in grid]
            scores = list(executor.map(_sweep_score, tasks)) if executor else [_sweep_score(t) for t in tasks]
            sweep = {f"window {s.window_ratio} state {s.state_ratio}": -v[0] for s, v in zip(grid, scores)}
            best = grid[max(range(len(grid)), key=lambda i: scores[i])]
            if progress:
                progress("static-best split chosen")
        tasks = [(name, decls, cfg, best if name == "static-best" else None, requests, sched) for name in pools]
        runs = []
        if executor:
            for out in executor.map(_run_one, tasks):
                runs.append(out)
                if progress:
                    progress(out[0].pool)
        else:
            for task in tasks:
                runs.append(_run_one(task))
                if progress:
                    progress(task[0])
    finally:
        if executor:
            executor.shutdown()
    return Comparison([r for r, _ in runs], {r.pool: h for r, h in runs}, best, sweep)


__all__ = ["Comparison", "SchedulerConfig", "compare", "static_best_split"]
