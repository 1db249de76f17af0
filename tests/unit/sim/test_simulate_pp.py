"""`kvchain simulate --pp N`: kvchain's pipeline stages side by side, each its own layers and
arena, every stage's capacity digest checked every iteration; bad input is one line, exit 2."""

from __future__ import annotations

import json
import re

import pytest

from kvchain.alloc import stage_capacity
from kvchain.cli import main

BASE = ["simulate", "--model", "gemma-3-12b", "--budget", "3GiB", "--workload", "chat", "--requests", "12",
        "--page-size", "16", "--context", "4096"]


def test_stages_with_different_bytes_per_token_serve_the_workload(capsys):
    """A 26/22 split of Gemma 3 gives the stages different bytes per token and
    concurrencies; the run serves the least, every iteration's digests agree, every request ends."""
    assert main([*BASE, "--pp", "2", "--pp-partition", "26,22", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first, second = out["stages"]
    assert (first["first_layer"], first["last_layer"], second["first_layer"]) == (0, 25, 26)
    assert first["bytes_per_token"] > second["bytes_per_token"]
    assert out["concurrency"] == min(first["concurrency"], second["concurrency"])
    assert out["digests_agree"] and out["iterations_checked"] == out["steps"] > 0
    assert out["finished"] + out["rejected"] == 12 and out["finished"] >= 10


def test_the_text_report_names_each_stage(capsys):
    assert main([*BASE, "--pp", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines wrap at 100 columns
    assert "stage 0: layers 0..23" in out and "stage 1: layers 24..47" in out
    assert "concurrency after the MIN-reduce" in out and "agreed on all" in out
    # the budget in the header, arenas in binary units as `plan --pp` prints them (not raw bytes)
    assert re.search(r"· \d+\.\d\d GiB: 2 pipeline stages", out) and re.search(r"arena \d+\.\d\d [GM]iB", out), out


@pytest.mark.parametrize("level", ["0", "1"])
def test_a_diverging_stage_fails_the_run(level, monkeypatch, capsys):
    """PP-16: a stage whose digest differs fails `chain.stage_capacity_agreement` (exit 2, one
    line): in the iteration at check level 1, after the run at level 0."""
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", level)
    real = stage_capacity.StageCapacity.take_digest

    def skewed(self):
        out = real(self)
        return out if self.stage == 0 else "0" * len(out)

    monkeypatch.setattr(stage_capacity.StageCapacity, "take_digest", skewed)
    assert main([*BASE, "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chain.stage_capacity_agreement: iteration 0: stage 1" in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--pp", "2", "--pools", "kvchain,vllm-hybrid"], "only kvchain serves pipeline stages"),
    (["--pp", "2", "--pp-partition", "5,43"], "stage 0 (layers 0..4) has no full-attention layer"),
    (["--pp", "2", "--pp-partition", "20,20"], "48 in all"),
    (["--pp", "2", "--pp-partition", "24,x"], "--pp-partition"),
    (["--pp", "0"], "--pp"),
    (["--pp", "2", "--step-time", "base_ms=8"], "--step-time is not served"),
])
def test_bad_pp_input_is_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*BASE, *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
