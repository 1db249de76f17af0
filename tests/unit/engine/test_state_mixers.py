"""kvchain's recurrent mixers (`engine/deltanet.py`, `engine/mamba2.py`) against transformers' own
modules on the same weights, in fp32: three requests packed in one batch (prompts in two chunks of
different lengths, then batched decodes), their conv and SSM state in a real pool whose slots start
as garbage, must give HF's outputs for each sequence run alone, at the mixer and at the logits; a
state checkpoint copied to another slot continues the request from there."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvchain.engine.deltanet import deltanet_forward, gated_delta_chunked, gated_delta_scan
from kvchain.engine.mamba2 import mamba2_forward, ssd_scan
from kvchain.engine.mixers import install_state_mixers
from support.mixer_pool import (
    CONV_SCHEDULE,
    MixerPool,
    assert_bucket_leaves_each_state_alone,
    assert_needs_the_batch,
    checkpoint_gap,
    delta_inputs,
    diff,
    mixer_gap,
    positions,
    serve,
)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

TOL = 1e-4
SCHEDULE = CONV_SCHEDULE


def _qwen3_next() -> object:
    return qwen3_next.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        layer_types=["linear_attention"] * 4, dtype="float32",
    )


def _nemotron_h() -> object:
    # chunk_size 4: HF's chunked scan crosses block boundaries within a prompt chunk (ours takes blocks of
    # at least `mamba2.MIN_BLOCK`; its block crossings are held in test_blocked_scans_match_the_token_by_token_recurrence)
    return nemotron_h.NemotronHConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        hybrid_override_pattern="M-M-", mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
        max_position_embeddings=512, chunk_size=4, dtype="float32",
    )


MODELS = {
    "qwen3_next": (_qwen3_next, qwen3_next.Qwen3NextForCausalLM, "linear_attn", deltanet_forward),
    "nemotron_h": (_nemotron_h, nemotron_h.NemotronHForCausalLM, "mixer", mamba2_forward),
}


@pytest.fixture(params=sorted(MODELS))
def case(request):
    make_config, model_cls, attr, forward = MODELS[request.param]
    config = make_config()
    assert config.dtype in (torch.float32, "float32")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    mixers = {i: getattr(layer, attr) for i, layer in enumerate(model.model.layers)
              if hasattr(layer, attr) and hasattr(getattr(layer, attr), "conv1d")}
    return config, model, mixers, forward


def _with_attention_layer(cfg: dict) -> dict:
    """The config as the pool plans it: one full-attention layer appended past the model's (the
    parser refuses a model whose layers all keep state, since an attention layer owns the ids)."""
    cfg = dict(cfg)
    for key, attention in (("layer_types", "full_attention"), ("layers_block_type", "attention")):
        if cfg.get(key):
            cfg[key] = [*cfg[key], attention]
    if cfg.get("hybrid_override_pattern"):
        cfg["hybrid_override_pattern"] += "*"
    if "num_hidden_layers" in cfg:
        cfg["num_hidden_layers"] += 1
    return cfg


def _pool_config(config) -> dict:
    """The dict `MixerPool` plans from: the model's config with its attention layer appended."""
    return _with_attention_layer(config.to_dict())


def test_mixer_matches_hf_on_each_sequence(case):
    config, _model, mixers, forward = case
    runs = [(functools.partial(forward, m), lambda x, m=m: m(x[None])[0]) for m in mixers.values()]
    worst, relative = mixer_gap(_pool_config(config), runs, config.hidden_size, SCHEDULE)
    # small-init weights give small outputs, so the absolute bound alone would be loose
    assert worst < TOL and relative < TOL


def _hf_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """HF alone on one sequence: a prefill of the prompt, then one decode step at a time with its cache.
    The masks are given (none: one unpadded sequence) since HF cannot build them from a cache that
    holds only recurrent layers."""
    masks = {"full_attention": None, "linear_attention": None}
    out = model(input_ids=ids[None, :prompt], position_ids=torch.arange(prompt)[None], attention_mask=masks,
                use_cache=True)
    logits, cache = [out.logits[0]], out.cache
    for t in range(prompt, len(ids)):
        out = model(input_ids=ids[None, t:t + 1], position_ids=torch.tensor([[t]]), attention_mask=masks,
                    cache=cache, use_cache=True)
        logits.append(out.logits[0])
        cache = out.cache
    return torch.cat(logits)


def test_logits_match_hf_on_each_sequence(case):
    config, model, mixers, _forward = case
    seqs = SCHEDULE.token_inputs(config.vocab_size, seed=2)
    ours_model = copy.deepcopy(model)
    assert install_state_mixers(ours_model) == len(mixers)
    pool = MixerPool(_pool_config(config))

    def run(packed, batch):
        return ours_model(input_ids=packed, position_ids=positions(batch)[None], use_cache=False,
                          kvchain_batch=batch).logits

    with torch.no_grad():
        ours = serve(pool, run, seqs, SCHEDULE)
        worst = 0.0
        for b, ids in enumerate(seqs):
            ref = _hf_logits(model, ids, sum(SCHEDULE.chunks[b]))
            worst = max(worst, diff(ours[b], ref))
    print(f"logits max abs diff {worst:.2e}")
    assert worst < TOL


def test_checkpoint_copy_continues_the_request(case):
    config, _model, mixers, forward = case
    module = next(iter(mixers.values()))
    first, second = SCHEDULE.chunks[1]
    worst, _scale = checkpoint_gap(_pool_config(config), functools.partial(forward, module),
                                   lambda x: module(x[None])[0], config.hidden_size, first, second)
    assert worst < TOL


def test_missing_batch_is_an_input_error(case):
    _config, model, _mixers, _forward = case
    assert_needs_the_batch(model)


def test_blocked_scans_match_the_token_by_token_recurrence():
    """The block forms of both recurrences against stepping one token at a time, over a length that
    crosses several blocks and ends mid-block, from a non-zero state."""
    q, k, v, g, beta, state = delta_inputs(4)
    want, want_state = gated_delta_scan(q, k, v, g, beta, state)
    got, got_state = gated_delta_chunked(q, k, v, g, beta, state, block=8)
    assert max(diff(got, want), diff(got_state, want_state)) < 1e-5

    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    (n, length, heads, dk), dv = q.shape, v.shape[-1]
    x, dt, b, c = rand(n, length, heads, dv), rand(n, length, heads).exp(), rand(n, length, heads, dk), \
        rand(n, length, heads, dk)
    a, h0 = -rand(heads).abs(), rand(n, heads, dv, dk)
    want, want_state = ssd_scan(x, dt, a, b, c, h0, block=1)
    got, got_state = ssd_scan(x, dt, a, b, c, h0, block=8)
    assert max(diff(got, want), diff(got_state, want_state)) < 1e-4


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(case):
    """Two prompt chunks of different lengths stepped in one padded bucket: the conv and SSM states
    left in their slots are those of each chunk run alone. Held on the states themselves, since the
    D skip can dwarf a state error in the outputs."""
    config, _model, mixers, forward = case
    layer, module = next(iter(mixers.items()))
    assert_bucket_leaves_each_state_alone(_pool_config(config), functools.partial(forward, module), layer,
                                          ("conv", "ssm"), config.hidden_size, rel_tol=1e-4)
