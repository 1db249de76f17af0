"""The attention function serves only what it can serve right, and refuses the rest in one line.

What a layer's queries see comes from its sub-pool's lifetime, which is what the pool retires by,
not only from what the module passes: Llama 4's chunked layers pass no window (their mask said
so, and the engine ignores masks), a windowed layer whose module passed none would read pages the
pool retired, and a module whose window reaches past the plan's is refused. Llama 4 itself is held
to transformers token for token in `test_engine_families.py` (all 12 requests differed when its
chunked layers were attended as full attention).

A forward must reach the attention function exactly once per layer whose K/V the pool keeps: a
module that calls it twice (DiffLlama: one call per half of its values) would overwrite the first
call's values with the second's, and one that attends its own way would see only the step's tokens;
both served wrong tokens without a word (DiffLlama: all 6 requests differed)."""

from __future__ import annotations

import pytest
import torch

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.engine.tiny import model_for_config, save_checkpoint, tiny_fields
from kvchain.errors import InputError, KVChainError
from support.engine import PAGE, checkpoint_dir, mismatches, tight_budget, workload

N = 6


def _serve(loaded, family: str):
    config = EngineConfig(budget_bytes=tight_budget(family, 4), page_size=PAGE, max_running=8,
                          max_batched_tokens=48, context_len=128, ignore_eos=True, keep_logits=True)
    with Engine(loaded, config) as engine:
        return engine.generate(workload(N))


def _sliding_modules(loaded):
    return [layer.self_attn for layer in loaded.model.model.layers if layer.self_attn.sliding_window is not None]


def test_a_windowed_layer_whose_module_passes_no_window_attends_over_the_plans():
    """Gemma 3's sliding layers with their modules' window removed: the plan's window of 16 still
    bounds what they read, and the tokens are transformers' (with the modules' own windows)."""
    loaded = load_checkpoint(checkpoint_dir("gemma3"))
    modules = _sliding_modules(loaded)
    assert modules
    for module in modules:
        module.sliding_window = None
    result = _serve(loaded, "gemma3")
    assert mismatches(result, "gemma3", N) == []
    assert result.stats.window_pages_retired > 0


def test_a_module_window_past_the_plans_is_refused():
    """A window wider than the pool keeps would read pages the pool has retired (a narrower one reads
    a subset of what it keeps: `test_attention.py` attends over 3 of a pool's 8)."""
    loaded = load_checkpoint(checkpoint_dir("gemma3"))
    for module in _sliding_modules(loaded):
        module.sliding_window = 24
    with pytest.raises(KVChainError, match="attends over a window of 24 tokens, the pool keeps 16"):
        _serve(loaded, "gemma3")


def test_a_chunked_layer_given_a_window_is_refused():
    loaded = load_checkpoint(checkpoint_dir("llama4"))
    chunked = [layer.self_attn for layer in loaded.model.model.layers if layer.self_attn.use_rope]
    assert chunked
    real = type(chunked[0]).forward

    def with_window(self, *args, **kwargs):
        return real(self, *args, sliding_window=16, **kwargs)

    for module in chunked:
        module.forward = with_window.__get__(module)
    with pytest.raises(KVChainError, match="planned as attention in chunks of 16"):
        _serve(loaded, "llama4")


def test_an_attention_that_calls_the_function_twice_is_refused(tmp_path):
    model = model_for_config(tiny_fields("diffllama", num_hidden_layers=2, intermediate_size=64,
                                         tie_word_embeddings=False), seed=1)
    loaded = load_checkpoint(save_checkpoint(model, tmp_path / "diffllama"))
    with pytest.raises(KVChainError, match=r"layer 0 \(DiffLlamaAttention\) calls the attention function twice"):
        _serve(loaded, "llama")


def test_an_attention_that_bypasses_the_pool_is_refused():
    """Gemma 3's last layer attending its own way (here: not at all): the step is refused."""
    loaded = load_checkpoint(checkpoint_dir("gemma3"))
    attention = loaded.model.model.layers[-1].self_attn

    def own_way(hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None

    attention.forward = own_way
    with pytest.raises(KVChainError, match=r"attention layers \[3\] \(Gemma3Attention\) never called"):
        _serve(loaded, "gemma3")


def test_a_model_that_keeps_no_cache_is_refused(tmp_path):
    """GPT-1 (`openai-gpt`) attends over the tokens it is given, with no cache: served through the
    pool, every token after the prompt's first step was wrong (6 of 6 requests)."""
    model = model_for_config(tiny_fields("openai-gpt", num_hidden_layers=2, tie_word_embeddings=False), seed=1)
    loaded = load_checkpoint(save_checkpoint(model, tmp_path / "gpt1"))
    with pytest.raises(KVChainError, match=r"attention layers \[0, 1\] \(.*\) never called the attention function"):
        _serve(loaded, "llama")


def test_keys_of_another_shape_than_the_pools_are_refused(tmp_path):
    """JetMoE's attention tiles its K/V heads by its top-k after the cache, so the attention function
    gets twice the heads the pool keeps per token: one line naming both shapes (it was a torch
    shape error from inside the forward)."""
    model = model_for_config(tiny_fields("jetmoe", num_hidden_layers=2, num_key_value_heads=4,
                                         tie_word_embeddings=False), seed=1)
    loaded = load_checkpoint(save_checkpoint(model, tmp_path / "jetmoe"))
    with pytest.raises(InputError, match=r"layer 0 \(JetMoeAttention\) hands the attention function keys \(8, 16\) "
                                         r"and values \(8, 16\) .* keeps \(4, 16\) and \(4, 16\)"):
        _serve(loaded, "llama")


def test_a_model_that_fails_before_its_attention_is_refused_as_such(tmp_path):
    """Falcon's attention adds a mask the engine does not build and raises before it reaches the
    attention function: one line that says so and what it raised (it was a bare TypeError)."""
    from transformers import FalconConfig

    config = FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          bos_token_id=None, eos_token_id=None)
    loaded = load_checkpoint(save_checkpoint(model_for_config(config, seed=1), tmp_path / "falcon"))
    with pytest.raises(InputError, match=r"attention layers \[0, 1\] \(FalconAttention\) never called the attention "
                                         r"function \(the forward raised TypeError"):
        _serve(loaded, "llama")
