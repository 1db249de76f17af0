"""What the API boundary's host checks cost a workload, measured against the same workload with them
bypassed, in one run.

The checks are always on in the library; only this measurement switches them off, on the one
`KVStorage` it is handed, through the private `_checked` flag (no setting a user could flip). One
workload runs on, and its iterations alternate in blocks between checked and bypassed, round-robin,
with the side that goes first swapping every round, so machine noise and the workload's drift (its
rows grow, requests come and go) hit both alike. A bypassed block is safe only for a workload whose
calls are valid: the checks never change the pool, so the two sides see the same pool states."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import InputError

#: one iteration of the workload; returns the nanoseconds it spent inside the pool
Step = Callable[[], int]


@dataclass(frozen=True)
class BoundaryCost:
    """Pool time of each checked and each bypassed iteration, in run order."""

    checked_ns: tuple[int, ...]
    bypassed_ns: tuple[int, ...]

    @property
    def ratio(self) -> float:
        """Checked pool time over bypassed pool time, in total: 1.03 is a 3% cost."""
        return sum(self.checked_ns) / sum(self.bypassed_ns)

    @property
    def median_ratio(self) -> float:
        """The median checked iteration over the median bypassed one: on a shared machine an
        iteration the scheduler interrupted inflates the totals but not the medians."""
        return statistics.median(self.checked_ns) / statistics.median(self.bypassed_ns)

    def as_dict(self) -> dict:
        n = len(self.checked_ns)
        return {
            "iterations_per_side": n,
            "checked_us_per_iter": round(sum(self.checked_ns) / n / 1e3, 2),
            "bypassed_us_per_iter": round(sum(self.bypassed_ns) / n / 1e3, 2),
            "ratio": round(self.ratio, 4),
            "median_ratio": round(self.median_ratio, 4),
        }


@contextlib.contextmanager
def checks_bypassed(storage) -> Iterator[None]:
    """The boundary's checks skipped on `storage` for the body (measurement only)."""
    storage._checked = False
    try:
        yield
    finally:
        del storage._checked  # back to the class's `True`


def measure_boundary_cost(step: Step, storage, rounds: int = 1000, block: int = 1,
                          bypass: Callable[[object], contextlib.AbstractContextManager] = checks_bypassed,
                          ) -> BoundaryCost:
    """Run `rounds` rounds of `block` checked and `block` bypassed iterations of `step`, the side
    that goes first alternating, and keep the pool time `step` reports for each iteration. One
    iteration per block (the default) pairs each checked iteration with its neighbour."""
    if rounds < 1 or block < 1:
        raise InputError(f"a boundary cost needs at least one round of one iteration, got {rounds} x {block}")
    spent: dict[bool, list[int]] = {True: [], False: []}
    for r in range(rounds):
        for checked in ((True, False) if r % 2 == 0 else (False, True)):
            with contextlib.nullcontext() if checked else bypass(storage):
                spent[checked] += [step() for _ in range(block)]
    if sum(spent[False]) <= 0 or statistics.median(spent[False]) <= 0:
        raise InputError("the workload reported no pool time in its bypassed iterations")
    return BoundaryCost(tuple(spent[True]), tuple(spent[False]))


def pool_time_step(driver, step: Callable[[], None] | None = None) -> Step:
    """A `Step` from a benchmark driver that accumulates its pool time in `driver.pool_ns` (the
    `kvchain bench alloc` drivers do): the iteration is `step` (default `driver.step`)."""
    run = driver.step if step is None else step

    def timed() -> int:
        before = driver.pool_ns
        run()
        return driver.pool_ns - before

    return timed
