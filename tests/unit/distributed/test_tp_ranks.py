"""Tensor-parallel ranks: each rank its shard of the heads in its own arena, sized for the group's
least budget, the same decisions on every rank though their devices complete work at other times,
and an agreement check on every iteration's decision digest, in one process and across two
processes over gloo on the loopback interface."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from kvchain.alloc.stage_capacity import StageGeometry
from kvchain.dist.pp import run_stage_processes
from kvchain.dist.tp import RankLayoutError, RankLink, check_same_layout, first_difference
from kvchain.errors import InputError, InvariantError
from kvchain.sim.tp import (
    RankSpec,
    build_rank,
    layout_of,
    run_rank_processes,
    run_ranks_in_process,
)
from support.simworld import workload

#: a Nemotron-H-like hybrid: Mamba2 layers (4 heads, 2 groups) and attention with 2 KV heads
CONFIG = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*M-M*", "num_hidden_layers": 6,
          "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
          "max_position_embeddings": 512, "dtype": "bfloat16"}


def _spec(tp: int = 2, budgets=None, chain_kib: int = 60, admission: str = "optimistic") -> RankSpec:
    """Optimistic admission, which retracts a decode that cannot grow (exact admission never does)."""
    probe = RankSpec(CONFIG, tp, (2**30,) * tp)
    fixed = probe.sizing(2**30).fixed.total
    base = fixed + chain_kib * 1024
    return RankSpec(CONFIG, tp, tuple(budgets or (base + 8192 * r for r in range(tp))), admission=admission)


def _traffic(n: int = 60):
    return workload(3, n=n, max_prompt=60, max_output=40)


def test_each_rank_holds_its_shard_of_the_heads():
    """A rank's plan splits the KV heads and the Mamba2 state heads over the ranks: one rank's
    token and slot bytes are half of what one unsplit rank holds."""
    one = _spec(1).plan()
    two = _spec(2).plan()
    assert [p.name for p in one.sub_pools] == [p.name for p in two.sub_pools]
    for whole, shard in zip(one.sub_pools, two.sub_pools):
        assert shard.unit_bytes * 2 == whole.unit_bytes, whole.name


def test_ranks_size_for_the_least_budget_and_share_a_layout():
    """The ranks' budgets differ; each sizes for the least (the MIN-reduce), so their layouts are
    one; a rank sized for its own budget has another layout and is refused."""
    spec = _spec(2)
    assert spec.budgets[0] < spec.budgets[1]
    least = [build_rank(spec, r, min(spec.budgets)) for r in range(2)]
    check_same_layout([layout_of(p) for p in least])
    own = [build_rank(spec, r, spec.budgets[r]) for r in range(2)]
    with pytest.raises(RankLayoutError, match="rank 1's layout differs from rank 0's"):
        check_same_layout([layout_of(p) for p in own])


def test_ranks_with_different_timing_agree_in_process():
    """Two ranks in one process, each its own arena and a modeled device whose forwards take other
    times, serve mixed traffic with retractions and compaction; every iteration's decision digest
    agrees. (The serving loop processes each forward before it schedules again; the stress
    harness's processes, `test_stress_processes.py`, hold decisions under overlap, LIFE-40.)"""
    loops = run_ranks_in_process(_spec(2), _traffic(), 400)
    a, b = loops
    assert len(a.digests) > 100 and a.digests == b.digests
    assert a.summary()["decisions"] == b.summary()["decisions"]
    assert a.summary()["preemptions"] > 0 and a.summary()["finished"] > 20
    assert a.pool.chain.device.now != b.pool.chain.device.now  # the devices' clocks differ


def test_a_corrupted_rank_fails_agreement_naming_the_first_differing_decision():
    """Rank 1's count of live owner pages is corrupted before iteration 30: that iteration
    `tp.rank_agreement` fails and names the decision that differs."""
    with pytest.raises(InvariantError, match=r"tp.rank_agreement: iteration 30: rank 1's .* decision \d+: "
                                             r"rank 0 \('held'"):
        run_ranks_in_process(_spec(2), _traffic(), 400, corrupt=(1, 30))


def test_first_difference_names_the_decision():
    assert first_difference([[("take", 1), ("free", 2)], [("take", 1), ("free", 3)]]) == \
        "decision 1: rank 0 ('free', 2), rank 1 ('free', 3)"
    assert first_difference([[1, 2], [1]]) == "decision 1: rank 0 2, rank 1 '(none)'"
    assert first_difference([[1], [1]]) is None


def test_a_spec_needs_one_budget_per_rank():
    with pytest.raises(InputError, match="1 rank budgets for 2 ranks"):
        RankSpec(CONFIG, 2, (2**30,))


def test_two_rank_processes_agree_on_every_iteration():
    """Two rank processes over gloo, budgets MIN-reduced, run a few hundred
    iterations; each rank's arena holds half the heads' bytes per token, the layouts match,
    every iteration's digest agrees and both made the same decisions."""
    spec = _spec(2)
    out = run_rank_processes(spec, _traffic(), 400, timeout_s=120)
    assert {r: s for r, (s, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    a, b = out[0][1], out[1][1]
    assert a["budget"] == b["budget"] == min(spec.budgets)
    assert a["layout"] == b["layout"]
    whole = StageGeometry.of_chain(build_rank(_spec(1), 0, min(_spec(1).budgets)).chain, 0).bytes_per_token()
    assert a["bytes_per_token"] * 2 == whole
    assert len(a["digests"]) > 100 and a["digests"] == b["digests"]
    assert a["decisions"] == b["decisions"] and a["preemptions"] > 0
    assert not mp.active_children()


def test_a_corrupted_rank_process_fails_agreement():
    """Rank 0's count is corrupted before iteration 40: both processes fail `tp.rank_agreement`
    in that iteration, naming the first differing decision; every process is ended."""
    out = run_rank_processes(_spec(2), _traffic(), 400, corrupt=(0, 40), timeout_s=120)
    for rank in (0, 1):
        status, text = out[rank]
        assert status == "error" and "tp.rank_agreement: iteration 40: rank 1's" in text, out
        assert "decision" in text and "('held'" in text
    assert not mp.active_children()


#: how long the silent rank stays in the group without reducing
SILENT_S = 8.0


def _silent_rank(rank: int, n_ranks: int, port: int) -> tuple | str:
    link = RankLink.join(rank, n_ranks, port, timeout_s=1.0)
    if rank == 0:  # times its own reduce: the bound under test, apart from process start-up
        start = time.monotonic()
        try:
            link.min_reduce(rank)
        except RuntimeError as e:
            return "raised", time.monotonic() - start, str(e)
        return "returned", time.monotonic() - start, ""
    time.sleep(SILENT_S)  # alive, in the group, never reducing
    return "silent"


def test_a_silent_rank_makes_the_collective_raise():
    """A rank whose peer never joins the reduce raises within the group's bound (1 s) instead of
    waiting for the peer (which stays silent for 8 s)."""
    out = run_stage_processes(_silent_rank, 2, timeout_s=60)
    status, (outcome, seconds, text) = out[0]
    assert status == "ok" and outcome == "raised" and "timed out" in text.lower(), out
    assert seconds < SILENT_S / 2, out
    assert not mp.active_children()
