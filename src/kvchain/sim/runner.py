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
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from ..engine.protocol import Pool
from ..engine.request import Phase, ScheduledRequest
from ..engine.scheduler import Scheduler, SchedulerStats
from .waiting import scheduler_class


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step: a fixed launch cost, a cost per token computed and a cost per KV token read.
    A documented first-order model, not a measurement: off unless asked for."""

    base_ms: float = 8.0
    per_token_us: float = 25.0
    per_kv_token_ns: float = 4.0
    #: host-tier copies (backups, load-backs, swaps), either way: 40 ps a byte is 25 GB/s, a
    #: PCIe Gen4 x16 link's usable bandwidth; charged on top of the step, overlapping nothing
    per_host_byte_ps: float = 40.0

    def __post_init__(self) -> None:
        from ..errors import InputError

        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InputError(f"step-time model: {name} must be a finite number >= 0, got {value!r}")

    def seconds(self, computed_tokens: int, kv_tokens: int, copied_bytes: int = 0) -> float:
        return (self.base_ms / 1e3 + computed_tokens * self.per_token_us / 1e6 + kv_tokens * self.per_kv_token_ns / 1e9
                + copied_bytes * self.per_host_byte_ps / 1e12)

    @classmethod
    def parse(cls, text: str) -> StepTimeModel:
        from ..errors import InputError

        fields = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, _, value = part.partition("=")
            if key.strip() in fields:
                raise InputError(f"step-time model: {key.strip()} given more than once")
            if key.strip() not in cls.__dataclass_fields__:
                raise InputError(f"step-time model: unknown field {key.strip()!r} (use base_ms, per_token_us, "
                                 "per_kv_token_ns, per_host_byte_ps)")
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
    #: with a host tier (`sim/host_tier.py`): prompt tokens the host supplied at first admission
    #: (part of `hit_rate`), retracted requests' tokens swapped back instead of recomputed, and
    #: every byte copied between device and host; None without one
    host_hit_rate: float | None = None
    swapped_tokens: int | None = None
    host_copied_bytes: int | None = None
    host: dict | None = None

    @property
    def device_hit_rate(self) -> float:
        return self.hit_rate - (self.host_hit_rate or 0.0)

    def to_dict(self) -> dict:
        return asdict(self)


def run_pool(pool: Pool, requests: list[ScheduledRequest], *, max_batched_tokens: int = 8192, max_running: int = 256,
             step_time: StepTimeModel | None = None, max_steps: int = 10**7, priority: bool = False,
             on_step: Callable[[Scheduler], None] | None = None,
             record_ends: list[float] | None = None,
             decode_tokens: Callable[[ScheduledRequest], int] | None = None) -> tuple[PoolResult, SchedulerStats]:
    """Run fresh copies of `requests` through `pool` until every one finished, aborted or was
    rejected, or `max_steps` steps ran. Idle stretches (nothing running or waiting before the next
    arrival) are skipped in one jump and count as the idle steps they stand for, so a sparse
    trace costs what its busy steps cost. `on_step(scheduler)` is called after every step run (a
    progress hook); with the step-time model, `record_ends` (when given) receives the time each
    history record ends, in seconds, for a plot against time. `decode_tokens(req)`: the tokens a
    decode step yields (speculative decoding; default one)."""
    reqs = [copy.deepcopy(r) for r in requests]
    sched = scheduler_class(pool)(pool, max_batched_tokens=max_batched_tokens, max_running=max_running, priority=priority)
    sched.decode_tokens = decode_tokens
    sched.add(reqs)
    stepped: list[int] = []  # with the step-time model: the step numbers run, and when each ended
    ends: list[float] = []
    weights: list[int] = []  # steps each history record stands for (an idle jump: the steps it skipped)
    seconds = 0.0 if step_time is not None else None
    host = getattr(pool, "host_counters", None)
    copied_before = 0
    ran = 0
    while not sched.idle and ran < max_steps:
        gap = _idle_gap(sched)
        if gap:
            _skip_idle(sched, gap)
            weights.append(gap)
            if step_time is not None:
                seconds += gap * step_time.seconds(0, 0)
                if record_ends is not None:
                    record_ends.append(seconds)
            continue
        record = sched.step()
        ran += 1
        weights.append(1)
        if step_time is not None:
            kv = sum(r.computed for r in sched.running)
            copied = 0
            if host is not None:
                copied = host["copied_bytes"] - copied_before
                copied_before = host["copied_bytes"]
            seconds += step_time.seconds(record.output_tokens + record.prefill_tokens, kv, copied)
            stepped.append(record.step)
            ends.append(seconds)
            if record_ends is not None:
                record_ends.append(seconds)
        if on_step is not None:
            on_step(sched)
    stats = sched.stats
    hist = stats.history
    weighted = list(zip(hist, weights))
    saturated = [(h, w) for h, w in weighted if h.waiting > 0] or weighted
    sat_w = [w for _h, w in saturated]
    admitted = [r for r in reqs if r.admitted_step >= 0]
    prompt_tokens = sum(len(r.prompt) for r in admitted)
    result = PoolResult(
        pool=pool.name,
        requests=len(reqs),
        steps=stats.steps,
        throughput=_mean([h.output_tokens for h, _w in saturated], sat_w),
        mean_concurrency=_mean([h.running for h, _w in saturated], sat_w),
        peak_running=stats.peak_running,
        utilisation=_mean([h.utilisation for h, _w in saturated], sat_w),
        utilisation_mean=_mean([h.utilisation for h in hist], weights),
        throughput_overall=stats.output_tokens / max(stats.steps, 1),
        concurrency_overall=_mean([h.running for h in hist], weights),
        saturated_steps=sum(w for h, w in weighted if h.waiting > 0),
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
    if host is not None:
        result.host_hit_rate = host["host_hit_tokens"] / max(prompt_tokens, 1)
        result.swapped_tokens = host["swapped_tokens"]
        result.host_copied_bytes = host["copied_bytes"]
        result.host = pool.host_report()
    if step_time is not None:
        clock = _Clock(np.asarray(stepped, dtype=np.int64), np.asarray(ends), step_time.seconds(0, 0))
        last = sched.step_no - 1
        done = [r for r in reqs if r.first_token_step >= 0]
        result.ttft_s = _percentiles([clock.end(r.first_token_step) - clock.end(min(r.arrival, last) - 1)
                                      for r in done])
        result.tpot_s = _percentiles([(clock.end(r.finished_step) - clock.end(r.first_token_step)) / (r.generated - 1)
                                      for r in done if r.phase is Phase.FINISHED and r.generated > 1])
    return result, stats


def _idle_gap(sched: Scheduler) -> int:
    """Steps until the next arrival when nothing runs or waits (0 when there is work now)."""
    if sched.running or sched.waiting or not sched.pending:
        return 0
    return max(0, sched.pending[0].arrival - sched.step_no)


def _skip_idle(sched: Scheduler, gap: int) -> None:
    """Advance the scheduler over `gap` idle steps at once: one history record stands for them (its
    weight is the gap), the step counters move by the gap, and the policy sees its per-step updates:
    a policy's only per-step state is a ratio that reaches its floor after `decay_steps` steps, so
    replaying at most that many is exact."""
    from ..engine.scheduler import StepRecord

    for _ in range(min(gap, getattr(sched.policy, "decay_steps", 0) + 1)):
        sched.policy.on_step()
    sched.stats.history.append(StepRecord(sched.step_no, 0, 0, 0, 0, sched.pool.stats().utilisation))
    sched.stats.steps += gap
    sched.step_no += gap


@dataclass(frozen=True)
class _Clock:
    """When each step ends under the step-time model: the steps run, their end times, and what an
    idle step costs (the steps of a skipped stretch each cost that)."""

    steps: np.ndarray
    ends: np.ndarray
    idle_s: float

    def end(self, step: int) -> float:
        i = int(np.searchsorted(self.steps, step, side="right")) - 1
        if i < 0:
            return (step + 1) * self.idle_s
        return float(self.ends[i]) + (step - int(self.steps[i])) * self.idle_s


PERCENTILES = (50, 90, 99)


def _percentiles(values: list) -> dict[str, float]:
    if not values:
        return {}
    q = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, q)}


def _mean(values: list, weights: list | None = None) -> float:
    if not values:
        return 0.0
    return float(np.average(np.asarray(values, dtype=np.float64), weights=weights))
