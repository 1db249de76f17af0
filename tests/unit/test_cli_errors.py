"""Every bad input of every command is one line on stderr and exit code 2, refused before any work:
a flag out of range, a size that would exhaust memory, a JSON file of the wrong shape or nested too
deeply, an output that could not be written, a flag that means nothing for the model."""

from __future__ import annotations

import json

import pytest

from kvchain.cli import main
from kvchain.testing.harness import seed_case

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture()
def files(tmp_path):
    """Bad inputs on disk, by name."""
    made = {}

    def put(name: str, text: str):
        made[name.replace(".", "_")] = tmp_path / name
        (tmp_path / name).write_text(text)

    put("deep.json", DEEP)
    put("deep.jsonl", DEEP + "\n")
    put("list.json", "[1, 2]")
    put("list.jsonl", "[1, 2]\n")
    put("huge.jsonl", json.dumps({"timestamp": 0, "input_length": 10**12, "output_length": 5}) + "\n")
    case = seed_case(0, 5).to_json()
    case["config"]["page_size"] = "4"
    put("case_str_field.json", json.dumps(case))
    case = seed_case(0, 5).to_json()
    case["config"]["rows"] = 0
    put("case_zero_rows.json", json.dumps(case))
    case = seed_case(0, 5).to_json()
    case["ops"][0] = {"op": "admit", "len": [3]}
    put("case_bad_op.json", json.dumps(case))
    case = seed_case(0, 5).to_json()
    case["config"]["timing"] = case["config"]["timing"][:1]
    put("case_one_timing.json", json.dumps(case))
    case = seed_case(0, 5).to_json()
    case["config"]["windows"] = [case["config"]["windows"][0][:2]]
    put("case_short_window.json", json.dumps(case))
    run = {"version": 1, "run": "x", "config": {"name": "x", "page_size": "4", "windows": [2], "state": True},
           "source": {}, "calls": []}
    put("run_str_field.jsonl", json.dumps(run) + "\n")
    run = {**run, "config": {**run["config"], "page_size": 4}, "calls": [{"step": 5}]}
    put("run_bad_call.jsonl", json.dumps(run) + "\n")
    put("afile", "x")
    put("empty.jsonl", "")
    put("hugeint.json", '{"x": ' + "9" * 5000 + "}")
    put("hugeint.jsonl", '{"x": ' + "9" * 5000 + "}\n")
    made["dir"] = tmp_path
    return made


@pytest.fixture()
def no_work(monkeypatch):
    """Any simulation, stress seed or trace recording started fails the test: refusals come first."""

    def refuse(*_a, **_k):
        raise AssertionError("work started before the input was checked")

    import kvchain.sim.compare
    import kvchain.testing.harness
    import kvchain.testing.trace

    monkeypatch.setattr(kvchain.sim.compare, "compare", refuse)
    monkeypatch.setattr(kvchain.testing.harness, "run_case", refuse)
    monkeypatch.setattr(kvchain.testing.trace, "record_runs", refuse)
    monkeypatch.setattr(kvchain.testing.trace, "replay", refuse)


SIM = ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "5", "--jobs", "1"]
LLAMA_SIM = ["simulate", "--model", "llama-3.1-8b", "--budget", "2GiB", "--jobs", "1"]
PLAN = ["plan", "--model", "gpt-oss-20b", "--budget", "8GiB"]

