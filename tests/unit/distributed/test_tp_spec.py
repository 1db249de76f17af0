"""Speculative decoding on tensor-parallel ranks: the draft's heads split as the target's, its
layers in each rank's fused plan; every rank verifies and accepts the same proposals, and prints
plain greedy decoding's output."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from kvchain.alloc.stage_capacity import StageGeometry
from kvchain.cli import main
from kvchain.dist.tp_engine import generate_in_ranks
from kvchain.engine.serve import Engine, EngineConfig
from support.engine import checkpoint_dir, draft_dir, workload, write_prompts

BASE = dict(budget_bytes=8 * 2**20, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
            ignore_eos=True, overlap=False, checkpoint_interval=8)


def _plain(family: str, requests) -> list[list[int]]:
    with Engine(str(checkpoint_dir(family)), EngineConfig(**BASE)) as engine:
        return [o.token_ids for o in engine.generate(requests).outputs]


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "nemotron_h"])
def test_a_draft_on_two_ranks_serves_plain_greedy_output(family: str) -> None:
    """Gemma 3's windows, Qwen3-Next's DeltaNet and Nemotron-H's Mamba2 drafts, split over two
    ranks: each rank holds half the fused plan's bytes per token, the ranks' decisions agree every
    step, and both print plain greedy decoding's output."""
    requests = workload(6)
    config = EngineConfig(**BASE, draft_model_path=str(draft_dir(family)), num_speculative_tokens=3)
    with Engine(str(checkpoint_dir(family)), config) as one:
        whole = StageGeometry.of_chain(one.storage.allocator, 0).bytes_per_token()
    runs = generate_in_ranks(str(checkpoint_dir(family)), config, requests, 2)
    plain = _plain(family, requests)
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == plain
        assert run.result.stats.spec_rounds > 0
        assert run.bytes_per_token * 2 == whole
    assert runs[0].digests == runs[1].digests
    assert not mp.active_children()


def test_a_draft_that_is_the_target_is_always_right_on_every_rank() -> None:
    """Each rank's draft reads its own shard of the draft's KV heads: sharded otherwise (another
    rank's rows), the proposals would stop matching the target."""
    requests = workload(4)
    config = EngineConfig(**BASE, draft_model_path=str(draft_dir("gemma3", whole=True)), num_speculative_tokens=3)
    for run in generate_in_ranks(str(checkpoint_dir("gemma3")), config, requests, 2):
        stats = run.result.stats
        assert stats.spec_proposed > 0 and stats.spec_accepted == stats.spec_proposed
    assert not mp.active_children()


def test_generate_with_tp_and_a_draft_on_the_command_line(tmp_path, capsys) -> None:
    requests = workload(4, seed=5)
    prompts = write_prompts(tmp_path / "p.jsonl", requests)
    capsys.readouterr()
    assert main(["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts),
                 "--budget", "8MiB", "--page-size", "4", "--context", "128", "--ignore-eos", "--json", "--tp", "2",
                 "--draft-model-path", str(draft_dir("gemma3")), "--num-speculative-tokens", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in out["outputs"]] == _plain("gemma3", requests)
    assert out["stats"]["spec_rounds"] > 0
