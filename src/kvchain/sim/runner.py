"""Run a workload through one pool with the scheduler loop and summarise what it served.

The figures users quote lead: whole-run steps to serve the trace, the prefill tokens spent (and of
them, the tokens recomputed after retractions), preemptions, time to first token and time per
output token percentiles in steps, and, with the step-time model, the same in seconds with
output tokens per second. An optional step-time model turns steps into seconds (off by default).

Secondary: `throughput`, `mean_concurrency` and `utilisation` at saturation, over the steps that
ended with requests waiting, where what the pool holds, not what arrives, sets the pace (a pool
that never saturated reports its whole-run figures); `throughput_overall` and
`concurrency_overall` over the whole run; prefix-cache hit rate (prompt tokens the cache supplied
/ prompt tokens admitted), mean queueing delay in steps, aborts and rejections."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from ..engine.protocol import Pool
from ..engine.request import Phase, ScheduledRequest
from ..engine.scheduler import Scheduler, SchedulerStats


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step: a fixed launch cost, a cost per token computed and a cost per KV token read.
    A documented first-order model, not a measurement: off unless asked for."""

    base_ms: float = 8.0
    per_token_us: float = 25.0
    per_kv_token_ns: float = 4.0

    def seconds(self, computed_tokens: int, kv_tokens: int) -> float:
        return self.base_ms / 1e3 + computed_tokens * self.per_token_us / 1e6 + kv_tokens * self.per_kv_token_ns / 1e9

    @classmethod
    def parse(cls, text: str) -> StepTimeModel:
        from ..errors import InputError

        fields = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, _, value = part.partition("=")
            if key.strip() not in cls.__dataclass_fields__:
                raise InputError(f"step-time model: unknown field {key.strip()!r} (use base_ms, per_token_us, per_kv_token_ns)")
            try:
                fields[key.strip()] = float(value)
            except ValueError:
                raise InputError(f"step-time model: {key.strip()} needs a number, got {value!r}") from None
        return cls(**fields)


@dataclass
class PoolResult:
    pool: str
    requests: int
    steps: int
    throughput: float  # output tokens per step at saturation
    mean_concurrency: float  # running requests at saturation
    peak_running: int
    utilisation: float  # live bytes / budget at saturation
    utilisation_mean: float  # over the whole run
    throughput_overall: float
    concurrency_overall: float
    saturated_steps: int
    hit_rate: float
    queue_delay: float
    preemptions: int
    finished: int
    aborted: int
    rejected: int
    output_tokens: int
    prefill_tokens: int = 0
    recomputed_tokens: int = 0  # of prefill_tokens, computed again after a retraction
    priority_preemptions: int = 0
    ttft_steps: dict[str, float] = field(default_factory=dict)  # p50/p90/p99, arrival to first token
    tpot_steps: dict[str, float] = field(default_factory=dict)  # p50/p90/p99, per output token after it
    seconds: float | None = None
    tokens_per_second: float | None = None
    ttft_s: dict[str, float] | None = None
    tpot_s: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def run_pool(pool: Pool, requests: list[ScheduledRequest], *, max_batched_tokens: int = 8192, max_running: int = 256,
             step_time: StepTimeModel | None = None, max_steps: int = 10**7, priority: bool = False,
             on_step: Callable[[Scheduler], None] | None = None) -> tuple[PoolResult, SchedulerStats]:
    """Run fresh copies of `requests` through `pool` until every one finished, aborted or was rejected."""
    reqs = [copy.deepcopy(r) for r in requests]
    sched = Scheduler(pool, max_batched_tokens=max_batched_tokens, max_running=max_running, priority=priority)
    sched.add(reqs)
    ends: list[float] = []  # with the step-time model: the time each step ends
    seconds = 0.0 if step_time is not None else None
    while not sched.idle and sched.step_no < max_steps:
        record = sched.step()
        if step_time is not None:
            kv = sum(r.computed for r in sched.running)
            seconds += step_time.seconds(record.output_tokens + record.prefill_tokens, kv)
            ends.append(seconds)
        if on_step is not None:
            on_step(sched)
    stats = sched.stats
    hist = stats.history
    saturated = [h for h in hist if h.waiting > 0] or hist
    admitted = [r for r in reqs if r.admitted_step >= 0]
    prompt_tokens = sum(len(r.prompt) for r in admitted)
    result = PoolResult(
        pool=pool.name,
        requests=len(reqs),
        steps=stats.steps,
        throughput=_mean([h.output_tokens for h in saturated]),
        mean_concurrency=_mean([h.running for h in saturated]),
        peak_running=stats.peak_running,
        utilisation=_mean([h.utilisation for h in saturated]),
        utilisation_mean=_mean([h.utilisation for h in hist]),
        throughput_overall=stats.output_tokens / max(stats.steps, 1),
        concurrency_overall=_mean([h.running for h in hist]),
        saturated_steps=sum(h.waiting > 0 for h in hist),
        hit_rate=stats.cached_tokens / max(prompt_tokens, 1),
        queue_delay=float(np.mean([r.admitted_step - r.arrival for r in admitted])) if admitted else 0.0,
        preemptions=stats.preemptions,
        finished=sum(r.phase is Phase.FINISHED for r in reqs),
        aborted=sum(r.phase is Phase.ABORTED for r in reqs),
        rejected=sum(r.phase is Phase.REJECTED for r in reqs),
        output_tokens=stats.output_tokens,
        prefill_tokens=stats.prefill_tokens,
        recomputed_tokens=stats.recomputed_tokens,
        priority_preemptions=stats.priority_preemptions,
        ttft_steps=_percentiles([r.first_token_step - r.arrival + 1 for r in reqs if r.first_token_step >= 0]),
        tpot_steps=_percentiles([(r.finished_step - r.first_token_step) / (r.generated - 1)
                                 for r in reqs if r.phase is Phase.FINISHED and r.generated > 1]),
        seconds=seconds,
        tokens_per_second=(stats.output_tokens / seconds) if seconds else None,
    )
    if step_time is not None:
        end = np.asarray(ends)
        start = np.concatenate([[0.0], end[:-1]])  # when each step begins
        done = [r for r in reqs if r.first_token_step >= 0]
        result.ttft_s = _percentiles([end[r.first_token_step] - start[min(r.arrival, len(end) - 1)] for r in done])
        result.tpot_s = _percentiles([(end[r.finished_step] - end[r.first_token_step]) / (r.generated - 1)
                                      for r in done if r.phase is Phase.FINISHED and r.generated > 1])
    return result, stats


PERCENTILES = (50, 90, 99)


def _percentiles(values: list) -> dict[str, float]:
    if not values:
        return {}
    q = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, q)}


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else 0.0
