"""`kvchain simulate`: the JSON a script reads, the plot, and one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest

from kvchain.cli import main

SMALL = ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "30",
         "--jobs", "1"]


def test_json_has_every_pool_and_the_fields_scripts_read(capsys, tmp_path):
    plot = tmp_path / "run.png"
    assert main([*SMALL, "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["pool"] for r in out["results"]] == ["kvchain", "vllm-hybrid", "sglang-static", "ideal"]
    for r in out["results"]:
        for key in ("pool", "steps", "throughput", "mean_concurrency", "peak_running", "utilisation",
                    "preemptions", "aborted", "throughput_overall", "throughput_vs_kvchain", "steps_vs_kvchain",
                    "recomputed_tokens", "prefill_tokens", "ttft_steps", "tpot_steps"):
            assert key in r
        assert r["finished"] == 30
    assert out["static_best_split"] is None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_names_the_pools_and_the_split(capsys):
    assert main([*SMALL, "--pools", "kvchain,static-best", "--step-time", "base_ms=8"]) == 0
    out = capsys.readouterr().out
    assert "kvchain" in out and "static-best" in out and "static-best split" in out


def test_trace_replay(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 5000 * i, "input_length": 700, "output_length": 20,
                                         "hash_ids": [0, 100 + i]}) + "\n" for i in range(12)))
    assert main(["simulate", "--model", "llama-3.1-8b", "--budget", "2GiB", "--trace", str(trace), "--jobs", "1",
                 "--pools", "kvchain,static-default", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["finished"] == 12 for r in out["results"])
    assert out["results"][0]["hit_rate"] > 0.5  # a full-attention model reuses the shared first block


@pytest.mark.parametrize(("argv", "needle"), [
    (["--pools", "kvchain,nope"], "--pools"),
    (["--workload", "nope"], "nope"),
    (["--budget", "lots"], "--budget"),
    (["--step-time", "warp=9"], "step-time"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    base = [a for a in SMALL if a not in ("--budget", "2GiB")] if "--budget" in argv else SMALL
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*base, *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_trace_priorities_reach_the_scheduler(tmp_path, capsys):
    """A trace's `priority` field is read (lower is more important); `--admission exact` never
    preempts on its own, and with `--priority` the only preemptions are those that make room for
    a more important request."""
    from kvchain.sim.workloads import load_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 900, "output_length": 200,
                                         "priority": 2 - i % 3}) + "\n" for i in range(24)))
    assert sorted({r.priority for r in load_trace(trace)}) == [0, 1, 2]
    base = ["simulate", "--model", "llama-3.1-8b", "--budget", "1GiB", "--trace", str(trace), "--jobs", "1",
            "--pools", "kvchain", "--admission", "exact", "--json"]
    runs = []
    for extra in ([], ["--priority"]):
        assert main([*base, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out)["results"][0])
    plain, prio = runs
    assert plain["finished"] == prio["finished"] == 24
    assert plain["preemptions"] == 0
    assert prio["priority_preemptions"] > 0 and prio["preemptions"] >= prio["priority_preemptions"]
