"""What the API boundary's host checks cost a workload, in one run, two ways.

The checks are always on in the library. Each hot operation of `KVStorage` runs its checks as one
method (`_check_decode`, `_check_extend`, ...: every `_check_*` of the class) before its body, and
only this measurement touches them, on the one `KVStorage` it is handed:

- **own time** (the headline): the workload runs on with each `_check_*` call timed where it
  runs, on the inputs and pool state the operation really has, by a wrapper put on the instance,
  in the thread's CPU time (time the thread spent descheduled is neither the checks' nor the
  pool's). That sample, the check as it ran, counts. Then the call runs `SAMPLES - 1` times more
  on the same arguments, the checks' memo (`_CHECK_MEMO`) put back each time as the call found
  it, so each repeat does the call's own work; the median of the samples is printed beside
  (`own_ratio_warm`): what the checks compute without the cost of being first to touch the
  operation's code and arrays, a lower bound. The timer's cost, and that of calling a check that
  returns at once (what a bypassed call pays too), are measured on a no-op through the same
  wrapper and taken off every sample; the repeats and the wrapper come off the iteration's pool
  time. The cost is pool time over pool time less the checks, per group of iterations, the
  median over groups. Numerator and denominator come from the same calls of the same
  iterations, so what slows an iteration slows both, and the spread over groups is printed.
- **paired** (a cross-check): the whole iteration's pool time with the checks against the same
  workload with them bypassed (the private `_checked` flag, which the checks read first), one
  iteration each, the side that goes first swapping every round. Neighbouring iterations do
  different work (a request arrives in one and not the next), so this figure's spread across runs
  is several times the checks' cost; it tells a gross error in the own-time figure, not 3%.

- **twins** (the whole run's cost): three copies of the same workload on three pools built alike,
  stepped in lockstep, so every round's iteration does the same work on the same pool state on
  each: one checked, one with the checks bypassed, and a second checked one, the order rotating
  every round. Checked over bypassed is what the same run pays for its checks, the cache misses
  the checks cause included and none charged to them that the body pays anyway; checked over
  checked (A/A) is the figure's own noise, printed beside it.

A bypassed iteration is safe only for a workload whose calls are valid: the checks never change the
pool, so both sides see the same pool states."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import InputError

#: one iteration of the workload; returns the nanoseconds it spent inside the pool
Step = Callable[[], int]
#: checked iterations per group of the own-time ratio
GROUP = 20


def check_names(storage) -> tuple[str, ...]:
    """The boundary's check methods of `storage`'s class: every `_check_*`."""
    cls = type(storage)
    return tuple(sorted(n for n in dir(cls) if n.startswith("_check_") and callable(getattr(cls, n))))


#: samples per check call: the call itself and repeats on the same inputs and state
SAMPLES = 5
#: fields of a check's clock: first-sample ns, median-sample ns, calls, ns spent repeating
FIRST, MEDIAN, CALLS, EXCLUDED = range(4)


def _clocked(fn: Callable, acc: list[int], storage, samples: int = SAMPLES,
             clock: Callable[[], int] = time.thread_time_ns) -> Callable:
    """`fn`, timed where it runs and then `samples - 1` times more on the same arguments with
    `storage`'s check memo put back as the call found it (so each repeat does the call's work),
    adding to `acc` the call's own time, the median of the samples, one call, and the time spent
    repeating (which the pool time must not count)."""
    memo = getattr(type(storage), "_CHECK_MEMO", ())
    state = vars(storage)

    def timed(*args):
        t_pre = clock()
        found = [state.get(k) for k in memo]
        t0 = clock()
        out = fn(*args)
        t1 = clock()
        left = [state.get(k) for k in memo]
        times = [t1 - t0]
        for _ in range(samples - 1):
            for k, v in zip(memo, found):
                state[k] = v
            t2 = clock()
            fn(*args)
            times.append(clock() - t2)
        for k, v in zip(memo, left):
            state[k] = v
        times.sort()
        acc[FIRST] += t1 - t0
        acc[MEDIAN] += times[len(times) // 2]
        acc[CALLS] += 1
        acc[EXCLUDED] += (t0 - t_pre) + (clock() - t1)
        return out

    return timed


class _Memo:
    """A stand-in storage for the clock's own calibration: one memo field."""

    _CHECK_MEMO = ("_m",)

    def __init__(self) -> None:
        self._m = b""


