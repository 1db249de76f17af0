"""`kvchain stress` and `kvchain trace`: flags, exit codes, the summary, saved cases and replays."""

from __future__ import annotations

import json

import pytest
import torch

from kvchain.cli import main
from kvchain.testing import checks
from kvchain.testing.mutants import MUTANTS


def test_stress_json_summary(capsys):
    """HARN-15: a seed range over some operations; the summary counts operations and failures by check."""
    assert main(["stress", "--seeds", "0:3", "--ops", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seeds"] == 3 and out["ops"] == 3 * 61 and out["failed_seeds"] == 0
    assert out["ops_per_second"] > 0 and set(out["failures_by_check"]) == set(checks.ALL_CHECKS)


def test_stress_table_and_jobs(capsys):
    """HARN-15: the summary table, with two worker processes."""
    assert main(["stress", "--seeds", "4:8", "--ops", "40", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    for text in ("operations per second", "failed seeds", *checks.CHECKS):
        assert text in out


def test_list_mutants_names_then_target(capsys):
    """HARN-15: `--list-mutants`, one per line (a description past 100 columns goes on indented
    below), the name (a lowercase identifier) first, then the check it targets."""
    assert main(["stress", "--list-mutants"]) == 0
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if not line.startswith(" ")]
    assert len(lines) == len(MUTANTS) >= 10
    for line in lines:
        name, target = line.split()[:2]
        assert name.isidentifier() and name.islower() and name in MUTANTS and target in checks.CHECKS


@pytest.mark.parametrize("argv", [
    ["stress", "--seeds", "x"], ["stress", "--seeds", "5:2"], ["stress", "--ops", "0"], ["stress", "--device", "tpu"],
    ["stress", "--mutant", "nope"], ["stress", "--frobnicate"],
    ["trace", "record", "--page-sizes", "1,x", "--out", "t.jsonl"], ["trace", "compare"],
    ["stress", "--replay", "/nonexistent/case.json"],
    ["stress", "--mutant", "read_after_settle", "--device", "threads"], ["stress", "--mutant-table", "--min-rate", "2"],
    # the table runs seeds: a saved case, shrinking and a folder for cases do not apply to it
    ["stress", "--mutant-table", "--mutant", "lose_move_copy", "--seeds", "0:1", "--ops", "5", "--minimize"],
    ["stress", "--mutant-table", "--mutant", "lose_move_copy", "--seeds", "0:1", "--ops", "5", "--out", "cases"],
    ["stress", "--mutant-table", "--mutant", "lose_move_copy", "--seeds", "0:1", "--ops", "5", "--replay",
     "tests/scenarios/stress_vacated_hole_count.json"],
])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    """HARN-15..17, TRACE-3: bad flags and unreadable inputs are one line on stderr and exit code 2."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_one_line_and_exit_2(capsys):
    """HARN-17: `--device cuda` where CUDA is absent says so in one line and exits 2."""
    assert main(["stress", "--device", "cuda", "--seeds", "0:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0]


def test_mutant_table_counts_catches_by_the_target_check(capsys):
    """HARN-15: `--mutant-table` runs each mutant over the seeds and counts the seeds its target check
    caught; `--min-rate` makes a mutant caught by fewer seeds exit 1."""
    argv = ["stress", "--mutant-table", "--mutant", "never_end_uses", "--seeds", "0:2", "--ops", "200", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["mutants"]
    assert row["mutant"] == "never_end_uses" and row["target"] == "ledger_leak" and row["seeds"] == 2
    assert row["caught"] == len(row["caught_seeds"]) >= 1 and set(row["caught_seeds"]) <= {0, 1}
    assert out["below_min_rate"] == []
    assert main(["stress", "--mutant-table", "--mutant", "reuse_vacated", "--seeds", "0:1", "--ops", "5",
                 "--min-rate", "0.5", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["below_min_rate"] == ["reuse_vacated"]
    assert main(["stress", "--mutant-table", "--mutant", "read_after_settle", "--device", "threads", "--seeds", "0:1"]) == 0
    assert "cannot show" in capsys.readouterr().out


def test_mutant_run_minimizes_saves_and_replays(tmp_path, capsys):
    """HARN-13, HARN-15, HARN-16: a mutant's failing seed is shrunk and saved; `--replay` reproduces it."""
    out = tmp_path / "cases"
    code = main(["stress", "--mutant", "skip_settle_wait", "--seeds", "3:4", "--ops", "200", "--minimize",
                 "--out", str(out), "--json"])
    assert code == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["failures_by_check"]["unordered_overlap"] == 1
    (failure,) = summary["failures"]
    assert failure["minimized_ops"] < 10
    case = json.loads((out / "seed3-unordered_overlap.json").read_text())
    assert case["mutant"] == "skip_settle_wait" and len(case["ops"]) == failure["minimized_ops"]
    assert main(["stress", "--replay", failure["case"]]) == 1
    text = capsys.readouterr().out
    assert "unordered_overlap" in text and "same failure as saved" in text


def test_trace_record_then_compare(tmp_path, capsys):
    """TRACE-3: `trace record --page-sizes ... --out` then `trace compare --trace` on the same checkout."""
    path = tmp_path / "base.jsonl"
    assert main(["trace", "record", "--page-sizes", "1,16", "--seeds", "0:1", "--steps", "40", "--out", str(path)]) == 0
    assert "recorded" in capsys.readouterr().out
    assert main(["trace", "compare", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matches" in out and "diverge" not in out
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["calls"][0]["result"] = "something else"
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert main(["trace", "compare", "--trace", str(path), "--json"]) == 1
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rows[0]["matches"] is False and rows[0]["divergence"]["call"] == 0
    assert all(r["matches"] for r in rows[1:])
