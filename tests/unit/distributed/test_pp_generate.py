"""The engine split into pipeline stages, one process per stage over gloo: each stage its own
layers and pool, the hidden states passed stage to stage, the outputs identical to one process."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from kvchain.cache.checkpoints import default_checkpoint_interval
from kvchain.cli import main
from kvchain.dist.pp_engine import generate_in_stages
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.errors import KVChainError
from kvchain.plan import plan_stages
from support.engine import checkpoint_dir, gemma_six, qwen_eight, workload, write_prompts

CHECKS = {"KVCHAIN_INVARIANT_CHECK": "1"}


def _config(**kw) -> EngineConfig:
    base = dict(budget_bytes=600 * 1024, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                ignore_eos=True)
    return EngineConfig(**{**base, **kw})


def test_two_stages_generate_what_one_process_does():
    """A Gemma-3-like checkpoint split 4/2 into two stage processes: the stages' arenas hold other bytes per token, every step's capacity digests agree,
    and both stages sample exactly the tokens one process samples."""
    path, reqs = str(gemma_six()), workload(8)
    with Engine(path, _config()) as engine:
        one = engine.generate(reqs)
    assert all(o.finish_reason == "length" for o in one.outputs)
    runs = generate_in_stages(path, _config(), reqs, 2, (4, 2), env=CHECKS)
    first, second = runs
    assert (first.first_layer, first.last_layer, second.first_layer, second.last_layer) == (0, 3, 4, 5)
    assert first.bytes_per_token == 2 * second.bytes_per_token
    assert [o.token_ids for o in first.result.outputs] == [o.token_ids for o in one.outputs]
    assert [o.token_ids for o in second.result.outputs] == [o.token_ids for o in one.outputs]
    assert len(first.digests) == first.result.stats.steps > 10 and first.digests == second.digests
    assert not mp.active_children()


def test_stages_of_unequal_state_keep_the_whole_models_checkpoint_grid():
    """Qwen3-Next-like layers split 6/2: the stages hold three and one DeltaNet layers, so each
    stage's own default checkpoint interval differs (a stage's state and token bytes differ), and
    stages on other grids cut other prefill chunks: their digests parted and the run hung (PP-2).
    With no interval configured every stage keeps the whole model's default, as one process does."""
    target, _draft = qwen_eight()
    path, reqs = str(target), workload(8)
    config = _config(budget_bytes=4 * 2**20)
    assert config.checkpoint_interval is None
    spec = load_checkpoint(path).model_spec()
    plans = plan_stages(spec.decls, 2, page_size=config.page_size, n_layers=8, partition=(6, 2))
    assert len({default_checkpoint_interval(p) for p in plans}) == 2  # the stages' own defaults differ
    with Engine(path, config) as engine:
        one = engine.generate(reqs)
    assert one.stats.checkpoints > 0
    first, second = generate_in_stages(path, config, reqs, 2, (6, 2), env=CHECKS, timeout_s=120)
    for run in (first, second):
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
    assert first.result.stats.checkpoints == one.stats.checkpoints
    assert len(first.digests) == first.result.stats.steps and first.digests == second.digests
    assert not mp.active_children()


@pytest.mark.parametrize(("family", "split"), [("deepseek_v3", [(0, 1), (2, 2)]), ("longcat_flash", [(0, 1), (2, 3)]),
                                               ("deepseek_v32", [(0, 1), (2, 2)]), ("bailing_hybrid", [(0, 1), (2, 3)])])
def test_latent_attention_in_two_stages_generates_what_one_process_does(family, split):
    """DeepSeek-V3's three MLA layers split 2/1, LongCat-Flash's two decoder layers (two attentions
    each, four layer ids) one per stage: each stage keeps its layers' latents in its own pool (and
    DeepSeek-V3.2's their indexer keys, Bailing's its delta-attention state beside them)."""
    path, reqs = str(checkpoint_dir(family)), workload(4)
    config = _config(budget_bytes=4 * 2**20)
    with Engine(path, config) as engine:
        one = engine.generate(reqs)
    runs = generate_in_stages(path, config, reqs, 2)
    assert [(r.first_layer, r.last_layer) for r in runs] == split
    per_layer = [r.bytes_per_token / (r.last_layer - r.first_layer + 1) for r in runs]
    assert per_layer[0] == per_layer[1]
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
    assert not mp.active_children()


def test_a_model_whose_layers_return_tuples_runs_in_two_stages():
    """Falcon-H1's decoder layers return a one-element tuple and its model's loop takes element 0:
    a later stage's pass-through layers, returning the bare hidden states, handed its first layer
    one row of them ("needs hidden states [1, T, H], got (64,)") on every run. A pass-through now
    returns what the layer it stands for returns."""
    path, reqs = str(checkpoint_dir("falcon_h1")), workload(4)
    config = _config(budget_bytes=8 * 2**20, checkpoint_interval=8)
    with Engine(path, config) as engine:
        one = engine.generate(reqs)
    for run in generate_in_stages(path, config, reqs, 2):
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
    assert not mp.active_children()


def test_a_stage_that_cuts_a_decoder_layer_is_refused(capsys):
    """LongCat-Flash's layer ids 0..3 are two decoder layers of two attentions: a stage boundary
    between a layer's attentions is refused in one line before any stage starts."""
    path = checkpoint_dir("longcat_flash")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["generate", "--model-path", str(path), "--prompt", "ab", "--pp", "2",
                               "--pp-partition", "1,3"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a stage must start and end on a multiple of 2 (layers 0..0 do not)" in err


def test_generate_cli_with_pp_prints_what_one_process_does(tmp_path, capsys):
    path = checkpoint_dir("gpt_oss")
    prompts = write_prompts(tmp_path / "p.jsonl", workload(3))
    argv = ["generate", "--model-path", str(path), "--prompts", str(prompts), "--budget", "4MiB", "--page-size", "4",
            "--ignore-eos", "--json"]
    assert main([*argv, "--no-overlap"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--pp", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["outputs"] == one["outputs"]
    assert [(s["first_layer"], s["last_layer"]) for s in two["stages"]] == [(0, 1), (2, 3)]
    assert not mp.active_children()


@pytest.mark.parametrize(("argv", "needle"), [
    (["--pp", "2", "--pp-partition", "1,3"], "stage 0 (layers 0..0) has no full-attention layer"),
    (["--pp", "2", "--pp-partition", "2,1"], "4 in all"),
    (["--pp", "5"], "5 stages"),
    (["--pp", "2", "--device", "cuda"], "--device"),
])
def test_bad_pp_input_is_one_line_and_exit_2(argv, needle, capsys):
    path = checkpoint_dir("gpt_oss")
    capsys.readouterr()  # what writing the checkpoint printed
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["generate", "--model-path", str(path), "--prompt", "ab", *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("family", ["zamba", "zamba2"])
def test_layers_that_read_the_embeddings_are_refused_before_any_stage_starts(family, capsys):
    """Zamba's hybrid layers read the embeddings beside the hidden states; a later stage would take
    them from its input and sample other tokens than one process (it did): refused in one line, and
    in the stage process itself when stages are started directly."""
    path = checkpoint_dir(family)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["generate", "--model-path", str(path), "--prompt", "ab", "--pp", "2"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "take the embeddings (original_hidden_states)" in err
    with pytest.raises(KVChainError, match=r"take the embeddings .* pass on only the hidden states"):
        generate_in_stages(str(path), _config(budget_bytes=8 * 2**20), workload(2), 2)
    assert not mp.active_children()
