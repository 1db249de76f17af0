"""Tensor-parallel ranks within pipeline stages (`kvchain generate --tp N --pp M`): one process per
stage and rank over gloo, each its stage's layers and its shard of their heads, the outputs
identical to one process."""

from __future__ import annotations

import json
import multiprocessing as mp

from kvchain.alloc.stage_capacity import StageGeometry
from kvchain.cli import main
from kvchain.dist.tp_pp_engine import generate_in_grid
from kvchain.engine.serve import Engine, EngineConfig
from support.engine import checkpoint_dir, gemma_six, workload, write_prompts

CHECKS = {"KVCHAIN_INVARIANT_CHECK": "1"}


def _config(**kw) -> EngineConfig:
    base = dict(budget_bytes=600 * 1024, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                ignore_eos=True, overlap=False)
    return EngineConfig(**{**base, **kw})


def test_two_stages_of_two_ranks_generate_what_one_process_does():
    """PP-1, PP-6, PP-15/16 with tensor-parallel ranks in each stage: a Gemma-3-like checkpoint split
    4/2 into two stages of two ranks. Each rank holds its stage's layers and half their heads (the
    stages' bytes per token, times the ranks, add up to one process's); each rank's stages agree on
    every step's capacity digest, each stage's ranks on every decision digest; all four processes
    sample exactly the tokens one process samples."""
    path, reqs = str(gemma_six()), workload(8)
    with Engine(path, _config()) as engine:
        one = engine.generate(reqs)
        whole = StageGeometry.of_chain(engine.storage.allocator, 0).bytes_per_token()
    runs = generate_in_grid(path, _config(), reqs, 2, 2, (4, 2), env=CHECKS)
    assert [(r.stage, r.rank, r.first_layer, r.last_layer) for r in runs] == [
        (0, 0, 0, 3), (0, 1, 0, 3), (1, 0, 4, 5), (1, 1, 4, 5)]
    s0r0, s0r1, s1r0, s1r1 = runs
    assert s0r0.bytes_per_token == s0r1.bytes_per_token == 2 * s1r0.bytes_per_token
    assert 2 * (s0r0.bytes_per_token + s1r0.bytes_per_token) == whole
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
        assert len(run.stage_digests) > 10
    assert s0r0.stage_digests == s1r0.stage_digests and s0r1.stage_digests == s1r1.stage_digests
    assert s0r0.rank_digests == s0r1.rank_digests and s1r0.rank_digests == s1r1.rank_digests
    assert not mp.active_children()


def test_generate_cli_with_tp_and_pp_prints_what_one_process_does(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", workload(3))
    argv = ["generate", "--model-path", str(checkpoint_dir("llama")), "--prompts", str(prompts), "--budget", "4MiB",
            "--page-size", "4", "--ignore-eos", "--no-overlap", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--tp", "2", "--pp", "2"]) == 0
    grid = json.loads(capsys.readouterr().out)
    assert grid["outputs"] == one["outputs"]
    assert [(p["stage"], p["rank"]) for p in grid["processes"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not mp.active_children()
