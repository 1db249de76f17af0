"""Idle stretches are skipped in one jump: the figures are those of stepping through them one by
one, and a sparse trace (`--rate 1e-12`, `--ms-per-step 1e-9`) finishes at once instead of hanging."""

from __future__ import annotations

import json
import time

import pytest

import kvchain.sim.runner as runner
from kvchain.cli import main


def _simulate(argv, capsys) -> list[dict]:
    assert main([*argv, "--json", "--jobs", "1"]) == 0
    return json.loads(capsys.readouterr().out)["results"]


def _close(a, b) -> bool:
    """Equal, floats up to rounding (an idle stretch's seconds are summed as one product)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-12)
    return a == b


@pytest.fixture()
def sparse_trace(tmp_path):
    """Bursts of requests with idle gaps of about a hundred steps between them."""
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": 5000 * (i // 3) + 7 * (i % 3), "input_length": 300 + 50 * i, "output_length": 5 + i,
              "hash_ids": [i % 2]} for i in range(12)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("pool", ["kvchain", "vllm-hybrid", "sglang-static", "ideal"])
def test_jumping_gives_the_figures_of_stepping(pool, sparse_trace, monkeypatch, capsys):
    argv = ["simulate", "--model", "gpt-oss-20b", "--budget", "1GiB", "--trace", str(sparse_trace),
            "--pools", pool, "--step-time", "base_ms=8,per_token_us=25"]
    jumped = _simulate(argv, capsys)
    monkeypatch.setattr(runner, "_idle_gap", lambda _sched: 0)
    stepped = _simulate(argv, capsys)
    assert _close(jumped, stepped)
    assert jumped[0]["steps"] > 300 and jumped[0]["finished"] == 12


def test_a_rate_of_one_request_in_a_trillion_steps_finishes(capsys):
    start = time.perf_counter()
    results = _simulate(["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat",
                         "--requests", "4", "--rate", "1e-12", "--pools", "kvchain,ideal",
                         "--step-time", "base_ms=8"], capsys)
    assert time.perf_counter() - start < 60
    for r in results:
        assert r["finished"] == 4 and r["steps"] > 10**11
        assert r["ttft_s"]["p99"] < 60  # the wait for an arrival is not charged to the request


def test_nanosecond_steps_on_a_trace_finish(sparse_trace, capsys):
    results = _simulate(["simulate", "--model", "gpt-oss-20b", "--budget", "1GiB", "--trace", str(sparse_trace),
                         "--ms-per-step", "1e-9", "--pools", "kvchain"], capsys)
    assert results[0]["finished"] == 12 and results[0]["steps"] > 10**12
