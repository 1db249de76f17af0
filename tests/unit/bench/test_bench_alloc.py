"""`kvchain bench alloc`: its figures are the arithmetic of the per-block timings it reports, its
pressure profile really is under pressure (and its roomy one is not), the static pool replays the
chain's decisions on pools sized to them, and the JSON keeps its schema. Nothing here asserts a
speed."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from kvchain.bench import alloc_table
from kvchain.bench.alloc import PROFILES, _Driver, bench_plan, run_alloc_bench
from kvchain.cli import main
from kvchain.errors import InputError
from support.output import assert_fits, rendered

ITERS, BLOCK = 60, 20

PROFILE_KEYS = {
    "profile", "budget_bytes", "static_pool_bytes", "kvchain_us_per_iter", "static_us_per_iter", "ratio",
    "kvchain_mean_us_per_iter", "static_mean_us_per_iter", "kvchain_block_us", "static_block_us",
    "utilisation_mean", "utilisation_min", "reliefs", "moves", "moved_bytes", "relocations", "requests_served",
    "preemptions", "admissions", "refused_takes", "boundary", "boundary_ratio",
}
BOUNDARY_KEYS = {"own_ratio", "own_ratio_warm", "own_ratio_total", "own_ratio_groups", "iterations", "pool_us_per_iter",
                 "checks_us_per_iter", "checks_warm_us_per_iter", "per_check", "samples_per_call", "timer_ns", "paired",
                 "twins"}
PAIRED_KEYS = {"rounds", "checked_us_per_iter", "bypassed_us_per_iter", "ratio", "median_ratio"}
TWIN_KEYS = {"rounds", "ratio", "median_ratio", "control_ratio", "control_median_ratio", "checked_us_per_iter",
             "bypassed_us_per_iter"}
#: the hot operations' checks the boundary's cost times, each called by the bench's iterations (its
#: `flush_opportunistic()` names no limit, the one value with nothing to check: `_check_flush` is not called)
HOT_CHECKS = {"_check_decode", "_check_written", "_check_iteration_ids", "_check_runner_ids", "_check_advance",
              "_check_free_rows", "_check_extend"}


@pytest.fixture(scope="module")
def result() -> dict:
    return run_alloc_bench(iters=ITERS, batch=64, block=BLOCK)


def test_json_schema(result: dict) -> None:
    assert next(iter(result)) == "headline"
    assert set(result) == {"headline", "iters", "batch", "page_size", "block", "pressure", "workload_peak_bytes",
                           "profiles"}
    assert set(result["headline"]) == {"worst_profile", "ratio", "kvchain_us_per_iter", "static_us_per_iter",
                                       "boundary_ratio", "boundary_profile"}
    assert tuple(result["profiles"]) == PROFILES
    for name, row in result["profiles"].items():
        assert set(row) == PROFILE_KEYS, name
        assert row["profile"] == name
        boundary = row["boundary"]
        assert set(boundary) == BOUNDARY_KEYS and set(boundary["paired"]) == PAIRED_KEYS, name
        assert set(boundary["twins"]) == TWIN_KEYS, name
        assert boundary["iterations"] == boundary["paired"]["rounds"] == boundary["twins"]["rounds"] == ITERS
        assert row["boundary_ratio"] == boundary["own_ratio"] > 1 and boundary["own_ratio_warm"] > 1
        assert boundary["own_ratio_groups"]["min"] <= boundary["own_ratio"] <= boundary["own_ratio_groups"]["max"]
        assert {n for n, c in boundary["per_check"].items() if c["calls_per_iter"] > 0} >= HOT_CHECKS, name
        assert boundary["checks_us_per_iter"] > 0 and boundary["checks_warm_us_per_iter"] > 0
    json.loads(json.dumps(result))  # plain JSON all the way down


def test_figures_are_medians_of_the_blocks(result: dict) -> None:
    for row in result["profiles"].values():
        kv, st = row["kvchain_block_us"], row["static_block_us"]
        assert len(kv) == len(st) == math.ceil(ITERS / BLOCK)
        assert row["kvchain_us_per_iter"] == pytest.approx(statistics.median(kv), abs=0.01)
        assert row["static_us_per_iter"] == pytest.approx(statistics.median(st), abs=0.01)
        # the ratio pairs each kvchain block with the static block that replayed the same iterations
        assert row["ratio"] == pytest.approx(statistics.median(k / s for k, s in zip(kv, st)), rel=1e-2)
        assert row["kvchain_mean_us_per_iter"] == pytest.approx(statistics.mean(kv), rel=1e-2)
        assert row["static_mean_us_per_iter"] == pytest.approx(statistics.mean(st), rel=1e-2)


def test_headline_is_the_worst_profile(result: dict) -> None:
    head = result["headline"]
    costliest = max(result["profiles"].values(), key=lambda r: r["boundary_ratio"])
    assert (head["boundary_profile"], head["boundary_ratio"]) == (costliest["profile"], costliest["boundary_ratio"])
    worst = max(result["profiles"].values(), key=lambda r: r["ratio"])
    assert head["worst_profile"] == worst["profile"]
    assert (head["ratio"], head["kvchain_us_per_iter"], head["static_us_per_iter"]) == (
        worst["ratio"], worst["kvchain_us_per_iter"], worst["static_us_per_iter"])


def test_pressure_profile_runs_full_and_relieves(result: dict) -> None:
    pressure = result["profiles"]["pressure"]
    assert pressure["utilisation_mean"] >= 0.9
    assert pressure["reliefs"] > 0 and pressure["moves"] > 0
    # every moved page is one page of some band: its bytes lie between the smallest and largest page
    pages = [p.page_bytes for p in bench_plan().sub_pools]
    assert min(pages) * pressure["moves"] <= pressure["moved_bytes"] <= max(pages) * pressure["moves"]
    assert pressure["refused_takes"] > 0 and pressure["preemptions"] <= pressure["refused_takes"]  # a preemption follows a refused decode
    assert pressure["budget_bytes"] < result["workload_peak_bytes"]


def test_roomy_profile_never_moves(result: dict) -> None:
    roomy = result["profiles"]["roomy"]
    assert roomy["reliefs"] == roomy["moves"] == roomy["moved_bytes"] == roomy["relocations"] == roomy["preemptions"] == 0
    assert roomy["refused_takes"] == 0
    assert roomy["utilisation_mean"] < 0.5


def test_a_scripted_driver_makes_the_decisions_it_is_given() -> None:
    """The static pool follows the chain's preemptions and admissions; a script it cannot follow
    (its pools too small) raises rather than serving another workload."""
    from kvchain.bench.alloc import CONTEXT_LEN, bench_plan, dry_run, roomy_static
    from kvchain.bench.static_pool import PeakTrackingPool, StaticPagedPool
    from kvchain.bench.workload import decode_heavy
    from kvchain.errors import CapacityError

    plan = bench_plan()
    stream = decode_heavy(64, 1, CONTEXT_LEN)
    sizing, pages = roomy_static(plan, 8)
    script = [(0, 8)] + [(0, 0)] * 5 + [(2, 1)] + [(0, 0)] * 3
    tracker = dry_run(PeakTrackingPool(plan, sizing, pages), False, 8, stream, 9, script)
    assert tracker.log == script
    assert len(tracker.rows) == 7  # eight admitted, two preempted, one (the first preempted) back
    tight = {name: max(1, n // 2) for name, n in tracker.pool.peak_pages.items()}
    with pytest.raises(CapacityError):
        dry_run(StaticPagedPool(plan, sizing, tight), False, 8, stream, 9, script)
    assert isinstance(tracker, _Driver)


def test_bad_input_is_refused() -> None:
    with pytest.raises(InputError):
        run_alloc_bench(iters=10, pressure=1.5)
    with pytest.raises(InputError):
        run_alloc_bench(iters=10, profiles=("busy",))


def test_cli_json_and_refusals(capsys) -> None:
    assert main(["bench", "alloc", "--iters", "10", "--batch", "16", "--profile", "roomy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["profiles"]) == ["roomy"] and out["headline"]["worst_profile"] == "roomy"
    for argv in (["--pressure", "0"], ["--pressure", "1.2"], ["--profile", "busy"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "alloc", *argv])
        assert exc.value.code == 2


def test_the_table_fits_100_columns_without_cutting_a_figure(result: dict) -> None:
    text = rendered(alloc_table(result))
    assert_fits(text)
    for row in result["profiles"].values():
        assert str(row["kvchain_us_per_iter"]) in text and str(row["ratio"]) in text


def test_the_title_is_one_line_of_prose_and_an_uncalled_check_has_no_time(result: dict, capsys) -> None:
    """The title wraps at 100 columns, not at the table's width ("kvchain bench alloc: batch 256,
    300 iterations," then "medians of blocks of 50; worst ratio 2.149" then "(pressure)"); a check
    the run never called has no time per call (null, not 0.0)."""
    from kvchain.bench import _print_titled, alloc_title

    _print_titled(alloc_title(result), alloc_table(result))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("kvchain bench alloc: batch") and "medians of blocks of" in first, first
    for profile in result["profiles"].values():
        for name, check in profile["boundary"]["per_check"].items():
            assert (check["us_per_call"] is None) == (check["calls_per_iter"] == 0), (name, check)
