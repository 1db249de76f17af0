"""Golden declarations and plans for every stored preset.

Each expected byte count is derived by hand from the preset's config in the comment next to it:
attention sub-pools hold bytes per token (all their layers), state sub-pools bytes per slot."""

from __future__ import annotations

import pytest

from kvchain.decl import MHA, MLA, FullLifetime, State, StateLifetime, WindowLifetime
from kvchain.models import list_presets, model_from_preset
from kvchain.plan import plan_kv_storage


def chain(name: str, **kwargs) -> list[tuple[str, int, int]]:
    """(sub-pool name, layer count, unit bytes) in chain order."""
    spec = model_from_preset(name, **kwargs)
    plan = plan_kv_storage(spec.decls, page_size=64)
    return [(p.name, len(p.layer_ids), p.unit_bytes) for p in plan.sub_pools]


def layer_ids(name: str, pool: str, **kwargs) -> tuple[int, ...]:
    spec = model_from_preset(name, **kwargs)
    return plan_kv_storage(spec.decls, page_size=64).by_name(pool).layer_ids


def test_every_preset_has_a_golden_case():
    assert {p.name for p in list_presets()} == set(GOLDEN)


GOLDEN: dict[str, list[tuple[str, int, int]]] = {
    "llama-3.1-8b": [
        # 32 layers x 8 kv heads x (128 + 128) x 2 bytes (bf16) = 131072
        ("full", 32, 131072),
    ],
    "llama-3.1-70b": [
        # 80 layers x 8 kv heads x (128 + 128) x 2 bytes = 327680 (head_dim = 8192 / 64 = 128)
        ("full", 80, 327680),
    ],
    "gpt-oss-20b": [
        # 24 layers / 2 = 12 window layers x 8 kv heads x (64 + 64) x 2 bytes = 24576
        ("window128", 12, 24576),
        # the other 12 layers, same geometry: 12 x 8 x 128 x 2 = 24576
        ("full", 12, 24576),
    ],
    "gpt-oss-120b": [
        # 36 layers / 2 = 18 window layers x 8 kv heads x (64 + 64) x 2 bytes = 36864
        ("window128", 18, 36864),
        # 18 full layers x 8 x 128 x 2 = 36864
        ("full", 18, 36864),
    ],
    "gemma-3-27b": [
        # 62 layers, every 6th global -> 10 global, 52 local; 52 x 16 kv heads x (128 + 128) x 2 = 425984
        ("window1024", 52, 425984),
        # 10 x 16 x 256 x 2 = 81920
        ("full", 10, 81920),
    ],
    "gemma-3-12b": [
        # 48 layers -> 8 global, 40 local; head_dim absent -> Gemma 3 default 256:
        # 40 x 8 kv heads x (256 + 256) x 2 = 327680
        ("window1024", 40, 327680),
        # 8 x 8 x 512 x 2 = 65536
        ("full", 8, 65536),
    ],
    "llama-4-scout": [
        # no_rope_layers [] -> every 4th layer NoPE/global: 12 global, 36 chunked;
        # 36 x 8 kv heads x (128 + 128) x 2 = 147456
        ("chunk8192", 36, 147456),
        # 12 x 8 x 256 x 2 = 49152
        ("full", 12, 49152),
    ],
    "qwen3-next-80b": [
        # 48 layers, full_attention_interval 4 -> 36 linear layers. Per layer:
        # conv: conv_dim = 2 x 16 x 128 + 32 x 128 = 8192 channels x (4 - 1) x 2 bytes = 49152
        # ssm: 32 value heads x 128 x 128 x 4 bytes (fp32) = 2097152
        # 36 x (49152 + 2097152) = 77266944
        ("state", 36, 77266944),
        # 12 full layers x 2 kv heads x (256 + 256) x 2 bytes = 24576
        ("full", 12, 24576),
    ],
    "jamba-mini": [
        # 32 layers, attention where i % 8 == 4 -> 4 attention, 28 Mamba1. intermediate = 2 x 4096 = 8192:
        # conv 8192 x (4 - 1) x 2 = 49152; ssm 8192 x 16 x 4 = 524288; 28 x 573440 = 16056320
        ("state", 28, 16056320),
        # 4 x 8 kv heads x (128 + 128) x 2 = 16384 (head_dim = 4096 / 32)
        ("full", 4, 16384),
    ],
    "nemotron-h-8b": [
        # pattern: 24 "M", 4 "*", 24 "-". Mamba2: intermediate = 128 heads x 64 = 8192,
        # conv_dim = 8192 + 2 x 8 groups x 128 = 10240 x (4 - 1) x 2 = 61440;
        # ssm = 128 x 64 x 128 x 4 = 4194304; 24 x 4255744 = 102137856
        ("state", 24, 102137856),
        # 4 x 8 kv heads x (128 + 128) x 2 = 16384
        ("full", 4, 16384),
    ],
    "falcon-h1-7b": [
        # every one of 44 layers: d_ssm 3072 = 24 heads x 128, conv_dim = 3072 + 2 x 1 x 256 = 3584
        # x (4 - 1) x 2 = 21504; ssm = 24 x 128 x 256 x 4 = 3145728; 44 x 3167232 = 139358208
        ("state", 44, 139358208),
        # 44 x 2 kv heads x (128 + 128) x 2 = 45056
        ("full", 44, 45056),
    ],
    "deepseek-v3": [
        # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70272
        ("full", 61, 70272),
    ],
    "falcon-mamba-7b": [
        # tiiuae/falcon-mamba-7b (the published config.json as copied in sdpython/experimental-experiment,
        # experimental_experiment/torch_models/llm_model_helper.py): 64 Mamba1 layers, intermediate_size
        # 8192 (its `expand` of 16 is not what sizes the mixer); conv 8192 x (4 - 1) x 2 = 49152,
        # ssm 8192 x 16 x 4 = 524288; 64 x 573440 = 36700160
        ("state", 64, 36700160),
        # no attention: the token-id owner mints the virtual ids with no layers and no KV bytes
        ("tokens", 0, 0),
    ],
    "hymba-1.5b": [
        # all 32 layers hold Mamba1 state: intermediate = 2 x 1600 = 3200,
        # conv 3200 x (4 - 1) x 2 = 19200; ssm 3200 x 16 x 4 = 204800; 32 x 224000 = 7168000
        ("state", 32, 7168000),
        # KV producers outside global_attn_idx: 1,3,..,13 (7) + 16 + 19,21,..,29 (6) = 14 layers;
        # 5 kv heads x (k 64 = 1600/25 + v 128 = 3200/25) x 2 bytes = 1920; 14 x 1920 = 26880
        ("window1024", 14, 26880),
        # global layers 0, 15, 31: 3 x 1920 = 5760
        ("full", 3, 5760),
    ],
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_preset_chain(name):
    assert chain(name) == GOLDEN[name]


TP_GOLDEN: list[tuple[str, int, list[tuple[str, int, int]]]] = [
    # 8 kv heads / 8 ranks = 1 head per rank: 80 x 1 x (128 + 128) x 2 = 40960
    ("llama-3.1-70b", 8, [("full", 80, 40960)]),
    # 8 kv heads / 8 = 1: 18 x 1 x 128 x 2 = 4608 for each half
    ("gpt-oss-120b", 8, [("window128", 18, 4608), ("full", 18, 4608)]),
    # 16 kv heads / 2 = 8: 52 x 8 x 256 x 2 = 212992 and 10 x 8 x 256 x 2 = 40960
    ("gemma-3-27b", 2, [("window1024", 52, 212992), ("full", 10, 40960)]),
    (
        "qwen3-next-80b",
        2,
        [
            # per rank 8 key heads, 16 value heads: conv_dim = 2 x 8 x 128 + 16 x 128 = 4096
            # x 3 x 2 = 24576; ssm 16 x 128 x 128 x 4 = 1048576; 36 x 1073152 = 38633472
            ("state", 36, 38633472),
            # 2 kv heads / 2 = 1: 12 x 1 x 512 x 2 = 12288
            ("full", 12, 12288),
        ],
    ),
    (
        "qwen3-next-80b",
        4,
        [
            # 4 key heads, 8 value heads per rank: conv_dim = 2 x 4 x 128 + 8 x 128 = 2048
            # x 3 x 2 = 12288; ssm 8 x 128 x 128 x 4 = 524288; 36 x 536576 = 19316736
            ("state", 36, 19316736),
            # 2 kv heads < 4 ranks -> replicated, 1 per rank: 12 x 1 x 512 x 2 = 12288
            ("full", 12, 12288),
        ],
    ),
    (
        "jamba-mini",
        2,
        [
            # intermediate 8192 / 2 = 4096: conv 4096 x 3 x 2 = 24576; ssm 4096 x 16 x 4 = 262144;
            # 28 x 286720 = 8028160
            ("state", 28, 8028160),
            # 8 kv heads / 2 = 4: 4 x 4 x 256 x 2 = 8192
            ("full", 4, 8192),
        ],
    ),
    (
        "nemotron-h-8b",
        8,
        [
            # 128 heads / 8 = 16, 8 groups / 8 = 1: conv_dim = 16 x 64 + 2 x 1 x 128 = 1280 x 3 x 2 = 7680;
            # ssm 16 x 64 x 128 x 4 = 524288; 24 x 531968 = 12767232
            ("state", 24, 12767232),
            # 8 kv heads / 8 = 1: 4 x 1 x 256 x 2 = 2048
            ("full", 4, 2048),
        ],
    ),
    (
        "falcon-h1-7b",
        2,
        [
            # 24 heads / 2 = 12; the single B/C group is replicated on each rank:
            # conv_dim = 12 x 128 + 2 x 1 x 256 = 2048 x 3 x 2 = 12288; ssm 12 x 128 x 256 x 4 = 1572864;
            # 44 x 1585152 = 69746688
            ("state", 44, 69746688),
            # 2 kv heads / 2 = 1: 44 x 1 x 256 x 2 = 22528
            ("full", 44, 22528),
        ],
    ),
    # MLA latents are not split by TP: still 61 x 576 x 2 = 70272 per rank
    ("deepseek-v3", 8, [("full", 61, 70272)]),
]


@pytest.mark.parametrize(("name", "tp", "expected"), TP_GOLDEN, ids=[f"{n}-tp{t}" for n, t, _ in TP_GOLDEN])
def test_preset_chain_under_tensor_parallelism(name, tp, expected):
    assert chain(name, tp_size=tp) == expected
    assert model_from_preset(name, tp_size=tp).tp_size == tp


def test_layer_placement():
    # gpt-oss: even layers slide, odd layers are full
    assert layer_ids("gpt-oss-20b", "window128") == tuple(range(0, 24, 2))
    # Gemma 3: layer i is global when (i + 1) % 6 == 0
    assert layer_ids("gemma-3-27b", "full") == tuple(range(5, 62, 6))
    # Llama 4: NoPE (global) every 4th layer
    assert layer_ids("llama-4-scout", "full") == tuple(range(3, 48, 4))
    # Qwen3-Next: full attention every 4th layer
    assert layer_ids("qwen3-next-80b", "full") == tuple(range(3, 48, 4))
    # Jamba: attention at i % 8 == 4
    assert layer_ids("jamba-mini", "full") == (4, 12, 20, 28)
    # Nemotron-H: "*" positions in the pattern; MLP layers ("-") hold nothing
    assert layer_ids("nemotron-h-8b", "full") == (7, 18, 29, 40)
    assert len(model_from_preset("nemotron-h-8b").decls) == 28
    # Hymba: globals 0/15/31; KV consumers (2, 4, .., 14, 17, 18, 20, .., 30) hold state only
    assert layer_ids("hymba-1.5b", "full") == (0, 15, 31)
    assert layer_ids("hymba-1.5b", "window1024") == (1, 3, 5, 7, 9, 11, 13, 16, 19, 21, 23, 25, 27, 29)


def test_hymba_chain_has_a_floating_window_band():
    plan = plan_kv_storage(model_from_preset("hymba-1.5b").decls, page_size=64)
    assert [p.placement.value for p in plan.sub_pools] == ["up-end", "float", "down-end"]
    assert [p.name for p in plan.floats] == ["window1024"]


def test_declared_geometries():
    llama = model_from_preset("llama-3.1-8b")
    assert llama.decls[0].parts[0].geometry == MHA(8, 128, dtype="bfloat16")
    assert llama.max_context == 131072 and llama.family == "llama" and llama.name == "llama-3.1-8b"

    scout = model_from_preset("llama-4-scout")
    assert scout.decls[0].parts[0].lifetime == WindowLifetime(8192, chunked=True)
    assert scout.decls[3].parts[0].lifetime == FullLifetime()
    assert scout.max_context == 10485760

    next_state = model_from_preset("qwen3-next-80b").decls[0].parts[0].geometry
    assert isinstance(next_state, State)
    assert [(t.name, t.shape, t.dtype) for t in next_state.tensors] == [
        ("conv", (8192, 3), "bfloat16"),
        ("ssm", (32, 128, 128), "float32"),
    ]

    falcon = model_from_preset("falcon-h1-7b").decls[0]
    assert [type(p.geometry) for p in falcon.parts] == [MHA, State]
    assert falcon.parts[1].geometry.tensors[1].shape == (24, 128, 256)

    hymba = model_from_preset("hymba-1.5b").decls[1].parts[1].geometry
    assert hymba == MHA(5, 64, v_head_dim=128, dtype="bfloat16")

    deepseek = model_from_preset("deepseek-v3").decls[0].parts[0].geometry
    assert deepseek == MLA(512, 64, dtype="bfloat16")


def test_kv_dtype_overrides_attention_only():
    # fp8 KV halves attention bytes: 32 x 8 x 256 x 1 = 65536
    assert chain("llama-3.1-8b", kv_dtype="fp8") == [("full", 32, 65536)]
    # MLA too: 61 x 576 x 1 = 35136
    assert chain("deepseek-v3", kv_dtype="float8_e4m3fn") == [("full", 61, 35136)]
    # recurrent state keeps the model dtype (conv) and float32 (ssm): Jamba state bytes unchanged,
    # attention 4 x 8 x 256 x 1 = 8192
    assert chain("jamba-mini", kv_dtype="fp8") == [("state", 28, 16056320), ("full", 4, 8192)]


def test_checkpoint_interval_reaches_every_state_part():
    spec = model_from_preset("falcon-h1-7b", checkpoint_interval=256)
    lifetimes = {p.lifetime for d in spec.decls for p in d.parts if not p.is_attention}
    assert lifetimes == {StateLifetime(256)}
    default = model_from_preset("falcon-h1-7b")
    assert {p.lifetime for d in default.decls for p in d.parts if not p.is_attention} == {StateLifetime(None)}
