"""The engine's heads split across tensor-parallel rank processes over gloo: each rank its shard
of the weights and a pool of its shard of the KV heads, the partial outputs all-reduced after
attention and the MLP, the outputs identical to one process."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch.distributed as dist

from kvchain.alloc.stage_capacity import StageGeometry
from kvchain.cli import main
from kvchain.dist import tp_engine as tp
from kvchain.dist.tp_engine import generate_in_ranks
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.errors import KVChainError
from support.engine import (
    INDEXED_FAMILIES,
    LOGIT_TOL,
    checkpoint_dir,
    every_token_indexed_dir,
    workload,
    write_prompts,
)


def _config(**kw) -> EngineConfig:
    base = dict(budget_bytes=4 * 2**20, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                ignore_eos=True, keep_logits=True, overlap=False)
    return EngineConfig(**{**base, **kw})


#: attention-free families: with no token bytes to weigh a state slot against, the pool's default
#: checkpoint interval outgrows a step's 64 tokens (which it refuses), so they checkpoint every 8
_ATTENTION_FREE = {family: {"checkpoint_interval": 8} for family in ("mamba2", "mamba", "falcon_mamba")}
#: Zamba2's state in every one of its six layers leaves a 4 MiB pool too small to admit a prompt
_FAMILY_CONFIG = {**_ATTENTION_FREE, "zamba2": {"budget_bytes": 8 * 2**20}}


def test_two_ranks_generate_what_one_process_does():
    """Gemma 3 (window and full attention) on two ranks: each rank's pool holds half the bytes per
    token, every step's decision digests agree, and both ranks sample the tokens one process
    samples, their logits within the engine's tolerance of one process's."""
    path, reqs = str(checkpoint_dir("gemma3")), workload(8)
    with Engine(path, _config()) as engine:
        one = engine.generate(reqs)
        whole = StageGeometry.of_chain(engine.storage.allocator, 0).bytes_per_token()
    runs = generate_in_ranks(path, _config(), reqs, 2)
    assert [r.bytes_per_token * 2 for r in runs] == [whole, whole]
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
        assert max(float((run.result.logits[k] - one.logits[k]).abs().max()) for k in one.logits) < LOGIT_TOL["gemma3"]
    assert len(runs[0].digests) == runs[0].result.stats.steps > 10 and runs[0].digests == runs[1].digests
    assert not mp.active_children()


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "nemotron_h", "lfm3", "bamba", "granitemoehybrid",
                                    "mamba2", "qwen3_5", "qwen3_5_moe", "lara_mini", "olmo_hybrid", "olmo3",
                                    "mamba", "falcon_mamba", "jamba", "lfm2", "falcon_h1",
                                    "minimax", "recurrent_gemma", "zamba2", "zamba", "llama4", "mimo_v2_flash"])
def test_every_family_on_two_ranks_generates_what_one_process_does(family):
    """The other tiny families, each split its own way (`tp_shard`): GPT-OSS's sinks and fused
    experts, Qwen3-Next's gated query, DeltaNet heads and experts beside a shared expert,
    Nemotron-H's, Bamba's, Granite's and Mamba2's groups, LFM's short convolutions and gated
    attention, Qwen3.5's, Lara Mini's and OLMo Hybrid's DeltaNet projections apart, OLMo's q/k
    norms over every head, Mamba1's inner channels (Falcon-Mamba's and Jamba's dt/B/C norms after
    `x_proj`'s sum), LFM2's attention with its `out_proj`, Falcon-H1's Mamba2 groups with their
    mup multipliers and group-count norm beside its attention, MiniMax's lightning heads with their
    slopes and norm over every head, RecurrentGemma's RG-LRU heads (its block numbered by name),
    Zamba2's Mamba2 groups and shared blocks with their per-use LoRA adapters, Zamba's per-head
    Mamba beside its shared attention, Llama 4's experts (`[E, hidden, 2I]`) beside its chunked
    attention, MiMo-V2-Flash's values narrower than its keys. Each rank holds half the pool's bytes per token, the ranks'
    digests agree every step, and both sample the tokens one process samples (every request
    admitted), their logits within the family's tolerance."""
    path, reqs, config = str(checkpoint_dir(family)), workload(4), _config(**_FAMILY_CONFIG.get(family, {}))
    with Engine(path, config) as engine:
        one = engine.generate(reqs)
        whole = StageGeometry.of_chain(engine.storage.allocator, 0).bytes_per_token()
    assert all(o.token_ids for o in one.outputs)  # every request admitted, none rejected
    runs = generate_in_ranks(path, config, reqs, 2)
    for run in runs:
        assert run.bytes_per_token * 2 == whole
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
        assert max(float((run.result.logits[k] - one.logits[k]).abs().max()) for k in one.logits) < LOGIT_TOL[family]
    assert runs[0].digests == runs[1].digests and len(runs[0].digests) == runs[0].result.stats.steps
    assert not mp.active_children()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite", "longcat_flash", "minicpm3", "youtu",
                                    "kimi_linear", "deepseek_v32", "glm_moe_dsa", "bailing_hybrid", "hy_v4"])
