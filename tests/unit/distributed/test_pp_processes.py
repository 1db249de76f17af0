"""Two pipeline stages as real processes over gloo on the loopback interface: each its own arena of
its own layers, the geometries all-gathered when the loop starts, each iteration's capacity digest
passed to the next stage."""

from __future__ import annotations

import multiprocessing as mp
import sys

from kvchain.dist.pp import StageLink, run_stage_processes
from kvchain.sim.pp import stage_process
from support.stages import spec, traffic

CHECKS = {"KVCHAIN_INVARIANT_CHECK": "1"}


def test_two_stage_processes_agree_on_every_iteration():
    """PP-2, PP-6, PP-10, PP-15: two stage processes run 300 iterations of mixed traffic with
    relief, retraction and compaction; the geometries each installed are the all-gathered ones,
    every iteration's digest agrees and both stages made the same decisions. Optimistic admission
    retracts decodes that cannot grow (exact admission, which reserves every output, never does)."""
    out = run_stage_processes(stage_process, 2, (spec(12, admission="optimistic"), traffic(), 300), timeout_s=120,
                              env=CHECKS)
    assert {s: status for s, (status, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    first, second = out[0][1], out[1][1]
    assert first["geometries"] == second["geometries"]
    assert first["geometries"][0]["arena_bytes"] != first["geometries"][1]["arena_bytes"]
    assert len(first["digests"]) == 300 and first["digests"] == second["digests"]
    assert first["decisions"] == second["decisions"] and first["finished"] > 10
    assert first["preemptions"] > 0 and first["moves"] > 0 and first["moves"] != second["moves"]
    assert not mp.active_children()


def test_a_corrupted_stage_fails_agreement_in_its_process():
    """PP-16, CHK-9: stage 1 corrupts its count before iteration 100; that iteration its digest
    differs from stage 0's and the process fails `chain.stage_capacity_agreement`. Every process
    is ended."""
    out = run_stage_processes(stage_process, 2, (spec(16), traffic(), 300, (1, 100)), timeout_s=120, env=CHECKS)
    status, text = out[1]
    assert status == "error" and "chain.stage_capacity_agreement: iteration 100: stage 1" in text, out
    assert not mp.active_children()


def _silent_stage(stage: int, n_stages: int, port: int) -> str | None:
    link = StageLink.join(stage, n_stages, port, timeout_s=2.0)
    try:
        return link.recv_previous() if stage == 1 else "silent"
    finally:
        if stage == 0:
            link.close()


def test_a_silent_previous_stage_makes_the_wait_raise():
    """A stage whose previous stage never sends raises within its bound instead of hanging."""
    out = run_stage_processes(_silent_stage, 2, timeout_s=30)
    assert out[1][0] == "error" and "did not finish within 2 s" in out[1][1], out
    assert not mp.active_children()


def test_two_stage_processes_keep_micro_batches_in_flight_and_agree():
    """LIFE-7, PP-15/16 across processes: each stage process keeps two micro-batches in flight on
    its own modeled device (other completion timing), with the barrier after each iteration's
    result processing: no forward reads another row's page table, and every iteration's digest
    agrees across the processes."""
    from kvchain.sim.pp_microbatch import microbatch_stage_process

    out = run_stage_processes(microbatch_stage_process, 2, (spec(16), 2, 200, 3), timeout_s=120, env=CHECKS)
    assert {s: status for s, (status, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    first, second = out[0][1], out[1][1]
    assert len(first["digests"]) == 200 and first["digests"] == second["digests"]
    assert first["mismatches"] == second["mismatches"] == []
    assert first["aborted_in_flight"] > 5 and first["finished"] > 10
    assert not mp.active_children()


#: set by the caller below: a stage process forked from the caller would inherit it
CALLER_MARK: str | None = None


def _report_mark(stage: int, n: int, port: int) -> tuple:
    import os

    return CALLER_MARK, os.environ.get("KVCHAIN_TEST_CALLER_ENV")


def test_stage_processes_start_clean_with_the_callers_environment(monkeypatch):
    """Stage processes come from the fork server: nothing the caller set after its imports reaches
    them (so no library state a caller's model run left, such as MKL's allocator table), while the
    caller's environment at the call does. A plain fork, the control, inherits the caller's state."""
    monkeypatch.setattr(sys.modules[__name__], "CALLER_MARK", "set in the caller")
    monkeypatch.setenv("KVCHAIN_TEST_CALLER_ENV", "now")
    clean = run_stage_processes(_report_mark, 2, timeout_s=60)
    assert clean == {0: ("ok", (None, "now")), 1: ("ok", (None, "now"))}, clean
    forked = run_stage_processes(_report_mark, 2, timeout_s=60, start_method="fork")
    assert forked[0] == ("ok", ("set in the caller", "now")), forked
    assert not mp.active_children()
