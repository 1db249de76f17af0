"""A failure across processes is reported by its root cause: the process that failed first, not
the one with the lowest index nor the peer that failed because it did (`dist.pp.failures`)."""

from __future__ import annotations

import time

import pytest

from kvchain.cli import main
from kvchain.dist import pd_engine, pp_engine, tp_engine, tp_pp_engine
from kvchain.dist.pp import failures, run_stage_processes
from kvchain.engine.serve import EngineConfig

ROOT = "InputError: the root cause"
AFTER = "RuntimeError: the peer went away"


def _stage_one_fails_first(stage: int, n: int, port: int) -> None:
    if stage == 1:
        raise ValueError("the root cause")
    time.sleep(0.5)  # what a peer waiting on the link sees a moment later
    raise RuntimeError("the peer went away")


def test_failures_come_in_the_order_the_processes_failed():
    out = run_stage_processes(_stage_one_fails_first, 2, timeout_s=60)
    assert [(s, status) for s, status, _text in failures(out)] == [(1, "error"), (0, "error")]
    assert failures(out)[0][2] == "ValueError: the root cause"


def _reports(*order: int) -> dict:
    """A `run_stage_processes` result whose process `order[0]` failed first, the others after it."""
    return {s: ("error", ROOT if i == 0 else AFTER) for i, s in enumerate(order)}


def test_pd_names_the_node_that_failed_first(monkeypatch, capsys):
    """The prefill node fails first and the decode node after it: the line names the prefill first
    (it named the decode node first whatever happened)."""
    monkeypatch.setattr(pd_engine, "run_stage_processes", lambda *a, **k: _reports(0, 1))
    with pytest.raises(Exception) as e:
        pd_engine.generate_pd("unused", EngineConfig(), [], kind="gloo")
    assert str(e.value).startswith(f"generate --pd: the prefill node: {ROOT}; the decode node: {AFTER}")


@pytest.mark.parametrize(("engine", "call", "first", "named"), [
    (pp_engine, lambda: pp_engine.generate_in_stages("unused", EngineConfig(), [], 2), 1, "stage 1"),
    (tp_engine, lambda: tp_engine.generate_in_ranks("unused", EngineConfig(), [], 2), 1, "rank 1"),
    (tp_pp_engine, lambda: tp_pp_engine.generate_in_grid("unused", EngineConfig(), [], 2, 2), 2, "rank 0 of stage 1"),
], ids=["stages", "ranks", "grid"])
def test_split_engines_raise_the_first_failure(engine, call, first, named, monkeypatch):
    """A later process fails first and process 0 after it: the error is the first one's, in its own
    class (process 0's follow-on failure, the lowest index, was raised before)."""
    monkeypatch.setattr(engine, "run_stage_processes", lambda *a, **k: _reports(first, 0))
    with pytest.raises(Exception) as e:
        call()
    assert type(e.value).__name__ == "InputError" and str(e.value) == f"{named}: the root cause"


def test_the_cli_line_names_the_root_cause(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(pd_engine, "run_stage_processes", lambda *a, **k: _reports(0, 1))
    from kvchain.engine.tiny import make_checkpoint

    make_checkpoint("gemma3", tmp_path / "t")
    assert main(["generate", "--model-path", str(tmp_path / "t"), "--prompt", "ab", "--pd", "--pd-engine", "gloo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvchain generate: error: generate --pd: the prefill node: {ROOT}"), err