def test_latent_attention_on_two_ranks_generates_what_one_process_does(family):
    """DeepSeek-V3's, LongCat-Flash's and Kimi Linear's latent attention split by query heads: each
    rank computes its heads from the whole latent, so each rank's pool holds all of the bytes per
    token (the latent is not split), and both sample the tokens one process samples. LongCat-Flash's
    identity experts pass their tokens through on rank 0 only (summed on both ranks, they diverged
    at the fifth token); Kimi Linear's delta-attention layers split by heads beside them.
    DeepSeek-V3.2's and GLM-5's indexers run whole on every rank (their keys beside the whole latent);
    their top-k reaches every token here, since the ranks' all-reduced sums differ from one process's
    in the last bits, which can flip a pick on a near-tie (`test_engine_families.py`)."""
    dir_of = every_token_indexed_dir if family in INDEXED_FAMILIES else checkpoint_dir
    path, reqs = str(dir_of(family)), workload(4)
    with Engine(path, _config()) as engine:
        one = engine.generate(reqs)
        whole = StageGeometry.of_chain(engine.storage.allocator, 0).bytes_per_token()
    runs = generate_in_ranks(path, _config(), reqs, 2)
    for run in runs:
        assert run.bytes_per_token == whole
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
        assert max(float((run.result.logits[k] - one.logits[k]).abs().max()) for k in one.logits) < LOGIT_TOL[family]
    assert runs[0].digests == runs[1].digests
    assert not mp.active_children()


def test_a_layer_left_whole_is_refused_before_any_rank_starts(monkeypatch):
    """A pool layer whose kind the shard does not recognise would keep its whole heads against the
    pool's shard of them: `check_tp_split` names it before any rank process starts."""
    from kvchain.dist import tp_shard
    from kvchain.engine.checkpoint import load_checkpoint

    real = tp_shard._kind
    monkeypatch.setattr(tp_shard, "_kind", lambda m: None if real(m) == "deltanet" else real(m))
    checkpoint = load_checkpoint(checkpoint_dir("qwen3_next"))
    with pytest.raises(KVChainError, match=r"--tp 2: layers \[0, 1, 2\] hold KV or state in a form not split"):
        tp.check_tp_split(checkpoint, _config(), 2)


@pytest.mark.parametrize(("family", "layers"), [("falcon_h1", "0, 1, 2, 3"), ("zamba2", "1, 3, 5")])
def test_an_unsplit_attention_beside_a_split_mixer_is_refused(family, layers, monkeypatch):
    """Falcon-H1's and Zamba2's layers hold KV beside state: a split mixer does not make up for an
    attention the shard does not recognise (here every attention's kind taken away), whose whole
    heads would meet the pool's shard of them."""
    from kvchain.dist import tp_shard
    from kvchain.engine.checkpoint import load_checkpoint

    real = tp_shard._kind
    monkeypatch.setattr(tp_shard, "_kind", lambda m: None if real(m) == "attention" else real(m))
    checkpoint = load_checkpoint(checkpoint_dir(family))
    with pytest.raises(KVChainError, match=rf"--tp 2: layers \[{layers}\] hold KV or state in a form not split"):
        tp.check_tp_split(checkpoint, _config(), 2)


