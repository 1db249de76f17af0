"""`measure_boundary_cost`: the arithmetic of its own-time and paired ratios on a clock the test
drives, the clock's repeats kept out of the pool time and the checks' memo put back, and the bypass
and the clock staying on the one storage and inside the measurement."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvchain.bench.boundary_cost import (
    SAMPLES,
    BoundaryCost,
    TimerCost,
    check_names,
    checks_bypassed,
    checks_clocked,
    measure_boundary_cost,
    measure_twin_cost,
    pool_time_step,
)
from kvchain.errors import InputError
from kvchain.storage import KVStorage
from support.chains import small_storage
from support.modeled import request

NO_TIMER = TimerCost(0.0, 0.0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class _Pool:
    """A pool whose one check costs 50 ns the first time in a step and 10 ns when repeated, and
    counts its calls in its memo; its body costs 200 ns."""

    _checked = True
    _CHECK_MEMO = ("memo",)

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.memo = 0
        self.fresh = False
        self.seen: list[bool] = []
        self.memo_seen: list[int] = []

    def _check_rows(self, rows):
        if self._checked:
            self.memo_seen.append(self.memo)
            self.clock.now += 50 if self.fresh else 10
            self.fresh = False
            self.memo += 1
        return rows

    def step(self) -> int:
        t0 = self.clock.now
        self.fresh = True
        self.seen.append(self._checked)
        self._check_rows(1)
        self.clock.now += 200
        return self.clock.now - t0


def test_own_time_counts_the_call_as_it_ran_and_the_repeats_stay_out_of_the_pool_time():
    clock = _Clock()
    pool = _Pool(clock)
    cost = measure_boundary_cost(pool.step, pool, rounds=4, timer=NO_TIMER, group=2, clock=clock)
    # clocked: 50 (the call) + 4 x 10 (repeats, excluded) + 200 (body)
    assert cost.checked_ns == (250.0,) * 4
    assert cost.check_ns == (50.0,) * 4 and cost.warm_ns == (10.0,) * 4
    assert cost.own_ratio == pytest.approx(250 / 200) and cost.own_ratio_warm == pytest.approx(250 / 240)
    assert cost.by_check == {"_check_rows": (4, 200.0, 40.0)}
    # each repeat found the memo as the call did, and only the call's own move stayed
    assert pool.memo_seen[:2 * SAMPLES] == [0] * SAMPLES + [1] * SAMPLES
    assert pool.memo == 4 + 4  # four clocked calls, then four checked paired iterations
    # paired: unclocked checked iterations 250, bypassed 200, sides alternating by round
    assert cost.paired_checked_ns == (250.0,) * 4 and cost.bypassed_ns == (200.0,) * 4
    assert cost.ratio == pytest.approx(1.25) and cost.median_ratio == pytest.approx(1.25)
    assert pool.seen == [True] * 4 + [True, False, False, True, True, False, False, True]
    assert pool._checked is True and "_checked" not in vars(pool) and "_check_rows" not in vars(pool)


def test_the_timer_s_cost_comes_off_every_sample_and_the_wrapper_s_off_the_pool_time():
    clock = _Clock()
    pool = _Pool(clock)
    cost = measure_boundary_cost(pool.step, pool, rounds=2, timer=TimerCost(5.0, 20.0), group=2, clock=clock)
    assert cost.checked_ns == (230.0,) * 2 and cost.check_ns == (45.0,) * 2 and cost.warm_ns == (5.0,) * 2
    assert cost.own_ratio == pytest.approx(230 / 185)


def test_groups_take_the_median_and_a_short_last_group_joins_none():
    cost = BoundaryCost(checked_ns=(100,) * 6 + (1000,), check_ns=(10,) * 3 + (20,) * 3 + (500,),
                        warm_ns=(5,) * 7, paired_checked_ns=(1,), bypassed_ns=(1,), group=3)
    assert cost.group_ratios() == pytest.approx([300 / 270, 300 / 240])  # the seventh alone: under half a group
    assert cost.own_ratio == pytest.approx((300 / 270 + 300 / 240) / 2)
    assert cost.own_ratio_total == pytest.approx(1600 / (1600 - 590))
    report = cost.as_dict()
    assert report["own_ratio_groups"] == {"n": 2, "group": 3, "min": round(300 / 270, 4), "max": 1.25}
    assert report["checks_us_per_iter"] == round(590 / 7 / 1e3, 2) and report["iterations"] == 7


def test_a_measurement_needs_rounds_and_pool_time_beside_the_checks():
    with pytest.raises(InputError, match="at least one round"):
        measure_boundary_cost(lambda: 1, _Pool(_Clock()), rounds=0)
    with pytest.raises(InputError, match="no pool time"):
        measure_boundary_cost(lambda: 0, _Pool(_Clock()), rounds=2, timer=NO_TIMER)


def test_the_clock_s_own_cost_is_measured_small_and_non_negative():
    timer = TimerCost.measure(calls=50, repeats=3, clock=time.perf_counter_ns)
    assert 0 <= timer.inner_ns < 1e5 and 0 <= timer.outer_ns < 1e5


def test_pool_time_step_reports_what_the_driver_added_to_its_pool_time():
    class Driver:
        pool_ns = 1000

        def step(self):
            self.pool_ns += 250

    timed = pool_time_step(Driver())
    assert [timed(), timed()] == [250, 250]


def test_the_bypass_and_the_clock_are_one_storage_s_and_end_with_the_measurement():
    storage, other = small_storage(), small_storage()
    names = check_names(storage)
    assert {"_check_decode", "_check_extend", "_check_advance", "_check_free_rows", "_check_iteration_ids",
            "_check_runner_ids"} <= set(names)
    with checks_bypassed(storage), checks_clocked(storage):
        assert storage._checked is False and other._checked is True and KVStorage._checked is True
        assert all(name in vars(storage) and name not in vars(other) for name in names)
    assert storage._checked is True and not any(name in vars(storage) for name in names)
    row, _ = request(storage, 3)
    with pytest.raises(InputError, match="named twice"):
        storage.alloc_decode(np.array([row, row]))


def test_a_storage_workload_measures_its_checks_and_leaves_the_pool_intact():
    storage = small_storage(rows=4, context=512)
    rows = np.array([request(storage, 3)[0] for _ in range(3)])

    def step() -> int:
        t0 = time.thread_time_ns()
        storage.iteration_ids(storage.alloc_decode(rows), rows)
        storage.runner_ids(rows)
        storage.advance(rows)
        return time.thread_time_ns() - t0

    cost = measure_boundary_cost(step, storage, rounds=20, group=5)
    assert len(cost.checked_ns) == len(cost.paired_checked_ns) == len(cost.bypassed_ns) == 20
    calls = {name: n for name, (n, _own, _warm) in cost.by_check.items() if n}
    assert calls == {"_check_decode": 20, "_check_written": 20, "_check_iteration_ids": 20,
                     "_check_runner_ids": 20, "_check_advance": 20}
    assert storage.seq_len(int(rows[0])) == 3 + 60 and cost.own_ratio > 1 and SAMPLES > 1
    storage.free_rows(rows)
    storage.check_idle()


def test_twins_run_the_same_round_on_each_side_in_rotating_order_with_one_side_bypassed():
    """`measure_twin_cost`: every round steps each twin once, the first rotating; the bypassed
    twin's checks are off for the whole measurement and back on after; its ratios are checked
    over bypassed and checked over checked, in total and as the median round."""
    order: list[str] = []

    class Storage:
        _checked = True

    bypassed = Storage()
    seen: list[bool] = []

    def side(name: str, ns: list[int], storage=None):
        def step() -> int:
            order.append(name)
            if storage is not None:
                seen.append(storage._checked)
            return ns[len([o for o in order if o == name]) - 1]
        return step

    cost = measure_twin_cost(side("a", [12, 12, 12]), (side("b", [10, 10, 20], bypassed), bypassed),
                             side("c", [12, 12, 12]), rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert seen == [False] * 3 and bypassed._checked is True
    assert cost.ratio == pytest.approx(36 / 40) and cost.control_ratio == pytest.approx(1.0)
    d = cost.as_dict()
    assert d["median_ratio"] == pytest.approx(1.2) and d["control_median_ratio"] == pytest.approx(1.0)
    assert d["rounds"] == 3 and d["checked_us_per_iter"] == pytest.approx(0.01)
    order.clear()
    with pytest.raises(InputError):
        measure_twin_cost(side("a", [0]), (side("b", [0], bypassed), bypassed), side("c", [0]), rounds=1)
