"""Causal-LM model types of the installed transformers beyond the families `tiny.FAMILIES` names:
each, as a tiny random model written with `save_pretrained` and loaded through kvchain's loader,
is either served token for token against transformers' own `generate` or refused in one line
(`InputError`) before it returns a token. Never a wrong token: the attention function's guards
(`test_attention_guards.py`) turned the silent ones (DiffLlama, HRM, GPT-1) into refusals.

The full list runs behind the sweep marker (about 3 s a type); a slice runs in CI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.engine.tiny import model_for_config, save_checkpoint, tiny_fields
from kvchain.errors import InputError

#: every type's tiny config: 2 layers, one K/V head per query head (several of these models
#: ignore `num_key_value_heads`, which the plan would read), 8 rotary dims where a config names them
COMMON = dict(num_hidden_layers=2, intermediate_size=64, num_key_value_heads=4, rotary_dim=8,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: fields a type needs beyond those, so its windows or chunks are exercised at this size
EXTRA = {
    "exaone4": {"sliding_window": 16, "num_hidden_layers": 4},
    "cohere2_moe": {"sliding_window": 16, "num_hidden_layers": 4},
    "granite_swa": {"sliding_window": 16, "num_hidden_layers": 4},
    "ministral": {"sliding_window": 16},
    "smollm3": {"num_hidden_layers": 4},
    "gpt_bigcode": {"num_key_value_heads": None},  # its `multi_query`: one K/V head
}
SERVED = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "biogpt", "bitnet", "codegen", "cohere",
    "cohere2_moe", "ctrl", "doge", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo",
    "flint", "gemma", "glm", "glm4", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granite_swa",
    "granitemoe", "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
    "internlm3", "iquestcoder", "jais2", "kolibri1", "mellum", "minimax_m2", "ministral", "ministral3", "mixtral",
    "nanochat", "nemotron", "olmo", "olmo2", "olmoe", "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3_moe", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2",
    "vaultgemma",
)
#: refused, and why
REFUSED = {
    "diffllama": "calls the attention function twice",  # one call per half of its values
    "hrm_text": "calls the attention function twice",  # its reasoning loops rerun each layer
    "openai-gpt": "never called the attention function",  # GPT-1 keeps no cache
    "jetmoe": "hands the attention function keys",  # its K/V heads tiled by its top-k after the cache
}
CI_SLICE = ("gpt2", "stablelm", "phi3", "exaone4", "starcoder2", "openai-gpt")


def _requests() -> list[GenerateRequest]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 24).tolist()
    return [GenerateRequest(shared + rng.integers(0, 256, int(rng.integers(2, 30))).tolist(), int(rng.integers(6, 20)))
            for _ in range(5)]


def check_type(model_type: str, tmp_path) -> None:
    config = tiny_fields(model_type, **{**COMMON, **EXTRA.get(model_type, {})})
    path = save_checkpoint(model_for_config(config, seed=1), tmp_path / model_type)
    requests = _requests()
    engine_config = EngineConfig(budget_bytes=16 * 2**20, page_size=4, context_len=128, max_running=4,
                                 max_batched_tokens=32, ignore_eos=True)
    if model_type in REFUSED:
        with pytest.raises(InputError, match=REFUSED[model_type]), Engine(load_checkpoint(path), engine_config) as engine:
            engine.generate(requests)
        return
    with Engine(load_checkpoint(path), engine_config) as engine:
        result = engine.generate(requests)
    reference = load_checkpoint(path).model
    for request, output in zip(requests, result.outputs, strict=True):
        ids = torch.tensor([list(request.prompt_token_ids)])
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
            max_new_tokens=request.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0))
        assert output.token_ids == want[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("model_type", CI_SLICE)
def test_a_type_is_served_as_transformers_serves_it_or_refused(model_type, tmp_path):
    check_type(model_type, tmp_path)


@pytest.mark.sweep
@pytest.mark.parametrize("model_type", sorted(set(SERVED) | set(REFUSED)))
def test_every_listed_type_is_served_as_transformers_serves_it_or_refused(model_type, tmp_path):
    check_type(model_type, tmp_path)
