"""Cross-check against transformers: build each family's config class from the preset dict and
compare layer kinds, windows, KV heads and head_dim with what the parser declared.

Skips cleanly when transformers, or one family's config class, is not installed."""

from __future__ import annotations

import warnings

import pytest

from kvchain.decl import MHA, MLA, FullLifetime, State, WindowLifetime
from kvchain.models import ModelSpec, load_preset_config, model_from_preset

transformers = pytest.importorskip("transformers")


def hf_config(class_name: str, preset: str, fix=None):
    """The transformers config object for a preset (its `_kvchain` metadata removed)."""
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    cfg = load_preset_config(preset)
    cfg.pop("_kvchain")
    if fix is not None:
        fix(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**cfg)


def text(config):
    return getattr(config, "text_config", None) or config


def attention_by_layer(spec: ModelSpec) -> dict[int, tuple]:
    """layer id -> (lifetime, geometry) of its attention part."""
    out = {}
    for decl in spec.decls:
        for part in decl.parts:
            if part.is_attention:
                out[decl.layer_id] = (part.lifetime, part.geometry)
    return out


def state_layers(spec: ModelSpec) -> dict[int, State]:
    return {d.layer_id: p.geometry for d in spec.decls for p in d.parts if not p.is_attention}


def expected_lifetime(layer_type: str, window: int | None):
    if layer_type == "full_attention":
        return FullLifetime()
    if layer_type == "sliding_attention":
        return WindowLifetime(window)
    if layer_type == "chunked_attention":
        return WindowLifetime(window, chunked=True)
    raise AssertionError(layer_type)


def check_attention_layers(spec: ModelSpec, hf, window: int | None, *, head_dim: int | None = None):
    """Every layer of hf.layer_types is declared with the matching lifetime and geometry."""
    attention = attention_by_layer(spec)
    assert len(hf.layer_types) == hf.num_hidden_layers
    for i, layer_type in enumerate(hf.layer_types):
        lifetime, geometry = attention[i]
        assert lifetime == expected_lifetime(layer_type, window), i
        assert geometry.kv_heads == hf.num_key_value_heads
        assert geometry.head_dim == (head_dim if head_dim is not None else hf.head_dim)
    assert len(attention) == hf.num_hidden_layers


def test_llama():
    hf = hf_config("LlamaConfig", "llama-3.1-8b")
    spec = model_from_preset("llama-3.1-8b")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    for i in range(hf.num_hidden_layers):
        lifetime, geometry = attention_by_layer(spec)[i]
        assert lifetime == FullLifetime()
        assert geometry == MHA(hf.num_key_value_heads, head_dim, dtype="bfloat16")
    assert spec.max_context == hf.max_position_embeddings


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss(preset):
    hf = hf_config("GptOssConfig", preset)
    spec = model_from_preset(preset)
    check_attention_layers(spec, hf, hf.sliding_window)
    assert hf.sliding_window == 128


@pytest.mark.parametrize("preset", ["gemma-3-27b", "gemma-3-12b"])
def test_gemma3(preset):
    hf = text(hf_config("Gemma3Config", preset))
    spec = model_from_preset(preset)
    check_attention_layers(spec, hf, hf.sliding_window)
    assert spec.max_context == hf.max_position_embeddings


def _llama4_bool_temperature_tuning(cfg):
    # Scout publishes attn_temperature_tuning: 4; newer transformers type the field as a bool.
    tc = cfg["text_config"]
    tc["attn_temperature_tuning"] = bool(tc["attn_temperature_tuning"])


def test_llama4():
    hf = text(hf_config("Llama4Config", "llama-4-scout", fix=_llama4_bool_temperature_tuning))
    spec = model_from_preset("llama-4-scout")
    check_attention_layers(spec, hf, hf.attention_chunk_size)
    assert hf.layer_types.count("chunked_attention") == 36


def test_qwen3_next():
    hf = hf_config("Qwen3NextConfig", "qwen3-next-80b")
    spec = model_from_preset("qwen3-next-80b")
    attention, states = attention_by_layer(spec), state_layers(spec)
    for i, layer_type in enumerate(hf.layer_types):
        if layer_type == "full_attention":
            assert attention[i][1] == MHA(hf.num_key_value_heads, hf.head_dim, dtype="bfloat16")
            assert i not in states
        else:
            assert layer_type == "linear_attention" and i not in attention
            key_dim = hf.linear_num_key_heads * hf.linear_key_head_dim
            value_dim = hf.linear_num_value_heads * hf.linear_value_head_dim
            conv, ssm = states[i].tensors
            assert conv.shape == (2 * key_dim + value_dim, hf.linear_conv_kernel_dim - 1)
            assert ssm.shape == (hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim)


def test_jamba():
    hf = hf_config("JambaConfig", "jamba-mini")
    spec = model_from_preset("jamba-mini")
    attention, states = attention_by_layer(spec), state_layers(spec)
    intermediate = hf.mamba_expand * hf.hidden_size
    for i, block in enumerate(hf.layers_block_type):
        if block == "attention":
            head_dim = hf.hidden_size // hf.num_attention_heads
            assert attention[i] == (FullLifetime(), MHA(hf.num_key_value_heads, head_dim, dtype="bfloat16"))
        else:
            assert block == "mamba"
            conv, ssm = states[i].tensors
            assert conv.shape == (intermediate, hf.mamba_d_conv - 1)
            assert ssm.shape == (intermediate, hf.mamba_d_state)


def test_nemotron_h():
    hf = hf_config("NemotronHConfig", "nemotron-h-8b")
    spec = model_from_preset("nemotron-h-8b")
    attention, states = attention_by_layer(spec), state_layers(spec)
    assert len(hf.layers_block_type) == 52
    for i, block in enumerate(hf.layers_block_type):
        if block in ("full_attention", "attention"):
            assert attention[i] == (
                FullLifetime(),
                MHA(hf.num_key_value_heads, hf.head_dim, dtype="bfloat16"),
            )
        elif block in ("linear_attention", "mamba"):
            conv, ssm = states[i].tensors
            intermediate = hf.mamba_num_heads * hf.mamba_head_dim
            assert conv.shape == (intermediate + 2 * hf.n_groups * hf.ssm_state_size, hf.conv_kernel - 1)
            assert ssm.shape == (hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size)
        else:
            assert block in ("mlp", "moe")
            assert i not in attention and i not in states


def test_falcon_h1():
    hf = hf_config("FalconH1Config", "falcon-h1-7b")
    spec = model_from_preset("falcon-h1-7b")
    attention, states = attention_by_layer(spec), state_layers(spec)
    assert set(hf.layers_block_type) == {"hybrid"}
    d_ssm = hf.mamba_d_ssm if hf.mamba_d_ssm is not None else hf.mamba_expand * hf.hidden_size
    for i in range(hf.num_hidden_layers):
        assert attention[i] == (FullLifetime(), MHA(hf.num_key_value_heads, hf.head_dim, dtype="bfloat16"))
        conv, ssm = states[i].tensors
        assert conv.shape == (d_ssm + 2 * hf.mamba_n_groups * hf.mamba_d_state, hf.mamba_d_conv - 1)
        assert ssm.shape == (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state)


def test_deepseek_v3():
    hf = hf_config("DeepseekV3Config", "deepseek-v3")
    spec = model_from_preset("deepseek-v3")
    assert len(spec.decls) == hf.num_hidden_layers
    for decl in spec.decls:
        assert decl.parts[0].geometry == MLA(hf.kv_lora_rank, hf.qk_rope_head_dim, dtype="bfloat16")
    assert spec.max_context == hf.max_position_embeddings