def _noop(a, b=None):
    return a, b


@dataclass(frozen=True)
class TimerCost:
    """What the clock itself adds: `inner_ns` to each timed sample (the timer and the call of a
    check that returns at once: what a bypassed call pays too), `outer_ns` to the pool time around
    a clocked call beyond what the clock counts as excluded."""

    inner_ns: float
    outer_ns: float

    @classmethod
    def measure(cls, calls: int = 500, repeats: int = 15, clock: Callable[[], int] = time.thread_time_ns,
                ) -> TimerCost:
        """The least batch mean over `repeats` batches of `calls` on a no-op: the clock's cost
        when nothing interrupts it."""
        inner, outer = [], []
        for _ in range(repeats):
            acc = [0, 0, 0, 0]
            timed = _clocked(_noop, acc, _Memo(), clock=clock)
            t0 = clock()
            for _ in range(calls):
                timed(1, 2)
            t1 = clock()
            for _ in range(calls):
                _noop(1, 2)
            t2 = clock()
            inner.append(acc[MEDIAN] / calls)
            outer.append((t1 - t0 - acc[EXCLUDED] - (t2 - t1)) / calls)
        return cls(min(inner), max(0.0, min(outer)))


@dataclass(frozen=True)
class BoundaryCost:
    """Per clocked iteration, its pool time (net of the clock) and its checks' own time: each call's
    own sample (`check_ns`, the check as it ran) and the median of its samples (`warm_ns`); per
    paired round, the checked and the bypassed iteration's pool time; per check method, its calls
    and both times."""

    checked_ns: tuple[float, ...]
    check_ns: tuple[float, ...]
    warm_ns: tuple[float, ...]
    paired_checked_ns: tuple[float, ...]
    bypassed_ns: tuple[float, ...]
    by_check: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    timer: TimerCost = TimerCost(0.0, 0.0)
    group: int = GROUP

    def group_ratios(self, checks: tuple[float, ...] | None = None) -> list[float]:
        """Per group of `group` consecutive clocked iterations: pool time over pool time less the
        checks' time (`check_ns` unless given); a last group under half full joins no median."""
        checks = self.check_ns if checks is None else checks
        out = []
        for i in range(0, len(self.checked_ns), self.group):
            pool, own = self.checked_ns[i:i + self.group], checks[i:i + self.group]
            if len(pool) * 2 >= self.group or not out:
                out.append(sum(pool) / (sum(pool) - sum(own)))
        return out

    @property
    def own_ratio(self) -> float:
        """The headline: the median over groups of pool time over the same time less the checks'
        own, each call as it ran; 1.03 is a 3% cost."""
        return statistics.median(self.group_ratios())

    @property
    def own_ratio_warm(self) -> float:
        """As `own_ratio`, each call the median of its samples: what the checks compute, without
        the cost of being the first to touch the operation's code and arrays (a lower bound)."""
        return statistics.median(self.group_ratios(self.warm_ns))

    @property
    def own_ratio_total(self) -> float:
        return sum(self.checked_ns) / (sum(self.checked_ns) - sum(self.check_ns))

    @property
    def ratio(self) -> float:
        """Paired: checked pool time over bypassed pool time, in total."""
        return sum(self.paired_checked_ns) / sum(self.bypassed_ns)

    @property
    def median_ratio(self) -> float:
        """Paired: the median checked iteration over the median bypassed one."""
        return statistics.median(self.paired_checked_ns) / statistics.median(self.bypassed_ns)

    def as_dict(self) -> dict:
        n = len(self.checked_ns)
        groups = sorted(self.group_ratios())
        return {
            "own_ratio": round(self.own_ratio, 4),
            "own_ratio_warm": round(self.own_ratio_warm, 4),
            "own_ratio_total": round(self.own_ratio_total, 4),
            "own_ratio_groups": {"n": len(groups), "group": self.group, "min": round(groups[0], 4),
                                 "max": round(groups[-1], 4)},
            "iterations": n,
            "pool_us_per_iter": round(sum(self.checked_ns) / n / 1e3, 2),
            "checks_us_per_iter": round(sum(self.check_ns) / n / 1e3, 2),
            "checks_warm_us_per_iter": round(sum(self.warm_ns) / n / 1e3, 2),
            "per_check": {name: {"calls_per_iter": round(calls / n, 2),
                                 # a check the run never called has no time per call (null, not 0)
                                 "us_per_call": round(ns / calls / 1e3, 3) if calls else None,
                                 "warm_us_per_call": round(warm / calls / 1e3, 3) if calls else None}
                          for name, (calls, ns, warm) in sorted(self.by_check.items())},
            "samples_per_call": SAMPLES,
            "timer_ns": {"inner": round(self.timer.inner_ns, 1), "outer": round(self.timer.outer_ns, 1)},
            "paired": {
                "rounds": len(self.bypassed_ns),
                "checked_us_per_iter": round(sum(self.paired_checked_ns) / len(self.bypassed_ns) / 1e3, 2),
                "bypassed_us_per_iter": round(sum(self.bypassed_ns) / len(self.bypassed_ns) / 1e3, 2),
                "ratio": round(self.ratio, 4),
                "median_ratio": round(self.median_ratio, 4),
            },
        }


