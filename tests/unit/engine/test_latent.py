"""Multi-head latent attention through the pool (`engine/latent.py`): the pool keeps one latent and
rope key per token and layer, the module expands what the pool returns, and the tokens are
transformers' (`test_engine_families.py` holds every MLA family to that). Here: what the pool
holds (`test_indexer.py`: a sparse-attention indexer's keys beside it)."""

from __future__ import annotations

import pytest
import torch

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.latent import LATENT_ATTR, PagedLatent, install_latent_caches
from kvchain.engine.runner import ModelRunner, takes_mask_mapping
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.engine.tiny import make_model
from kvchain.errors import InputError
from kvchain.plan import plan_kv_storage
from support.engine import checkpoint_dir, tight_budget, workload


def test_the_pool_keeps_the_latent_not_the_heads():
    """DeepSeek-V3's pool holds rank + rope numbers per token and layer (40 here, where its 4 heads'
    keys and values would take 4 * (24 + 16) = 160), and every attention layer is served from it."""
    loaded = load_checkpoint(checkpoint_dir("deepseek_v3"))
    plan = plan_kv_storage(loaded.model_spec().decls, page_size=4)
    cfg = loaded.config
    (pool,) = plan.sub_pools
    assert {c.name for c in pool.envelope.components} == {"kv"}
    assert all(c.shape == (4, cfg.kv_lora_rank + cfg.qk_rope_head_dim) for c in pool.envelope.components)
    runner = ModelRunner(loaded.model, plan)
    assert runner.latent_layers == cfg.num_hidden_layers


def test_the_latent_written_is_the_models_own(monkeypatch):
    """After a served request, the pool's rows hold the module's normalised latent and its rotated
    rope key, as transformers' own cache would: a pool that stored anything else (the expanded keys,
    the latent before its norm) would differ."""
    loaded = load_checkpoint(checkpoint_dir("deepseek_v3"))
    prompt = list(range(10, 23))
    seen = {}

    class Recorder:
        def update(self, latent, rope_key, layer_idx, kwargs=None):
            seen[layer_idx] = torch.cat([latent[0, 0], rope_key[0, 0]], dim=-1).clone()
            return latent, rope_key

    model = load_checkpoint(checkpoint_dir("deepseek_v3")).model
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, k: (a, {**k, "cache": Recorder()}), with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([prompt]))
    with Engine(loaded, EngineConfig(budget_bytes=tight_budget("deepseek_v3", 2), page_size=4, context_len=64,
                                     prefix_cache=False)) as engine:
        captured = {}
        real = PagedLatent.update

        def spy(self, latent, rope_key, layer_idx, kwargs=None):
            out = real(self, latent, rope_key, layer_idx, kwargs)
            pool = self.batch.layer_pool[layer_idx]
            view = self.batch.views[pool].kv(layer_idx)
            captured[layer_idx] = view.reshape(-1, view.shape[-1])[self.batch.write_locs[pool]].clone()
            return out

        monkeypatch.setattr(PagedLatent, "update", spy)
        engine.generate([GenerateRequest(prompt, 1)])
    assert set(captured) == set(seen) == set(range(loaded.config.num_hidden_layers))
    for layer, want in seen.items():
        torch.testing.assert_close(captured[layer], want, rtol=1e-5, atol=1e-5)


def test_a_latent_module_needs_the_batch():
    model = make_model("deepseek_v3")
    install_latent_caches(model)
    assert all(getattr(layer.self_attn, LATENT_ATTR) for layer in model.model.layers)
    with pytest.raises(InputError, match="needs kvchain_batch"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize(("family", "mapped"), [("qwen3", True), ("jamba", True), ("llama", False),
                                                 ("deepseek_v3", False)])
def test_masks_are_skipped_where_the_model_takes_a_mapping(family, mapped, monkeypatch):
    """A family whose forward takes a precomputed mask mapping builds no mask on a step (the attention
    function takes the mask from the batch); the others build theirs, which is ignored."""
    import importlib

    model = make_model(family)
    modeling = importlib.import_module(type(model).__module__)
    calls = []
    real = modeling.create_causal_mask
    monkeypatch.setattr(modeling, "create_causal_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert takes_mask_mapping(type(model)) is mapped
    loaded = load_checkpoint(checkpoint_dir(family))
    monkeypatch.setattr(loaded, "model", model)
    with Engine(loaded, EngineConfig(budget_bytes=tight_budget(family, 2), page_size=4, context_len=64)) as engine:
        engine.generate(workload(2))
    assert (len(calls) == 0) is mapped
