"""`measure_boundary_cost`: the arithmetic of its ratios, the round-robin order of its sides, and
the bypass it measures against, which stays on the one storage and inside the measurement."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvchain.bench.boundary_cost import BoundaryCost, checks_bypassed, measure_boundary_cost, pool_time_step
from kvchain.errors import InputError
from kvchain.storage import KVStorage
from support.chains import small_storage
from support.modeled import request


class _Pool:
    _checked = True


def test_sides_alternate_round_robin_and_the_ratios_are_checked_over_bypassed():
    pool = _Pool()
    seen = []

    def step() -> int:
        seen.append(pool._checked)
        return 130 if pool._checked else 100

    cost = measure_boundary_cost(step, pool, rounds=3, block=2)
    assert seen == [True, True, False, False, False, False, True, True, True, True, False, False]
    assert cost.checked_ns == (130,) * 6 and cost.bypassed_ns == (100,) * 6
    assert cost.ratio == pytest.approx(1.3) and cost.median_ratio == pytest.approx(1.3)
    assert pool._checked is True and "_checked" not in vars(pool)


def test_the_total_ratio_weighs_every_iteration_and_the_median_ratio_ignores_an_outlier():
    cost = BoundaryCost(checked_ns=(110, 110, 1000), bypassed_ns=(100, 100, 100))
    assert cost.ratio == pytest.approx(1220 / 300)
    assert cost.median_ratio == pytest.approx(1.1)
    report = cost.as_dict()
    assert report["iterations_per_side"] == 3 and report["checked_us_per_iter"] == pytest.approx(1220 / 3 / 1e3, abs=0.01)
    assert report["ratio"] == round(1220 / 300, 4) and report["median_ratio"] == 1.1


def test_a_measurement_needs_rounds_and_bypassed_time():
    with pytest.raises(InputError, match="at least one round"):
        measure_boundary_cost(lambda: 1, _Pool(), rounds=0)
    with pytest.raises(InputError, match="no pool time"):
        measure_boundary_cost(lambda: 0, _Pool(), rounds=2)


def test_pool_time_step_reports_what_the_driver_added_to_its_pool_time():
    class Driver:
        pool_ns = 1000

        def step(self):
            self.pool_ns += 250

    timed = pool_time_step(Driver())
    assert [timed(), timed()] == [250, 250]


def test_the_bypass_is_one_storage_s_and_ends_with_the_measurement():
    storage, other = small_storage(), small_storage()
    with checks_bypassed(storage):
        assert storage._checked is False and other._checked is True and KVStorage._checked is True
    assert storage._checked is True
    row, _ = request(storage, 3)
    with pytest.raises(InputError, match="named twice"):
        storage.alloc_decode(np.array([row, row]))


def test_a_storage_workload_measures_its_checks():
    storage = small_storage(rows=4, context=512)
    rows = np.array([request(storage, 3)[0] for _ in range(3)])

    def step() -> int:
        t0 = time.perf_counter_ns()
        storage.iteration_ids(storage.alloc_decode(rows), rows)
        storage.runner_ids(rows)
        storage.advance(rows)
        return time.perf_counter_ns() - t0

    cost = measure_boundary_cost(step, storage, rounds=20)
    assert len(cost.checked_ns) == len(cost.bypassed_ns) == 20
    assert storage.seq_len(int(rows[0])) == 3 + 40 and cost.ratio > 0
    storage.free_rows(rows)
    storage.check_idle()