@contextlib.contextmanager
def checks_bypassed(storage) -> Iterator[None]:
    """The boundary's checks skipped on `storage` for the body (measurement only)."""
    storage._checked = False
    try:
        yield
    finally:
        del storage._checked  # back to the class's `True`


@contextlib.contextmanager
def checks_clocked(storage, accs: dict[str, list[int]] | None = None, samples: int = SAMPLES,
                   clock: Callable[[], int] = time.thread_time_ns) -> Iterator[dict[str, list[int]]]:
    """Every check method of `storage` clocked for the body (`_clocked`), adding to `accs` (per
    name, its clock; fresh unless given)."""
    accs = {name: [0, 0, 0, 0] for name in check_names(storage)} if accs is None else accs
    for name, acc in accs.items():
        setattr(storage, name, _clocked(getattr(storage, name), acc, storage, samples, clock))
    try:
        yield accs
    finally:
        for name in accs:
            delattr(storage, name)  # back to the class's method


def measure_boundary_cost(step: Step, storage, rounds: int = 1000,
                          bypass: Callable[[object], contextlib.AbstractContextManager] = checks_bypassed,
                          timer: TimerCost | None = None, group: int = GROUP,
                          clock: Callable[[], int] = time.thread_time_ns) -> BoundaryCost:
    """`rounds` clocked iterations of `step` in a row (the checks' memo as the workload leaves it,
    so each call finds what it would find unmeasured), keeping the pool time `step` reports (less
    the clock's repeats and cost) and the checks' own time (less the timer's); then `rounds`
    rounds of one checked and one bypassed iteration, unclocked, the side that goes first
    alternating. `clock` times the checks and must be the clock `step` times the pool with: the
    thread's CPU time by default, so time the thread spent descheduled counts on neither side."""
    if rounds < 1 or group < 1:
        raise InputError(f"a boundary cost needs at least one round and groups of one, got {rounds}, {group}")
    timer = TimerCost.measure(clock=clock) if timer is None else timer
    checked: list[float] = []
    own: list[float] = []
    warm: list[float] = []
    accs = {name: [0, 0, 0, 0] for name in check_names(storage)}
    with checks_clocked(storage, accs, clock=clock):
        for _ in range(rounds):
            before = [sum(a[i] for a in accs.values()) for i in range(4)]
            pool = step()
            d = [sum(a[i] for a in accs.values()) - before[i] for i in range(4)]
            checked.append(pool - d[EXCLUDED] - d[CALLS] * timer.outer_ns)
            own.append(max(0.0, d[FIRST] - d[CALLS] * timer.inner_ns))
            warm.append(max(0.0, d[MEDIAN] - d[CALLS] * timer.inner_ns))
    by_check = {name: (acc[CALLS], max(0.0, acc[FIRST] - acc[CALLS] * timer.inner_ns),
                       max(0.0, acc[MEDIAN] - acc[CALLS] * timer.inner_ns)) for name, acc in accs.items()}
    spent: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            with contextlib.nullcontext() if on else bypass(storage):
                spent[on].append(float(step()))
    if sum(checked) <= sum(own) or min(sum(spent[False]), statistics.median(spent[False])) <= 0:
        raise InputError("the workload reported no pool time beside its checks")
    return BoundaryCost(tuple(checked), tuple(own), tuple(warm), tuple(spent[True]), tuple(spent[False]),
                        by_check, timer, group)


