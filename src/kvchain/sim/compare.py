"""Side by side: the same trace, byte budget and scheduler loop through each pool.

Progress is counted in requests settled (finished, aborted or rejected), every run's requests
together (the `static-best` sweep's sample runs included), because that count tracks the time a
run takes far better than its steps do (the drain's steps are cheap). In one process the caller's
callback hears every step; worker processes write their count to a shared array each step and
the parent reads it while it waits for their runs, at most `PROGRESS_POLL_S` apart."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..decl import KVLayerDecl
from ..engine.request import ScheduledRequest
from ..engine.scheduler import Scheduler, StepRecord
from ..errors import InputError
from ..plan import checked_decls
from ..units import is_integer
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
#: the longest the parent waits between two reads of the workers' progress (seconds)
PROGRESS_POLL_S = 0.2

#: `progress(done, total)`: requests settled so far over every run of the comparison, and how many
#: there are in all
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 8192
    max_running: int = 256
    step_time: StepTimeModel | None = None
    #: priority scheduling: waiting requests by priority, and preemption of less important work
    priority: bool = False
    #: speculative decoding: tokens a decode step yields (`speculative.SpecSteps`); None: one
    decode_tokens: Callable[[ScheduledRequest], int] | None = None

    def __post_init__(self) -> None:
        """A step-time model that is not one, or a callable that is not one, is refused where the
        config is made (the limits are checked with the pool's checkpoint grid, `check_step_budget`)."""
        if not isinstance(self.priority, bool):
            raise InputError(f"priority must be a bool, got {self.priority!r}")
        if self.step_time is not None and not isinstance(self.step_time, StepTimeModel):
            raise InputError(f"step_time must be a StepTimeModel or None, got {self.step_time!r}")
        if self.decode_tokens is not None and not callable(self.decode_tokens):
            raise InputError(f"decode_tokens must be a callable or None, got {self.decode_tokens!r}")


@dataclass
class Comparison:
    results: list[PoolResult]
    histories: dict[str, list[StepRecord]]
    static_best: StaticSplit | None = None
    #: static-best's sweep: per split tried, `window_ratio` and `state_ratio` (None for a kind of
    #: sub-pool the model lacks, whose ratio the split cannot use) and its `steps` on the sample
    sweep: list[dict[str, float | None]] = field(default_factory=list)
    #: with the step-time model: when each history record of each pool ends, in seconds
    times: dict[str, list[float]] = field(default_factory=dict)

    def result(self, pool: str) -> PoolResult:
        return next(r for r in self.results if r.pool == pool)

    def ratios(self, metric: str = "steps", base: str = "kvchain") -> dict[str, float]:
        """Each pool's `metric` over `base`'s (default: whole-run steps over kvchain's)."""
        if base not in {r.pool for r in self.results}:
            return {}
        b = getattr(self.result(base), metric) or 0.0
        return {r.pool: (getattr(r, metric) / b if b else float("nan")) for r in self.results}

    def headline(self) -> dict[str, Any]:
        """The one whole-run figure a comparison leads with: seconds to serve the whole trace with
        the step-time model, steps without, of the reference pool (kvchain, or the first pool when
        kvchain is not run) and, for every pool, the reference's figure over the pool's (below 1:
        the reference serves the trace in less)."""
        if not self.results:
            return {}
        timed = self.results[0].seconds is not None
        metric = "seconds" if timed else "steps"
        ref = self.result("kvchain") if any(r.pool == "kvchain" for r in self.results) else self.results[0]
        value = getattr(ref, metric)
        return {
            "metric": metric,
            "reference": ref.pool,
            "reference_value": value,
            "pools": [{"pool": r.pool, "value": getattr(r, metric),
                       "reference_over_pool": value / getattr(r, metric) if getattr(r, metric) else float("nan")}
                      for r in self.results],
        }


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


#: in a worker process: the shared array each run writes its settled count to (one slot a run)
_worker_counts: Any = None


def _init_worker(counts: Any) -> None:
    global _worker_counts
    _worker_counts = counts


def _counter(slot: int, tally: _Tally | None) -> Callable[[Scheduler], None] | None:
    """The per-step hook of run `slot`: its settled count to `tally` (one process) or to the
    shared array (a worker)."""
    if tally is not None:
        return lambda s: tally.report(slot, len(s.done))
    counts = _worker_counts
    if counts is None:
        return None

    def write(s: Scheduler) -> None:
        counts[slot] = len(s.done)

    return write


def _run_one(args, tally: _Tally | None = None) -> tuple[PoolResult, list[StepRecord], list[float]]:
    slot, name, decls, cfg, split, requests, sched = args
    pool = _make(name, decls, cfg, split)
    ends: list[float] = []
    result, stats = run_pool(pool, requests, max_batched_tokens=sched.max_batched_tokens,
                             max_running=sched.max_running, step_time=sched.step_time, priority=sched.priority,
                             on_step=_counter(slot, tally), record_ends=ends, decode_tokens=sched.decode_tokens)
    _settle(slot, len(requests), tally)
    return result, stats.history, ends


def _sweep_score(args, tally: _Tally | None = None) -> tuple[float, float, float]:
    """Fewest whole-run steps, ties broken by throughput at saturation, then by the shorter queue."""
    slot, split, decls, cfg, requests, sched = args
    pool = static_pool(decls, cfg, split, name="static-best")
    result, _ = run_pool(pool, requests, max_batched_tokens=sched.max_batched_tokens, max_running=sched.max_running,
                         priority=sched.priority, on_step=_counter(slot, tally), decode_tokens=sched.decode_tokens)
    _settle(slot, len(requests), tally)
    return -result.steps, round(result.throughput, 6), -result.queue_delay


def _settle(slot: int, n: int, tally: _Tally | None) -> None:
    """A finished run counts all its requests (a run cut off at `max_steps` included)."""
    if tally is not None:
        if tally.counts[slot] != n:
            tally.report(slot, n)
    elif _worker_counts is not None:
        _worker_counts[slot] = n


class _Tally:
    """Settled counts per run, summed for the caller's `progress(done, total)`."""

    def __init__(self, runs: int, total: int, progress: ProgressFn | None, shared: bool) -> None:
        self.total = total
        self.progress = progress
        self.shared = shared
        self.counts: Any = multiprocessing.get_context().Array("q", runs, lock=False) if shared else [0] * runs
        self.done = 0

    def report(self, slot: int, n: int) -> None:
        """One process: run `slot` has settled `n` requests (called every step)."""
        self.done += n - self.counts[slot]
        self.counts[slot] = n
        if self.progress is not None:
            self.progress(self.done, self.total)

    def poll(self) -> None:
        """Worker processes: what they have written so far."""
        if self.progress is not None:
            self.progress(sum(self.counts), self.total)


def _map(fn: Callable, tasks: list, executor: ProcessPoolExecutor | None, tally: _Tally) -> list:
    """`fn` over `tasks` in order, here or in the workers; the workers' progress is read at least
    every `PROGRESS_POLL_S` while they run, and a failed run stops the wait at once."""
    if executor is None:
        return [fn(t, tally if tally.progress is not None else None) for t in tasks]
    futures: list[Future] = [executor.submit(fn, t) for t in tasks]
    pending = set(futures)
    try:
        while pending:
            finished, pending = wait(pending, timeout=PROGRESS_POLL_S, return_when=FIRST_COMPLETED)
            tally.poll()
            for f in finished:
                if f.exception() is not None:
                    raise f.exception()
    finally:
        for f in pending:
            f.cancel()
    return [f.result() for f in futures]


def _checked_arguments(decls, cfg, requests, pools, sched, jobs
                       ) -> tuple[list[KVLayerDecl], list[str], list[ScheduledRequest]]:
    """`compare`'s arguments checked before any pool runs (an InputError naming the argument), and
    its sequences as lists."""
    decls = checked_decls(decls, "decls")
    if not isinstance(cfg, PoolConfig):
        raise InputError(f"cfg must be a PoolConfig, got {cfg!r}")
    if not isinstance(sched, SchedulerConfig):
        raise InputError(f"sched must be a SchedulerConfig, got {sched!r}")
    if jobs is not None and (not is_integer(jobs) or jobs < 1):
        raise InputError(f"jobs must be None or a positive integer, got {jobs!r}")
    if isinstance(pools, str) or not isinstance(pools, Sequence):
        raise InputError(f"pools must be a sequence of pool names, got {pools!r}")
    for name in pools:
        if not isinstance(name, str) or name not in POOLS:
            raise InputError(f"unknown pool {name!r} (known: {', '.join(POOLS)})")
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise InputError(f"requests must be a list of ScheduledRequest, got {type(requests).__name__}")
    bad = next((i for i, r in enumerate(requests) if not isinstance(r, ScheduledRequest)), None)
    if bad is not None:
        raise InputError(f"requests must be a list of ScheduledRequest (from workload_from_name or load_trace), "
                         f"got {type(requests[bad]).__name__} at index {bad}")
    return decls, list(pools), list(requests)


def compare(decls: Sequence[KVLayerDecl], cfg: PoolConfig, requests: list[ScheduledRequest], pools: Sequence[str] = DEFAULT_POOLS,
            sched: SchedulerConfig = SchedulerConfig(), jobs: int | None = None,
            progress: ProgressFn | None = None) -> Comparison:
    """Run every pool in `pools` over `requests`; `jobs` worker processes (default: the cores).
    `progress(done, total)` hears the requests settled over every run: each step in one process,
    at least every `PROGRESS_POLL_S` seconds from worker processes."""
    decls, pools, requests = _checked_arguments(decls, cfg, requests, pools, sched, jobs)
    jobs = jobs or min(len(pools), os.cpu_count() or 1)
    best = None
    sweep: list[dict[str, float | None]] = []
    grid: list[StaticSplit] = []
    sample = requests[:SWEEP_REQUESTS]
    kinds = (False, False)  # whether the model has windows, state
    if "static-best" in pools:
        from ..plan import plan_kv_storage
        from .baselines import static_grid

        plan = plan_kv_storage(decls, page_size=cfg.page_size)
        grid = static_grid(plan)
        kinds = (bool(plan.windows), plan.state is not None)
    tally = _Tally(len(grid) + len(pools), len(grid) * len(sample) + len(pools) * len(requests), progress,
                   shared=jobs > 1 and progress is not None)
    jobs = min(jobs, len(grid) + len(pools))  # a worker past the runs would have nothing to do
    executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context(), initializer=_init_worker,
                                   initargs=(tally.counts if tally.shared else None,)) if jobs > 1 else None
    try:
        if grid:
            tasks = [(i, split, decls, cfg, sample, sched) for i, split in enumerate(grid)]
            scores = _map(_sweep_score, tasks, executor, tally)
            sweep = [{"window_ratio": s.window_ratio if kinds[0] else None,
                      "state_ratio": s.state_ratio if kinds[1] else None, "steps": -v[0]} for s, v in zip(grid, scores)]
            best = grid[max(range(len(grid)), key=lambda i: scores[i])]
        tasks = [(len(grid) + i, name, decls, cfg, best if name == "static-best" else None, requests, sched)
                 for i, name in enumerate(pools)]
        runs = _map(_run_one, tasks, executor, tally)
    finally:
        if executor:
            executor.shutdown()
    times = {r.pool: ends for r, _h, ends in runs if ends}
    return Comparison([r for r, _h, _e in runs], {r.pool: h for r, h, _e in runs}, best, sweep, times)


__all__ = ["Comparison", "SchedulerConfig", "compare", "static_best_split"]