@pytest.mark.parametrize(("family", "kind", "layers"), [("falcon_h1", "mamba2", "0, 1, 2, 3"),
                                                     ("recurrent_gemma", "rglru", "0, 1, 3"),
                                                     ("zamba", "zamba", "0, 1, 2, 3")])
def test_a_mixer_the_shard_does_not_split_is_refused_in_one_line(family, kind, layers, monkeypatch):
    """A recurrent mixer the shard has no split for (here its kind taken out of `_SPLIT_MIXERS`) is
    not split as a look-alike: it is refused, naming its layers, before any rank starts; so too
    where its layer's attention splits beside it (Falcon-H1's, Zamba's shared block) and where its
    block keeps no layer index until the engine numbers it (RecurrentGemma's)."""
    from kvchain.dist import tp_shard
    from kvchain.engine.checkpoint import load_checkpoint

    monkeypatch.delitem(tp_shard._SPLIT_MIXERS, kind)
    checkpoint = load_checkpoint(checkpoint_dir(family))
    with pytest.raises(KVChainError, match=rf"--tp 2: layers \[{layers}\] hold KV or state in a form not split") as info:
        tp.check_tp_split(checkpoint, _config(), 2)
    assert "\n" not in str(info.value)


def _skewed_rank(*args):
    """A rank process whose rank 1 reports one more live page than it holds."""
    from kvchain.dist import tp_engine

    real = tp.shared_counts

    def skewed(chain):
        counts = real(chain)
        if dist.get_rank() == 1:
            counts = type(counts)((counts.held[0] + 1, *counts.held[1:]), counts.virtual_held, counts.slots_held,
                                  counts.frees_pend)
        return counts

    tp.shared_counts = skewed
    return tp_engine.generate_rank_process(*args)


def test_a_rank_whose_counts_differ_fails_agreement(monkeypatch):
    """Rank 1 reports one more live page than it holds: the first step's digests differ and both
    ranks fail `tp.rank_agreement`, naming the differing decision."""
    from kvchain.dist import tp_engine

    monkeypatch.setattr(tp_engine, "generate_rank_process", _skewed_rank)  # what each rank process runs
    with pytest.raises(KVChainError, match=r"tp.rank_agreement: iteration 0: rank 1's .*rank 0 \('held'"):
        generate_in_ranks(str(checkpoint_dir("llama")), _config(), workload(4), 2)
    assert not mp.active_children()


def test_generate_cli_with_tp_prints_what_one_process_does(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", workload(3))
    argv = ["generate", "--model-path", str(checkpoint_dir("llama")), "--prompts", str(prompts), "--budget", "4MiB",
            "--page-size", "4", "--ignore-eos", "--no-overlap", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--tp", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["outputs"] == one["outputs"] and len(two["ranks"]) == 2


@pytest.mark.parametrize(("family", "argv", "needle"), [
    ("nemotron_h", ["--tp", "4"], "Mamba groups (2) do not split evenly over 4 ranks"),
    ("qwen3_next", ["--tp", "4"], "linear_num_key_heads"),
    ("llama", ["--tp", "3"], "'num_key_value_heads' = 2 cannot be split over tp_size 3"),
    ("llama", ["--tp", "2", "--pp-partition", "1,1"], "give --pp 2 or more"),
    ("llama", ["--tp", "2", "--device", "cuda"], "--device"),
])
def test_bad_tp_input_is_one_line_and_exit_2(family, argv, needle, capsys):
    path = checkpoint_dir(family)
    capsys.readouterr()  # what writing the checkpoint printed
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["generate", "--model-path", str(path), "--prompt", "ab", *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
