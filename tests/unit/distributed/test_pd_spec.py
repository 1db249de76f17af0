"""Speculative decoding on PD nodes: the prefill node runs the draft over the prompts with the
target, the draft's KV (pages of the same fused plan) goes to the decode node with the target's,
and the decode node's rounds read it. Outputs are plain greedy decoding's; a draft that is the
target has every proposal accepted only if its KV came over whole."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace

import pytest

from kvchain.cli import main
from kvchain.dist.pd_engine import generate_pd
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.engine.speculative_draft import make_draft_checkpoint
from kvchain.errors import InputError
from support.engine import PAGE, checkpoint_dir, draft_dir, workload, write_prompts

CONFIG = EngineConfig(budget_bytes=8 * 2**20, page_size=PAGE, context_len=128, max_running=8, ignore_eos=True)


def _plain(family: str, requests) -> list[list[int]]:
    with Engine(checkpoint_dir(family), CONFIG) as engine:
        return [o.token_ids for o in engine.generate(requests).outputs]


@pytest.mark.parametrize("whole", [False, True])
def test_pd_with_a_draft_serves_plain_greedy_output(whole: bool) -> None:
    """Gemma 3 with its two-layer draft, and with a draft that is the whole target: the outputs are
    plain greedy decoding's; the whole-target draft has each of its proposals accepted, which it
    can only if the decode node's rounds read the prompt KV the prefill node's draft wrote."""
    requests = workload(6, seed=3)
    config = replace(CONFIG, draft_model_path=str(draft_dir("gemma3", whole)), num_speculative_tokens=3)
    pd = generate_pd(checkpoint_dir("gemma3"), config, requests, kind="gloo", timeout_s=180)
    assert [o.token_ids for o in pd.outputs] == _plain("gemma3", requests)
    stats = pd.stats
    assert stats.spec_rounds > 0 and stats.spec_proposed > 0 and stats.draft_forwards > 0
    if whole:
        assert stats.spec_accepted == stats.spec_proposed
    assert not mp.active_children()


def test_a_state_target_with_an_attention_draft_on_pd_nodes(tmp_path) -> None:
    """Qwen3-Next with a draft of its full-attention layer alone: the target's state goes over as
    without a draft, the draft's KV beside it, and the outputs are plain greedy decoding's."""
    draft = make_draft_checkpoint(checkpoint_dir("qwen3_next"), tmp_path / "draft", [3])
    requests = workload(4, seed=3)
    config = replace(CONFIG, draft_model_path=str(draft), num_speculative_tokens=2)
    pd = generate_pd(checkpoint_dir("qwen3_next"), config, requests, kind="gloo", timeout_s=180)
    assert [o.token_ids for o in pd.outputs] == _plain("qwen3_next", requests)
    assert pd.stats.spec_rounds > 0
    assert not mp.active_children()


def test_a_draft_with_recurrent_layers_is_refused_before_any_node_starts() -> None:
    """Such a draft steps its state on the prefix cache's checkpoint grid, which PD nodes do not keep."""
    config = replace(CONFIG, draft_model_path=str(draft_dir("qwen3_next")), num_speculative_tokens=2)
    with pytest.raises(InputError, match=r"a draft with recurrent layers .* on PD nodes"):
        generate_pd(checkpoint_dir("qwen3_next"), config, workload(2), kind="gloo")
    assert not mp.active_children()


def test_generate_pd_with_a_draft_on_the_command_line(tmp_path, capsys) -> None:
    requests = workload(4, seed=5)
    prompts = write_prompts(tmp_path / "p.jsonl", requests)
    args = ["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts), "--budget", "8MiB",
            "--page-size", str(PAGE), "--context", "128", "--ignore-eos", "--json"]
    capsys.readouterr()
    assert main([*args, "--pd", "--pd-engine", "gloo", "--draft-model-path", str(draft_dir("gemma3")),
                 "--num-speculative-tokens", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in out["outputs"]] == _plain("gemma3", requests)
    assert out["stats"]["acceptance_rate"] is not None and out["stats"]["spec_rounds"] > 0