CASES = [
    ("deep-config", ["plan", "--config", "{deep_json}", "--budget", "8GiB"], "nested too deeply"),
    ("deep-trace", [*LLAMA_SIM, "--trace", "{deep_jsonl}"], "nested too deeply"),
    ("deep-replay", ["stress", "--replay", "{deep_json}"], "nested too deeply"),
    ("deep-compare", ["trace", "compare", "--trace", "{deep_jsonl}"], "nested too deeply"),
    ("budget-overflow", ["plan", "--model", "gpt-oss-20b", "--budget", "1e400"], "--budget"),
    ("budget-inf", ["plan", "--model", "gpt-oss-20b", "--budget", "inf"], "--budget"),
    ("budget-huge", [*SIM[:3], "--budget", "1e30", *SIM[5:]], "largest budget"),
    ("budget-pages", [*SIM[:3], "--budget", "1000TiB", *SIM[5:]], "pages"),
    ("trace-huge-request", [*LLAMA_SIM, "--trace", "{huge_jsonl}"], "most a request may hold"),
    ("requests", [*SIM, "--requests", "1000000000"], "--requests"),
    ("max-running", [*SIM, "--max-running", "1000000000"], "--max-running"),
    ("block-tokens", [*SIM, "--block-tokens", "1000000000000"], "--block-tokens"),
    ("stress-seeds", ["stress", "--seeds", "0:1000000000000"], "--seeds"),
    ("stress-ops", ["stress", "--ops", "1000000000"], "--ops"),
    ("record-steps", ["trace", "record", "--out", "{dir}/t.jsonl", "--steps", "1000000000"], "--steps"),
    ("plot-missing-folder", [*SIM, "--plot", "{dir}/missing/run.png"], "does not exist"),
    ("plot-suffix", [*SIM, "--plot", "{dir}/run.txt"], "unsupported suffix"),
    ("plot-folder", [*SIM, "--plot", "{dir}"], "is a folder"),
    ("bench-seed", ["bench", "alloc", "--seed", "-1"], "--seed"),
    ("bench-iters", ["bench", "alloc", "--iters", "99999999999999999999"], "--iters"),  # ran on for ever
    ("bench-batch", ["bench", "alloc", "--batch", "1000000"], "--batch"),
    ("bench-engine-seed", ["bench", "engine", "--seed", "-1"], "--seed"),
    ("simulate-seed", [*SIM, "--seed", "-1"], "--seed"),
    ("replay-list", ["stress", "--replay", "{list_json}"], "JSON list"),
    ("replay-field-type", ["stress", "--replay", "{case_str_field_json}"], "'page_size'"),
    ("replay-zero-rows", ["stress", "--replay", "{case_zero_rows_json}"], "'rows'"),
    ("replay-op-type", ["stress", "--replay", "{case_bad_op_json}"], "'len'"),
    ("replay-folder", ["stress", "--replay", "{dir}"], "folder"),
    ("replay-one-timing", ["stress", "--replay", "{case_one_timing_json}"], "config.timing"),
    ("replay-short-window", ["stress", "--replay", "{case_short_window_json}"], "config.windows[0]"),
    ("compare-list", ["trace", "compare", "--trace", "{list_jsonl}"], "JSON list"),
    ("compare-field-type", ["trace", "compare", "--trace", "{run_str_field_jsonl}"], "'page_size'"),
    ("compare-call-type", ["trace", "compare", "--trace", "{run_bad_call_jsonl}"], "calls[0].step"),
    ("stress-out-file", ["stress", "--seeds", "0:1", "--out", "{afile}"], "is a file"),
    ("record-out-folder", ["trace", "record", "--seeds", "0:1", "--out", "{dir}"], "is a folder"),
    ("record-out-missing", ["trace", "record", "--seeds", "0:1", "--out", "{dir}/no/t.jsonl"], "does not exist"),
    ("rate-nan", [*SIM, "--rate", "nan"], "--rate"),
    ("rate-zero", [*SIM, "--rate", "0"], "--rate"),
    ("ms-per-step-negative", [*SIM, "--ms-per-step", "-1"], "--ms-per-step"),
    ("rate-with-trace", [*LLAMA_SIM, "--trace", "{huge_jsonl}", "--rate", "1"], "--rate"),
    ("context-plan", [*PLAN, "--context", "100000000"], "maximum context"),
    ("context-simulate", [*SIM, "--context", "100000000"], "maximum context"),
    ("state-slots", [*PLAN, "--state-slots", "4"], "no recurrent state"),
    ("state-share", [*PLAN, "--state-share", "0.5"], "no recurrent state"),
    ("checkpoint-interval", [*PLAN, "--checkpoint-interval", "64"], "no recurrent state"),
    ("checkpoint-every", [*SIM, "--checkpoint-every", "64"], "no recurrent state"),
    ("duplicate-pools", [*SIM, "--pools", "kvchain,ideal,kvchain"], "more than once"),
    ("step-time-negative", [*SIM, "--step-time", "base_ms=-1"], "base_ms"),
    ("step-time-nan", [*SIM, "--step-time", "per_token_us=nan"], "per_token_us"),
    ("step-time-inf", [*SIM, "--step-time", "per_kv_token_ns=inf"], "per_kv_token_ns"),
    ("huge-int-config", ["plan", "--config", "{hugeint_json}", "--budget", "8GiB"], "invalid JSON"),
    ("huge-int-trace", [*LLAMA_SIM, "--trace", "{hugeint_jsonl}"], "invalid JSON"),
    ("huge-int-replay", ["stress", "--replay", "{hugeint_json}"], "invalid JSON"),
    ("huge-int-compare", ["trace", "compare", "--trace", "{hugeint_jsonl}"], "invalid JSON"),
    ("empty-model", ["plan", "--model", "", "--budget", "8GiB"], "''"),
    ("simulate-seed-huge", [*SIM, "--seed", str(2**64)], "--seed"),
    ("bench-seed-huge", ["bench", "alloc", "--seed", str(2**64)], "--seed"),
    ("spec-tokens-huge", [*SIM, "--spec-tokens", "99999999999999999999", "--spec-acceptance", "0.5"], "--spec-tokens"),
    ("pp-budget-pages", [*SIM[:3], "--budget", "1000TiB", *SIM[5:], "--pp", "2"], "pages"),
    ("partition-without-pp", [*PLAN, "--pp-partition", "12,12"], "--pp 2"),
    ("bench-repeats", ["bench", "moves", "--repeats", "100000000000"], "--repeats"),
    ("context-below-every-prompt", [*SIM, "--context", "1"], "none would be served"),
    ("compare-empty", ["trace", "compare", "--trace", "{empty_jsonl}"], "no runs"),
    ("budget-half-byte", [*PLAN[:3], "--budget", "0.5"], "at least one byte"),
    ("budget-pib", [*PLAN[:3], "--budget", "2PiB"], "1024TiB"),
    ("bench-pressure-roomy", ["bench", "alloc", "--profile", "roomy", "--pressure", "0.5"], "--pressure"),
    ("host-without-tree", [*SIM, "--host-budget", "1GiB", "--no-prefix-cache"], "--no-prefix-cache"),
    ("bench-pd-budget", ["bench", "pd", "--engine", "gloo", "--budget", "1"], "do not fit"),
    ("bench-pd-tokens", ["bench", "pd", "--engine", "gloo", "--tokens", "100000000000"], "do not fit"),
    ("pp-spec-tokens", [*SIM, "--pp", "2", "--spec-tokens", "2", "--spec-acceptance", "0.5"], "--spec-tokens"),
    ("pp-host-budget", [*SIM, "--pp", "2", "--host-budget", "1GiB"], "--host-budget"),
    ("pp-waiting-order", [*SIM, "--pp", "2", "--waiting-order", "longest-prefix"], "--waiting-order"),
    ("pp-eviction", [*SIM, "--pp", "2", "--eviction", "lru"], "--eviction"),
    ("step-time-twice", [*SIM, "--step-time", "base_ms=1,base_ms=2"], "more than once"),
    ("plot-empty", [*SIM, "--plot", ""], "empty path"),
    ("trace-empty", [*LLAMA_SIM, "--trace", ""], "empty path"),
    ("stress-out-empty", ["stress", "--seeds", "0:1", "--out", ""], "empty path"),
    ("min-rate-alone", ["stress", "--seeds", "0:1", "--min-rate", "0.5"], "--mutant-table"),
    ("replay-minimize", ["stress", "--replay", "{case_zero_rows_json}", "--minimize"], "--minimize"),
]