@dataclass(frozen=True)
class TwinCost:
    """Per round, the pool time of the same iteration on the checked twin, the bypassed twin and
    the second checked twin (A/A)."""

    checked_ns: tuple[float, ...]
    bypassed_ns: tuple[float, ...]
    control_ns: tuple[float, ...]

    @staticmethod
    def _ratios(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float]:
        per_round = [x / y for x, y in zip(a, b, strict=True) if y > 0]
        return sum(a) / sum(b), statistics.median(per_round)

    @property
    def ratio(self) -> float:
        """Checked over bypassed, in total over the rounds: 1.03 is a 3% cost."""
        return self._ratios(self.checked_ns, self.bypassed_ns)[0]

    @property
    def control_ratio(self) -> float:
        """Checked over the second checked twin: what the figure moves with no cost to find."""
        return self._ratios(self.checked_ns, self.control_ns)[0]

    def as_dict(self) -> dict:
        ratio, median = self._ratios(self.checked_ns, self.bypassed_ns)
        control, control_median = self._ratios(self.checked_ns, self.control_ns)
        n = len(self.checked_ns)
        return {"rounds": n, "ratio": round(ratio, 4), "median_ratio": round(median, 4),
                "control_ratio": round(control, 4), "control_median_ratio": round(control_median, 4),
                "checked_us_per_iter": round(sum(self.checked_ns) / n / 1e3, 2),
                "bypassed_us_per_iter": round(sum(self.bypassed_ns) / n / 1e3, 2)}


def measure_twin_cost(checked: Step, bypassed: tuple[Step, object], control: Step, rounds: int = 1000,
                      bypass: Callable[[object], contextlib.AbstractContextManager] = checks_bypassed,
                      ) -> TwinCost:
    """`rounds` rounds of one iteration on each of three twins of one workload (`bypassed` with its
    storage, whose checks are bypassed for the whole measurement), the order rotating each round
    so no twin always goes first."""
    if rounds < 1:
        raise InputError(f"a twin cost needs at least one round, got {rounds}")
    step_b, storage_b = bypassed
    sides: list[Step] = [checked, step_b, control]
    spent: list[list[float]] = [[], [], []]
    with bypass(storage_b):
        for r in range(rounds):
            for k in range(3):
                i = (r + k) % 3
                spent[i].append(float(sides[i]()))
    if min(sum(x) for x in spent) <= 0:
        raise InputError("the workload reported no pool time")
    return TwinCost(tuple(spent[0]), tuple(spent[1]), tuple(spent[2]))


def pool_time_step(driver, step: Callable[[], None] | None = None) -> Step:
    """A `Step` from a benchmark driver that accumulates its pool time in `driver.pool_ns` (the
    `kvchain bench alloc` drivers do): the iteration is `step` (default `driver.step`)."""
    run = driver.step if step is None else step

    def timed() -> int:
        before = driver.pool_ns
        run()
        return driver.pool_ns - before

    return timed
