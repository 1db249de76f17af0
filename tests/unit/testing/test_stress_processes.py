"""The stress harness's two ranks as two real processes over gloo: the same operations, their
decision digests compared after every operation, and the check firing across processes."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from kvchain.cli import main
from kvchain.testing import checks, mutants
from kvchain.testing.harness import run_case, seed_case
from kvchain.testing.stress_processes import run_case_processes


def test_two_rank_processes_agree_after_every_operation():
    """Rank 0 and rank 1 of seed 0 run in two processes, each
    its own arena and a modeled device with its own completion timing; after each of 400
    operations and the final quiescence their digests (decisions, outcome, units held) agree."""
    case = seed_case(0, 400)
    result, out = run_case_processes(case)
    assert result.failure is None and result.ops_run == 401
    a, b = out[0][1], out[1][1]
    assert len(a["digests"]) == 401 and a["digests"] == b["digests"]
    assert result.stats["moves"] > 0
    assert not mp.active_children()


def test_a_decision_on_a_fired_event_diverges_across_processes():
    """LIFE-39, LIFE-40: with a free that decides on whether the running forward's event fired on
    this rank (`free_on_fired_event`), the processes' digests differ, at the operation where the
    in-process harness sees its two ranks diverge, and the finding names the differing decision."""
    case = seed_case(6, 160)
    case.mutant = "free_on_fired_event"
    with mutants.applied(case.mutant):
        local = run_case(case)
    assert local.failure is not None and local.failure.check == checks.RANK_DIVERGENCE
    result, _out = run_case_processes(case)
    assert result.failure is not None and result.failure.checks == (checks.RANK_DIVERGENCE,)
    assert result.failure.op == local.failure.op
    assert "decisions differ across processes: decision" in result.failure.findings[0].message
    assert not mp.active_children()


def test_a_corrupted_count_on_one_process_fires_the_check():
    """HARN-10: rank 1's count of live owner pages is corrupted before operation 60: that
    operation both processes stop with `rank_divergence`."""
    result, out = run_case_processes(seed_case(0, 80), corrupt=(1, 60))
    assert result.failure is not None and result.failure.op == 60
    assert checks.RANK_DIVERGENCE in result.failure.checks
    assert out[0][1]["failure"]["op"] == out[1][1]["failure"]["op"] == 60
    assert not mp.active_children()


def test_the_cli_runs_seeds_on_two_processes(capsys):
    assert main(["stress", "--processes", "2", "--seeds", "0:1", "--ops", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["processes"] == 2 and out["seeds"] == 1 and out["ops"] == 41 and out["failed_seeds"] == 0


def test_the_cli_reports_a_divergence_across_processes(capsys):
    assert main(["stress", "--processes", "2", "--seeds", "6:7", "--ops", "160", "--mutant", "free_on_fired_event",
                 "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["failures_by_check"]["rank_divergence"] == 1
    assert "across processes" in out["failures"][0]["describe"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--jobs", "2"], "drop --jobs"),
    (["--minimize"], "does not shrink"),
    (["--mutant-table"], "runs seeds"),
    (["--processes", "3"], "--processes"),
])
def test_bad_processes_input_is_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["stress", "--processes", "2", "--seeds", "0:1", *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
