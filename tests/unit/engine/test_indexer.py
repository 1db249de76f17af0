"""A sparse-attention indexer's keys through the pool (`engine/indexer.py`): stored as fp8 with a
float32 scale per 128 dims beside the latent, the module's own keys, and each query's picks taken
among its own request's keys only. `test_engine_families.py` holds DeepSeek-V3.2 and GLM-5 to
transformers token for token (its indexer keys rounded as the pool stores them)."""

from __future__ import annotations

import numpy as np
import torch

from kvchain.engine import attention
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.indexer import FP8_MAX, MIN_AMAX, dequantize, quantize
from kvchain.engine.latent import PagedLatent
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from support.engine import _stored_as_fp8, checkpoint_dir, serve, tight_budget


def test_stored_bytes_are_fp8_values_then_float32_scales():
    """Per token: 128 fp8 e4m3 values per block, then each block's scale (amax / 448) as float32; the
    block's largest magnitude comes back exactly, the rest within fp8's rounding (1/16 of it), and a
    block of zeros scales by the floor, not by zero."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 256, generator=gen) * torch.tensor([[1.0], [40.0], [0.01]])
    keys[2, 128:] = 0.0
    raw = quantize(keys)
    assert raw.dtype == torch.uint8 and raw.shape == (3, 256 + 2 * 4)
    blocks = keys.view(3, 2, 128)
    scale = raw[:, 256:].contiguous().view(torch.float32)
    want_scale = blocks.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX
    assert torch.equal(scale, want_scale)
    assert scale[2, 1] == MIN_AMAX / FP8_MAX
    want_values = (blocks / want_scale[..., None]).to(torch.float8_e4m3fn).view(3, 256).view(torch.uint8)
    assert torch.equal(raw[:, :256], want_values)
    back = dequantize(raw, 256)
    assert torch.equal(back[2, 128:], torch.zeros(128))
    err = (back.view(3, 2, 128) - blocks).abs()
    assert (err <= blocks.abs().amax(-1, keepdim=True) / 16).all()
    peak = blocks.abs().argmax(-1)
    for t in range(3):
        for b in range(2):
            if blocks[t, b].abs().max() > 0:
                got, want = back.view(3, 2, 128)[t, b, peak[t, b]], blocks[t, b, peak[t, b]]
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


def test_the_indexer_keys_in_the_pool_are_the_modules_own(monkeypatch):
    """After a served prompt, the pool's indexer bytes at the step's write locations give back the
    keys transformers' indexer computed (normalised, rotated), rounded to fp8 as stored: a pool that
    kept them before the rotation, or another token's, would differ."""
    family = "deepseek_v32"
    loaded = load_checkpoint(checkpoint_dir(family))
    prompt = list(range(10, 31))
    seen = {}

    class Recorder:
        def update(self, latent, rope_key, layer_idx, kwargs=None):
            return latent, rope_key

        def update_indexer(self, keys, layer_idx):  # the keys as the pool gives them back, as the engine's
            seen[layer_idx] = keys[0].clone()
            return _stored_as_fp8(keys)

    model = load_checkpoint(checkpoint_dir(family)).model
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, a, k: (a, {**k, "cache": Recorder()}), with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([prompt]))
    captured = {}
    real = PagedLatent.update_indexer

    def spy(self, keys, layer_idx):
        out = real(self, keys, layer_idx)
        pool = self.batch.layer_pool[layer_idx]
        view = self.batch.views[pool].index_k(layer_idx)
        raw = view.reshape(-1, view.shape[-1])[self.batch.write_locs[pool]]
        captured[layer_idx] = dequantize(raw, keys.shape[-1])
        return out

    monkeypatch.setattr(PagedLatent, "update_indexer", spy)
    with Engine(loaded, EngineConfig(budget_bytes=tight_budget(family, 2), page_size=4, context_len=64,
                                     prefix_cache=False, max_batched_tokens=64)) as engine:
        engine.generate([GenerateRequest(prompt, 1)])
    assert set(captured) == set(seen) == set(range(loaded.config.num_hidden_layers))
    for layer, want in seen.items():
        torch.testing.assert_close(captured[layer], _stored_as_fp8(want[None])[0], rtol=1e-6, atol=1e-7)


def test_each_query_picks_among_its_own_keys(monkeypatch):
    """Served batched (several requests' keys gathered end to end in one step), every query's top-k
    lands on keys of its own request at or before it: `min(topk, its keys)` of them. An indexer mask
    that let a query score another request's keys would pick some of those instead."""
    picks = []
    real = attention.restrict

    def spy(groups, indices, page_size):
        picks.append((groups, indices.clone()))
        return real(groups, indices, page_size)

    monkeypatch.setattr(attention, "restrict", spy)
    serve("deepseek_v32", 6)
    topk = load_checkpoint(checkpoint_dir("deepseek_v32")).config.index_topk
    assert picks
    longest = 0
    for groups, indices in picks:
        for g, cols in zip(groups, attention.slot_columns(groups, 4), strict=True):
            rows = attention.query_rows(g)
            for i in range(g.b):
                for j in range(g.n):
                    own = cols[i][g.visible[i, j]]
                    got = np.intersect1d(indices[0, rows[i, j]].numpy(), own)
                    assert len(got) == min(topk, len(own))
                    longest = max(longest, len(own))
    assert longest > topk  # some queries had more keys than they could pick