@pytest.mark.parametrize(("argv", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2_before_any_work(argv, needle, files, no_work, capsys):
    argv = [a.format(**files) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


def test_unwritable_output_is_refused_before_the_run(files, no_work, monkeypatch, capsys):
    """A folder the process may not write into (root can write anywhere, so the check is simulated)."""
    import os

    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)
    for argv in ([*SIM, "--plot", f"{files['dir']}/run.png"],
                 ["stress", "--seeds", "0:1", "--out", f"{files['dir']}/cases"],
                 ["trace", "record", "--seeds", "0:1", "--out", f"{files['dir']}/t.jsonl"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "writable" in err, err


def test_a_failing_recording_leaves_no_partial_trace(tmp_path, capsys):
    """`trace record` fails late on a page size no chain takes: the output file never appears."""
    out = tmp_path / "t.jsonl"
    assert main(["trace", "record", "--seeds", "0:1", "--steps", "10", "--out", str(out),
                 "--page-sizes", "16,1000000000000"]) == 2
    assert not out.exists() and not list(tmp_path.iterdir())
    assert capsys.readouterr().err.count("\n") == 1


def test_a_write_that_fails_at_the_end_is_one_line(files, monkeypatch, capsys):
    """A full disk or a read-only mount the checks up front cannot see: one line, exit 2."""
    import kvchain.testing.trace as trace

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device", "t.jsonl")

    monkeypatch.setattr(trace, "write_jsonl", full_disk)
    assert main(["trace", "record", "--seeds", "0:1", "--steps", "5", "--out", f"{files['dir']}/t.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "t.jsonl" in err, err


def test_stress_listings_and_replays_print_json_when_asked(tmp_path, capsys):
    """`--json` holds for every stress mode: the mutant list and a replay are one JSON document."""
    import json as _json

    assert main(["stress", "--list-mutants", "--json"]) == 0
    listed = _json.loads(capsys.readouterr().out)
    assert {"name", "target", "description"} <= set(listed["mutants"][0])
    case = tmp_path / "case.json"
    case.write_text(_json.dumps(seed_case(0, 5).to_json()))
    assert main(["stress", "--replay", str(case), "--json"]) == 0
    replayed = _json.loads(capsys.readouterr().out)
    assert replayed["ops"] == 5 and replayed["failure"] is None


def test_an_error_line_names_the_command_as_typed(tmp_path, capsys):
    """A refusal found while a sub-command runs names it whole (`kvchain trace compare:`), as
    argparse's own refusals do."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trace", "compare", "--trace", str(empty)]) == 2
    assert capsys.readouterr().err.startswith("kvchain trace compare: error: --trace"), "the sub-command is named"


@pytest.mark.parametrize(("argv", "listed"), [([], "{plan,models,"), (["bench"], "{alloc,moves,"),
                                               (["trace"], "{record,compare}")])
def test_a_missing_sub_command_lists_the_sub_commands(argv, listed, capsys):
    """Not argparse's internal name for them ("required: command", "required: action")."""
    from kvchain.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert listed in err and len(err.splitlines()) == 1 and "action" not in err
