"""Parser robustness: configs as published vary, and malformed ones fail with one clear line."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchain.decl import MHA, FullLifetime, WindowLifetime
from kvchain.errors import InputError
from kvchain.models import (
    ModelSpec,
    PresetInfo,
    list_presets,
    load_config_file,
    load_preset_config,
    model_from_config,
    model_from_preset,
)
from kvchain.plan import plan_kv_storage

LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 4,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def config(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()


def lifetimes(spec: ModelSpec) -> list[str]:
    """Per declared layer, its attention lifetime ("full", "window 128", "chunk 8192") or "-"."""
    out = []
    for decl in spec.decls:
        attention = [p for p in decl.parts if p.is_attention]
        out.append(attention[0].lifetime.describe() if attention else "-")
    return out


def error_of(cfg, **kwargs) -> str:
    with pytest.raises(InputError) as info:
        model_from_config(cfg, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- derived fields


def test_missing_head_dim_is_hidden_size_over_heads():
    spec = model_from_config(LLAMA)
    assert spec.decls[0].parts[0].geometry == MHA(8, 128, dtype="bfloat16")  # 4096 / 32


def test_explicit_head_dim_wins_over_the_derived_one():
    # Qwen3-4B style: hidden 2560 / 32 heads would be 80, but head_dim says 128
    cfg = config(LLAMA, model_type="qwen3", hidden_size=2560, head_dim=128)
    assert model_from_config(cfg).decls[0].parts[0].geometry.head_dim == 128


def test_missing_kv_heads_means_multi_head_attention():
    spec = model_from_config(config(LLAMA, num_key_value_heads=_DROP))
    assert spec.decls[0].parts[0].geometry.kv_heads == 32


def test_null_fields_count_as_missing():
    spec = model_from_config(config(LLAMA, head_dim=None, num_key_value_heads=None))
    assert spec.decls[0].parts[0].geometry == MHA(32, 128, dtype="bfloat16")


def test_name_defaults():
    assert model_from_config(LLAMA).name == "llama"
    assert model_from_config(config(LLAMA, _name_or_path="org/model")).name == "org/model"
    assert model_from_config(LLAMA, name="mine").name == "mine"


def test_kvchain_metadata_is_ignored():
    with_meta = load_preset_config("gpt-oss-20b")
    without = {k: v for k, v in with_meta.items() if k != "_kvchain"}
    assert model_from_config(with_meta).decls == model_from_config(without).decls


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32"}, "bfloat16"),  # engines serve a float32 config in 16 bits
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": _DROP, "dtype": "float16"}, "float16"),  # newer transformers write `dtype`
        ({"torch_dtype": "int8"}, "bfloat16"),  # not a KV dtype a model computes in
        ({"torch_dtype": "nonsense"}, "bfloat16"),
        ({"torch_dtype": None}, "bfloat16"),
    ],
)
def test_kv_dtype_follows_the_config(fields, expected):
    spec = model_from_config(config(LLAMA, **fields))
    assert spec.decls[0].parts[0].geometry.dtype == expected


@pytest.mark.parametrize("kv_dtype", [None, "auto", "AUTO"])
def test_auto_kv_dtype_is_16_bit_for_a_float32_config_and_conv_state_follows(kv_dtype):
    jamba = config(load_preset_config("jamba-mini"), torch_dtype="float32")
    spec = model_from_config(jamba, kv_dtype=kv_dtype)
    attention = next(p for d in spec.decls for p in d.parts if p.is_attention)
    conv, ssm = next(p for d in spec.decls for p in d.parts if not p.is_attention).geometry.tensors
    assert (attention.geometry.dtype, conv.dtype, ssm.dtype) == ("bfloat16", "bfloat16", "float32")


def test_explicit_float32_kv_dtype_is_kept_with_the_config_dtype_for_conv_state():
    # the engine passes the dtype it loaded the weights in
    jamba = config(load_preset_config("jamba-mini"), torch_dtype="float32")
    spec = model_from_config(jamba, kv_dtype="float32")
    attention = next(p for d in spec.decls for p in d.parts if p.is_attention)
    conv, _ssm = next(p for d in spec.decls for p in d.parts if not p.is_attention).geometry.tensors
    assert (attention.geometry.dtype, conv.dtype) == ("float32", "float32")


def test_nested_config_dtype_comes_from_the_top_level():
    spec = model_from_preset("gemma-3-27b")
    assert spec.decls[0].parts[0].geometry.dtype == "bfloat16"
    cfg = load_preset_config("gemma-3-27b")
    cfg["torch_dtype"] = "float16"
    assert model_from_config(cfg).decls[0].parts[0].geometry.dtype == "float16"


def test_kv_dtype_override_and_conv_state_dtype():
    spec = model_from_preset("qwen3-next-80b", kv_dtype="fp8")
    full = next(d for d in spec.decls if d.parts[0].is_attention)
    assert full.parts[0].geometry.dtype == "float8_e4m3fn"
    conv, ssm = spec.decls[0].parts[0].geometry.tensors
    assert (conv.dtype, ssm.dtype) == ("bfloat16", "float32")


# ---------------------------------------------------------------- text_config nesting


def test_gemma3_text_config_nesting_matches_a_flat_text_config():
    nested = load_preset_config("gemma-3-27b")
    flat = dict(nested["text_config"], torch_dtype="bfloat16")
    assert flat["model_type"] == "gemma3_text"
    assert model_from_config(nested).decls == model_from_config(flat).decls
    assert model_from_config(nested).family == model_from_config(flat).family == "gemma3"


def test_llama4_text_config_nesting_matches_a_flat_text_config():
    nested = load_preset_config("llama-4-scout")
    flat = dict(nested["text_config"])
    assert model_from_config(nested).decls == model_from_config(flat).decls


def test_unknown_wrapper_falls_back_to_a_known_text_model():
    wrapped = {"model_type": "some_vlm", "text_config": dict(LLAMA)}
    assert model_from_config(wrapped).decls == model_from_config(LLAMA).decls


def test_model_type_from_architectures():
    cfg = config(LLAMA, model_type=_DROP, architectures=["LlamaForCausalLM"])
    assert model_from_config(cfg).family == "llama"


# ---------------------------------------------------------------- lists and patterns


def test_qwen3_next_layer_types_and_interval_agree():
    by_interval = load_preset_config("qwen3-next-80b")
    by_list = copy.deepcopy(by_interval)
    del by_list["full_attention_interval"]
    by_list["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    assert model_from_config(by_list).decls == model_from_config(by_interval).decls


def test_the_list_wins_over_the_interval():
    cfg = load_preset_config("qwen3-next-80b")
    cfg["layer_types"] = ["full_attention"] * 48  # disagrees with full_attention_interval 4
    assert lifetimes(model_from_config(cfg)) == ["full"] * 48


def test_gemma3_layer_types_and_pattern_agree():
    by_pattern = load_preset_config("gemma-3-12b")
    by_list = copy.deepcopy(by_pattern)
    by_list["text_config"]["layer_types"] = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)
    ]
    assert model_from_config(by_list).decls == model_from_config(by_pattern).decls
    explicit = copy.deepcopy(by_pattern)
    explicit["text_config"]["sliding_window_pattern"] = 2
    assert lifetimes(model_from_config(explicit))[:4] == ["window 1024", "full", "window 1024", "full"]


def test_llama4_layer_types_no_rope_layers_and_interval_agree():
    base = load_preset_config("llama-4-scout")  # no_rope_layers: [] -> interval 4
    listed = copy.deepcopy(base)
    listed["text_config"]["no_rope_layers"] = [0 if (i + 1) % 4 == 0 else 1 for i in range(48)]
    typed = copy.deepcopy(base)
    typed["text_config"]["layer_types"] = [
        "full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(48)
    ]
    expected = model_from_config(base).decls
    assert model_from_config(listed).decls == expected
    assert model_from_config(typed).decls == expected


def test_llama4_without_chunking_is_all_full():
    cfg = load_preset_config("llama-4-scout")
    cfg["text_config"]["attention_chunk_size"] = None
    assert set(lifetimes(model_from_config(cfg))) == {"full"}


def test_jamba_list_and_period_agree():
    by_period = load_preset_config("jamba-mini")
    by_list = copy.deepcopy(by_period)
    by_list["layers_block_type"] = ["attention" if i % 8 == 4 else "mamba" for i in range(32)]
    assert model_from_config(by_list).decls == model_from_config(by_period).decls


def test_nemotron_h_list_and_pattern_agree():
    by_pattern = load_preset_config("nemotron-h-8b")
    names = {"M": "mamba", "*": "attention", "-": "mlp"}
    by_list = copy.deepcopy(by_pattern)
    by_list["layers_block_type"] = [names[c] for c in by_pattern["hybrid_override_pattern"]]
    assert model_from_config(by_list).decls == model_from_config(by_pattern).decls
    # the list wins: an all-attention list over the hybrid pattern
    by_list["layers_block_type"] = ["attention"] * 52
    assert len(model_from_config(by_list).decls) == 52


def test_nemotron_h_moe_layers_hold_nothing():
    cfg = load_preset_config("nemotron-h-8b")
    cfg["hybrid_override_pattern"] = "MEMEM*EMEME"
    cfg["num_hidden_layers"] = 11
    spec = model_from_config(cfg)
    assert [d.layer_id for d in spec.decls] == [0, 2, 4, 5, 7, 9]


def test_gpt_oss_without_layer_types_alternates_from_sliding():
    cfg = load_preset_config("gpt-oss-20b")
    del cfg["layer_types"]
    assert model_from_config(cfg).decls == model_from_preset("gpt-oss-20b").decls


# ---------------------------------------------------------------- sliding windows in llama-style configs


def test_mistral_sliding_window_applies_to_every_layer():
    # Mistral-7B-v0.1: sliding_window 4096 and no use_sliding_window switch windows every layer;
    # with no full-attention layer the plan's token-id owner mints the ids (DECL-4)
    cfg = config(LLAMA, model_type="mistral", sliding_window=4096)
    assert lifetimes(model_from_config(cfg)) == ["window 4096"] * 4
    assert [p.name for p in plan_kv_storage(model_from_config(cfg).decls).sub_pools] == ["window4096", "tokens"]
    assert lifetimes(model_from_config(config(cfg, sliding_window=None))) == ["full"] * 4
    mixed = config(cfg, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    assert lifetimes(model_from_config(mixed)) == ["window 4096"] * 3 + ["full"]
    assert lifetimes(model_from_config(config(mixed, layer_types=["sliding_attention"] * 4))) == ["window 4096"] * 4


def test_qwen_moe_window_zero_means_off():
    # Qwen1.5-MoE as transformers writes it: sliding_window 0 with the switch off
    cfg = config(LLAMA, model_type="qwen2_moe", sliding_window=0, use_sliding_window=False,
                 layer_types=["full_attention"] * 4)
    assert lifetimes(model_from_config(cfg)) == ["full"] * 4
    assert lifetimes(model_from_config(config(cfg, layer_types=_DROP))) == ["full"] * 4


def test_qwen2_window_needs_the_switch_and_respects_max_window_layers():
    cfg = config(
        LLAMA, model_type="qwen2", sliding_window=131072, use_sliding_window=False, max_window_layers=2
    )
    assert lifetimes(model_from_config(cfg)) == ["full"] * 4
    on = config(cfg, use_sliding_window=True, sliding_window=4096)
    assert lifetimes(model_from_config(on)) == ["full", "full", "window 4096", "window 4096"]


def test_llama_ignores_sliding_window_without_the_switch():
    assert lifetimes(model_from_config(config(LLAMA, sliding_window=4096))) == ["full"] * 4


# ---------------------------------------------------------------- Hymba and DeepSeek-V2


def test_hymba_every_i_layer_reuse_and_no_window():
    cfg = load_preset_config("hymba-1.5b")
    del cfg["kv_reuse_group"]
    cfg["kv_reuse_every_i_layer"] = 2  # odd layers read the previous layer's K/V
    spec = model_from_config(cfg)
    assert [len(d.parts) for d in spec.decls[:4]] == [2, 1, 2, 1]
    cfg["sliding_window"] = None
    assert set(lifetimes(model_from_config(cfg))) == {"full", "-"}


def test_mimo_v2_flash_sliding_layers_keep_twice_the_kv_heads():
    """MiMo-V2-Flash as its hub config states it: 48 layers, global ones first and every sixth, 4
    K/V heads there and 8 (`swa_num_key_value_heads`) on the sliding layers, keys of 192 and values
    of 128 dims, a window of `sliding_window_size` + 1 = 129 tokens. The generic reading planned
    the sliding layers with 4 heads: 122,880 bytes per token where the model keeps 222,720."""
    cfg = {"model_type": "mimo_v2_flash", "num_hidden_layers": 48, "hidden_size": 4096, "num_attention_heads": 64,
           "num_key_value_heads": 4, "swa_num_key_value_heads": 8, "head_dim": 192, "v_head_dim": 128,
           "swa_head_dim": 192, "swa_v_head_dim": 128, "sliding_window_size": 128, "max_position_embeddings": 262144,
           "torch_dtype": "bfloat16"}
    spec = model_from_config(cfg)
    kinds = lifetimes(spec)
    assert [i for i, k in enumerate(kinds) if k == "full"] == [0, *range(5, 48, 6)]
    assert set(kinds) == {"full", "window 129"}
    plan = plan_kv_storage(spec.decls, page_size=64)
    per_token = {p.name: p.unit_bytes for p in plan.sub_pools}
    assert per_token == {"window129": 39 * 8 * (192 + 128) * 2, "full": 9 * 4 * (192 + 128) * 2}
    assert model_from_config(cfg, tp_size=4).decls[1].parts[0].geometry.kv_heads == 2
    assert "'swa_num_key_value_heads'" in error_of({**cfg, "swa_num_key_value_heads": 6}, tp_size=4)
    # without the field, transformers' doubling
    del cfg["swa_num_key_value_heads"]
    assert model_from_config(cfg).decls[1].parts[0].geometry.kv_heads == 8


def test_deepseek_v2_uses_the_mla_parser():
    cfg = load_preset_config("deepseek-v3")
    cfg.update(model_type="deepseek_v2", num_hidden_layers=27, q_lora_rank=None)
    spec = model_from_config(cfg)
    assert spec.family == "deepseek_v3" and len(spec.decls) == 27


# ---------------------------------------------------------------- malformed configs


@pytest.mark.parametrize("bad", [None, [], "llama", 3, [LLAMA]])
def test_config_must_be_an_object(bad):
    assert "JSON object" in error_of(bad)


def test_unknown_model_type_is_read_by_structure():
    spec = model_from_config(config(LLAMA, model_type="not_a_model"))
    assert spec.family == "generic" and lifetimes(spec) == ["full"] * 4
    message = error_of(config(LLAMA, model_type="not_a_model", num_attention_heads=_DROP))
    assert message.startswith("not_a_model config:") and "'num_attention_heads'" in message
    assert "model_type" in error_of(config(LLAMA, model_type=7))
    assert "architectures" in error_of(config(LLAMA, model_type=_DROP))
    assert "architectures" in error_of(config(LLAMA, model_type=_DROP, architectures=["FooForCausalLM"]))


@pytest.mark.parametrize(
    ("preset", "path", "field"),
    [
        ("llama-3.1-8b", ("num_hidden_layers",), "num_hidden_layers"),
        ("llama-3.1-8b", ("num_attention_heads",), "num_attention_heads"),
        ("llama-3.1-8b", ("max_position_embeddings",), "max_position_embeddings"),
        ("qwen3-next-80b", ("linear_key_head_dim",), "linear_key_head_dim"),
        ("qwen3-next-80b", ("linear_conv_kernel_dim",), "linear_conv_kernel_dim"),
        ("jamba-mini", ("mamba_d_state",), "mamba_d_state"),
        ("nemotron-h-8b", ("hybrid_override_pattern",), "hybrid_override_pattern"),
        ("nemotron-h-8b", ("mamba_head_dim",), "mamba_head_dim"),
        ("falcon-h1-7b", ("mamba_n_heads",), "mamba_n_heads"),
        ("deepseek-v3", ("kv_lora_rank",), "kv_lora_rank"),
        ("hymba-1.5b", ("mamba_d_conv",), "mamba_d_conv"),
        ("llama-4-scout", ("text_config", "num_hidden_layers"), "num_hidden_layers"),
    ],
)
def test_missing_required_field_is_named(preset, path, field):
    cfg = load_preset_config(preset)
    target = cfg
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    message = error_of(cfg)
    assert repr(field) in message and "missing" in message
    assert model_from_preset(preset).family in message


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("num_key_value_heads", 0, "positive"),
        ("num_attention_heads", -4, "positive"),
        ("head_dim", 0, "positive"),
        ("num_hidden_layers", 2.5, "integer"),
        ("num_hidden_layers", True, "integer"),
        ("hidden_size", "4096", "integer"),
        ("max_position_embeddings", [8192], "integer"),
        ("num_hidden_layers", 10**12, "implausibly large"),  # fails before building a list per layer
    ],
)
def test_bad_sizes_are_named(field, value, problem):
    message = error_of(config(LLAMA, **{field: value}))
    assert repr(field) in message and problem in message and "llama config" in message


def test_bad_layer_lists_and_patterns_are_named():
    cfg = load_preset_config("gpt-oss-20b")
    cfg["layer_types"][3] = "weird_attention"
    assert "'layer_types'" in error_of(cfg) and "weird_attention" in error_of(cfg)
    cfg["layer_types"] = ["full_attention"] * 5
    assert "5 layers" in error_of(cfg)
    cfg["layer_types"] = "full_attention"
    assert "must be a list" in error_of(cfg)

    nemotron = load_preset_config("nemotron-h-8b")
    nemotron["hybrid_override_pattern"] = "M-X*"
    assert "'hybrid_override_pattern'" in error_of(nemotron) and "X" in error_of(nemotron)
    nemotron["hybrid_override_pattern"] = "----"
    assert "'hybrid_override_pattern'" in error_of(nemotron)
    assert "no layer that keeps KV or recurrent state" in error_of(nemotron)

    scout = load_preset_config("llama-4-scout")
    scout["text_config"]["no_rope_layers"] = [1, 2] * 24
    assert "'no_rope_layers'" in error_of(scout)

    jamba = load_preset_config("jamba-mini")
    jamba["attn_layer_offset"] = 8
    assert "'attn_layer_offset'" in error_of(jamba)

    falcon = load_preset_config("falcon-h1-7b")
    falcon["mamba_d_head"] = 64  # 24 x 64 != mamba_d_ssm 3072
    assert "'mamba_d_head'" in error_of(falcon)

    hymba = load_preset_config("hymba-1.5b")
    hymba["global_attn_idx"] = [0, 99]
    assert "'global_attn_idx'" in error_of(hymba)


def test_text_config_must_be_an_object():
    cfg = load_preset_config("gemma-3-27b")
    cfg["text_config"] = [1, 2]
    assert "'text_config'" in error_of(cfg)


def test_window_kinds_need_a_window_size():
    cfg = load_preset_config("gpt-oss-20b")
    cfg["sliding_window"] = 0
    assert "'sliding_window'" in error_of(cfg)
    qwen = config(LLAMA, model_type="qwen3", layer_types=["sliding_attention"] * 4)
    assert "'sliding_window'" in error_of(qwen) and "missing" in error_of(qwen)


# ---------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("tp", [0, -1, 1.5, "2", True, None])
def test_tp_size_must_be_a_positive_integer(tp):
    assert "tp_size" in error_of(LLAMA, tp_size=tp)


@pytest.mark.parametrize(
    ("preset", "tp", "field"),
    [
        ("llama-3.1-8b", 3, "num_key_value_heads"),  # 8 heads over 3 ranks
        ("llama-3.1-8b", 12, "num_key_value_heads"),  # 12 is not a multiple of 8
        ("hymba-1.5b", 2, "num_key_value_heads"),  # 5 heads over 2 ranks
        ("qwen3-next-80b", 32, "linear_num_key_heads"),  # 16 key heads over 32 ranks
        ("jamba-mini", 3, "num_key_value_heads"),
        ("nemotron-h-8b", 256, "mamba_num_heads"),  # 128 heads, and 8 kv heads replicate fine
        ("falcon-h1-7b", 16, "mamba_n_heads"),  # 24 heads over 16 ranks
    ],
)
def test_tp_that_does_not_divide_is_an_input_error(preset, tp, field):
    message = error_of(load_preset_config(preset), tp_size=tp)
    assert repr(field) in message and f"tp_size {tp}" in message


def test_kv_heads_replicate_when_fewer_than_ranks():
    spec = model_from_config(config(LLAMA, num_key_value_heads=2), tp_size=8)
    assert spec.decls[0].parts[0].geometry.kv_heads == 1


def test_bad_kv_dtype_and_checkpoint_interval():
    assert "KV dtype" in error_of(LLAMA, kv_dtype="int4")
    assert "checkpoint_interval" in error_of(LLAMA, checkpoint_interval=0)
    assert "checkpoint_interval" in error_of(LLAMA, checkpoint_interval="64")


# ---------------------------------------------------------------- fuzzing: only InputError escapes

_PRESET_NAMES = [p.name for p in list_presets()]
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.just(10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=16),
    st.text(max_size=3),
    st.lists(st.integers(-1, 2), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_PRESET_NAMES), st.data())
def test_mutated_configs_parse_or_raise_input_error(name, data):
    cfg = load_preset_config(name)
    target = cfg["text_config"] if "text_config" in cfg and data.draw(st.booleans()) else cfg
    keys = sorted(target)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(keys))
        if data.draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = data.draw(_JUNK)
    tp = data.draw(st.sampled_from([1, 2, 3, 8]))
    try:
        spec = model_from_config(cfg, tp_size=tp)
    except InputError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(spec, ModelSpec)


# ---------------------------------------------------------------- presets and config files


def test_list_presets():
    presets = list_presets()
    assert [p.name for p in presets] == sorted(p.name for p in presets)
    assert all(isinstance(p, PresetInfo) and p.hf_id and p.description for p in presets)
    by_name = {p.name: p for p in presets}
    assert by_name["nemotron-h-8b"] == PresetInfo(
        "nemotron-h-8b",
        "nemotron_h",
        "nvidia/Nemotron-H-8B-Base-8K",
        52,
        by_name["nemotron-h-8b"].description,
    )
    assert by_name["gemma-3-27b"].num_layers == 62 and by_name["gemma-3-27b"].family == "gemma3"
    required = {
        "llama-3.1-8b",
        "llama-3.1-70b",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "gemma-3-27b",
        "gemma-3-12b",
        "llama-4-scout",
        "qwen3-next-80b",
        "jamba-mini",
        "nemotron-h-8b",
        "falcon-h1-7b",
        "deepseek-v3",
        "hymba-1.5b",
    }
    assert required <= set(by_name)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(InputError) as info:
        load_preset_config("llama-9")
    assert "llama-9" in str(info.value) and "llama-3.1-8b" in str(info.value)
    with pytest.raises(InputError):
        model_from_preset("nope")


def test_preset_configs_are_fresh_copies():
    first = load_preset_config("llama-3.1-8b")
    first["num_hidden_layers"] = 1
    assert load_preset_config("llama-3.1-8b")["num_hidden_layers"] == 32
    assert load_preset_config(" Llama-3.1-8B ")["num_hidden_layers"] == 32


def test_load_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    assert load_config_file(path) == LLAMA
    assert load_config_file(str(tmp_path)) == LLAMA  # a checkpoint directory


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "not found"),
        ("{not json", "invalid JSON at line 1"),
        ("[1, 2]", "JSON object"),
        ('"llama"', "JSON object"),
    ],
)
def test_load_config_file_errors(tmp_path, content, problem):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError) as info:
        load_config_file(path)
    assert problem in str(info.value) and "\n" not in str(info.value)


def test_full_lifetime_and_window_types_are_the_decl_ones():
    spec = model_from_preset("gpt-oss-20b")
    assert spec.decls[0].parts[0].lifetime == WindowLifetime(128)
    assert spec.decls[1].parts[0].lifetime == FullLifetime()


# ---------------------------------------------------------------- published hybrid configs (generic path)

# ibm-ai-platform/Bamba-9B: attention on layers 9, 18, 27, Mamba2 elsewhere. Its config.json is not
# among the stored sources; the model card (ibm-fms/Bamba-9B README.md, as mirrored on the web)
# confirms 32 layers, hidden 4096, 32 heads and 8 KV heads (29 Mamba2 + 3 attention layers), not the
# Mamba2 dimensions, which stay as typed here (mamba_d_state 128, not BambaConfig's default 256).
BAMBA_9B = {
    "model_type": "bamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64,
    "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
}


def test_bamba_9b_golden_bytes():
    plan = plan_kv_storage(model_from_config(BAMBA_9B).decls, page_size=64)
    # 3 attention layers x 8 kv heads x (128 + 128) x 2 bytes
    assert plan.by_name("full").unit_bytes == 3 * 8 * 256 * 2 == 12288
    # 29 Mamba2 layers x (conv (128*64 + 2*1*128) x 3 x 2 bytes + ssm 128*64*128 x 4 bytes)
    assert plan.by_name("state").unit_bytes == 29 * ((8192 + 256) * 3 * 2 + 128 * 64 * 128 * 4) == 123104768
    assert plan.by_name("full").layer_ids == (9, 18, 27)
    assert "'attn_layer_indices'" in error_of(config(BAMBA_9B, attn_layer_indices=[9, 40]))
    for none in ([], None):  # no attention layer: every layer Mamba2, a token-id owner
        all_mamba = plan_kv_storage(model_from_config(config(BAMBA_9B, attn_layer_indices=none)).decls)
        assert [p.name for p in all_mamba.sub_pools] == ["state", "tokens"]
        assert all_mamba.state.layer_ids == tuple(range(32))


# LiquidAI/LFM2-1.2B: short-conv layers with attention on full_attn_idxs. Its config.json is not
# among the stored sources; the model card (LiquidAI/LFM2-1.2B README.md, as mirrored on the web)
# confirms 16 layers, 10 conv and 6 attention, which is what these bytes depend on.
LFM2_1_2B = {
    "model_type": "lfm2", "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
    "num_key_value_heads": 8, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3,
    "max_position_embeddings": 128000, "torch_dtype": "bfloat16",
}


def test_lfm2_golden_bytes():
    plan = plan_kv_storage(model_from_config(LFM2_1_2B).decls, page_size=64)
    assert plan.by_name("full").unit_bytes == 6 * 8 * (64 + 64) * 2 == 12288  # head_dim 2048 / 32
    assert plan.by_name("state").unit_bytes == 10 * 2048 * (3 - 1) * 2 == 81920  # conv keeps L_cache - 1
    assert "'full_attn_idxs'" in error_of(config(LFM2_1_2B, full_attn_idxs=[2, 16]))


def test_generic_recurrent_layers_need_state_fields():
    cfg = config(LLAMA, model_type="some_hybrid", layer_types=["linear_attention", "full_attention"] * 2)
    message = error_of(cfg)
    assert "'layer_types'" in message and "linear_num_key_heads" in message
    # recurrent fields without a list saying which layers are recurrent
    assert "'layer_types' is missing" in error_of(config(LLAMA, model_type="some_hybrid", conv_L_cache=3))


def test_zamba_hybrid_layers_hold_attention_and_state():
    cfg = config(LLAMA, model_type="zamba2", layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                 attention_head_dim=256, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
                 n_mamba_heads=128, mamba_headdim=64, mamba_ngroups=1)
    spec = model_from_config(cfg)
    kinds = [sorted("attention" if p.is_attention else "state" for p in d.parts) for d in spec.decls]
    assert kinds == [["state"], ["attention", "state"], ["state"], ["attention", "state"]]
    attention = next(p.geometry for p in spec.decls[1].parts if p.is_attention)
    assert attention == MHA(8, 256, dtype="bfloat16")


@pytest.mark.parametrize(
    ("changes", "kv_heads"),
    [
        ({"num_key_value_heads": _DROP, "multi_query": True}, 1),  # Falcon-7B, SantaCoder
        ({"num_key_value_heads": _DROP, "multi_query": True, "new_decoder_architecture": True,
          "num_kv_heads": 8}, 8),  # Falcon-40B
        ({"num_key_value_heads": _DROP, "multi_query": False}, 32),
    ],
)
def test_generic_kv_heads_follow_falcon_rules(changes, kv_heads):
    spec = model_from_config(config(LLAMA, model_type="falcon", **changes))
    assert spec.decls[0].parts[0].geometry.kv_heads == kv_heads


def test_gpt2_names_are_read_as_the_standard_fields():
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}
    spec = model_from_config(gpt2)
    assert len(spec.decls) == 12 and spec.max_context == 1024
    assert spec.decls[0].parts[0].geometry == MHA(12, 64, dtype="bfloat16")


def test_longcat_caches_two_mla_sublayers_per_layer():
    cfg = {"model_type": "longcat_flash", "num_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "num_attention_heads": 64, "max_position_embeddings": 4096}
    plan = plan_kv_storage(model_from_config(cfg).decls, page_size=64)
    assert plan.by_name("full").unit_bytes == 6 * (512 + 64) * 2


def test_an_mla_indexer_keeps_its_key_beside_the_latent():
    """DeepSeek-V3.2's sparse attention (transformers' defaults for deepseek_v32): every layer keeps
    the latent and rope key, (512 + 64) x 2 bytes, and the indexer's key, 128 fp8 values and one
    float32 scale; `indexed_attention` layers are full attention. Without MLA an indexer is refused."""
    cfg = {"model_type": "deepseek_v32", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "index_n_heads": 64, "index_head_dim": 128, "num_attention_heads": 128,
           "layer_types": ["indexed_attention"] * 61, "max_position_embeddings": 163840}
    plan = plan_kv_storage(model_from_config(cfg).decls, page_size=64)
    assert [p.name for p in plan.sub_pools] == ["full"]
    assert plan.by_name("full").unit_bytes == 61 * ((512 + 64) * 2 + 128 + 4)
    without = {k: v for k, v in cfg.items() if not k.startswith("index_")}
    assert "indexed_attention" in error_of(without)
    assert "'index_n_heads'" in error_of(config(LLAMA, model_type="other", index_n_heads=4))


@pytest.mark.parametrize(
    ("field", "value"),
    [("is_encoder_decoder", True), ("cross_attention_layers", [1]),
     ("index_n_heads", 64), ("block_types", ["recurrent", "attention"])],
)
def test_generic_refuses_unmodelled_structure_by_field(field, value):
    message = error_of(config(LLAMA, model_type="other", **{field: value}))
    assert f"'{field}'" in message and "does not model" in message
    model_from_config(config(LLAMA, model_type="other", **{field: 0 if not isinstance(value, list) else []}))


def test_a_window_covering_the_whole_context_is_full_attention():
    """A sliding window as long as the longest context drops no token: the layer plans as full
    attention, so a model whose every window covers its context has an owner."""
    mistral = {"model_type": "mistral", "num_hidden_layers": 4, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "sliding_window": 32768, "max_position_embeddings": 32768}
    plan = plan_kv_storage(model_from_config(mistral).decls, page_size=64)
    assert [p.name for p in plan.sub_pools] == ["full"] and plan.owner.layer_ids == (0, 1, 2, 3)
    short = plan_kv_storage(model_from_config(config(mistral, sliding_window=32767)).decls, page_size=64)
    assert [p.name for p in short.sub_pools] == ["window32767", "tokens"]  # one token short: windowed
    scout = load_preset_config("llama-4-scout")
    scout["text_config"]["max_position_embeddings"] = 8192  # a chunk still restarts at its boundary
    chunked = plan_kv_storage(model_from_config(scout).decls, page_size=64)
    assert [p.name for p in chunked.sub_pools] == ["chunk8192", "full"]


def test_kv_sharing_layers_declare_no_kv():
    """Gemma 3n: the last `num_kv_shared_layers` layers read an earlier layer's KV and hold none."""
    layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 7  # 35 layers, 7 full
    gemma3n = {"model_type": "gemma3n_text", "num_hidden_layers": 35, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512, "layer_types": layer_types,
               "num_kv_shared_layers": 15, "max_position_embeddings": 32768}
    plan = plan_kv_storage(model_from_config(gemma3n).decls, page_size=64)
    # the first 20 layers hold KV: 16 sliding and 4 full, each 2 heads x (256 + 256) x 2 bytes
    assert plan.by_name("window512").layer_ids == tuple(i for i in range(20) if (i + 1) % 5)
    assert plan.by_name("full").layer_ids == (4, 9, 14, 19)
    assert plan.by_name("window512").unit_bytes == 16 * 2 * 512 * 2
    assert plan.by_name("full").unit_bytes == 4 * 2 * 512 * 2
    assert "'num_kv_shared_layers'" in error_of(config(gemma3n, num_kv_shared_layers=35))
    # a shared full-attention layer with no full-attention layer before it to read from
    no_producer = config(gemma3n, layer_types=["sliding_attention"] * 34 + ["full_attention"], num_kv_shared_layers=1)
    assert "'num_kv_shared_layers'" in error_of(no_producer) and "layer 34" in error_of(no_producer)


def test_generic_refuses_a_kv_cache_per_loop():
    looped = config(LLAMA, model_type="dory", recurrent_kv_cache_mode="per_loop", n_recurrent_loops=2)
    assert "'recurrent_kv_cache_mode'" in error_of(looped)
    model_from_config(config(looped, recurrent_kv_cache_mode="shared"))
