"""Every causal-LM config class the installed transformers ships, built with its defaults, is either
planned with the bytes an independent reading of the config object gives, or refused naming a field.

The expected bytes are computed here from the transformers config object's attributes (its derived
layer lists and properties included), not by calling the parser. The coverage table in
docs/models.md is generated from the same rows: `python tests/unit/models/test_transformers_coverage.py
--write` rewrites it, and `test_coverage_table_in_docs_is_current` holds it current."""

from __future__ import annotations

import logging
import re
import sys
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from kvchain.decl import State
from kvchain.errors import InputError
from kvchain.models import model_from_config
from kvchain.plan import plan_kv_storage

transformers = pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"
START, END = "<!-- coverage:start -->", "<!-- coverage:end -->"

#: Fields a refusal may name although a default config dict omits them (they are what is missing).
STANDARD_FIELDS = {
    "num_hidden_layers", "num_attention_heads", "max_position_embeddings", "layer_types", "head_dim",
    "hidden_size",
}

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Row:
    model_type: str
    result: str  # "planned: <chain>", "refused: '<field>'", or why no config was built
    per_token: int | None = None
    per_slot: int | None = None
    expected_token: int | None = None
    expected_slot: int | None = None
    message: str = ""
    fields: frozenset[str] = frozenset()


# ---------------------------------------------------------------- the independent reading


def attr(cfg, *names, default=None):
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def attention_bytes(t) -> int:
    """K/V bytes one token of one attention layer holds (bf16)."""
    if attr(t, "kv_lora_rank"):
        # a sparse-attention indexer (DeepSeek-V3.2) keeps its key beside the latent: fp8 values
        # and a float32 scale per 128 of them
        index = t.index_head_dim + 4 * (t.index_head_dim // 128) if attr(t, "index_n_heads") else 0
        return (t.kv_lora_rank + t.qk_rope_head_dim) * BF16 + index
    heads = t.num_attention_heads
    kv_heads = attr(t, "num_key_value_heads", default=heads)
    if hasattr(t, "new_decoder_architecture"):  # Falcon's attention: one K/V head under multi_query
        kv_heads = t.num_kv_heads if t.new_decoder_architecture or not t.multi_query else 1
    head_dim = attr(t, "head_dim", "attention_head_dim", default=t.hidden_size // heads)
    return kv_heads * (head_dim + attr(t, "v_head_dim", default=head_dim)) * BF16


def state_bytes(t) -> int:
    """Bytes one request slot of one recurrent layer holds: conv (bf16) plus SSM state (fp32)."""
    if attr(t, "linear_num_key_heads"):  # Gated DeltaNet
        nk, nv, dk, dv = (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim,
                          t.linear_value_head_dim)
        return (2 * nk * dk + nv * dv) * (t.linear_conv_kernel_dim - 1) * BF16 + nv * dk * dv * FP32
    if attr(t, "linear_num_heads"):  # Kimi Delta Attention
        h, d = t.linear_num_heads, t.linear_head_dim
        return 3 * h * d * (t.linear_conv_kernel_dim - 1) * BF16 + h * d * d * FP32
    if attr(t, "lru_width"):  # RecurrentGemma: conv1d over lru_width (bf16), RG-LRU state (fp32)
        return t.lru_width * (t.conv1d_width - 1) * BF16 + t.lru_width * FP32
    if hasattr(t, "state_size") and not hasattr(t, "num_attention_heads"):  # Mamba, Mamba2: no attention
        inner = int(t.expand * t.hidden_size)
        if hasattr(t, "n_groups"):  # Mamba2: conv over x, B and C; SSM state per head
            conv = inner + 2 * t.n_groups * t.state_size
            return conv * (t.conv_kernel - 1) * BF16 + t.num_heads * t.head_dim * t.state_size * FP32
        return inner * (t.conv_kernel - 1) * BF16 + inner * t.state_size * FP32
    heads = attr(t, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    head_dim = attr(t, "mamba_d_head", "mamba_head_dim", "mamba_headdim")
    d_state = attr(t, "mamba_d_state", "ssm_state_size")
    d_conv = attr(t, "mamba_d_conv", "conv_kernel")
    if heads and head_dim:  # Mamba2
        groups = attr(t, "mamba_n_groups", "n_groups", "mamba_ngroups")
        conv = heads * head_dim + 2 * groups * d_state
        return conv * (d_conv - 1) * BF16 + heads * head_dim * d_state * FP32
    if attr(t, "mamba_expand"):  # Mamba1
        inner = t.mamba_expand * t.hidden_size
        return inner * (d_conv - 1) * BF16 + inner * d_state * FP32
    if attr(t, "conv_L_cache"):  # LFM2 short conv
        return t.hidden_size * (t.conv_L_cache - 1) * BF16
    heads = t.num_attention_heads  # MiniMax lightning attention
    head_dim = attr(t, "head_dim", default=t.hidden_size // heads)
    return heads * head_dim * head_dim * FP32


def layer_names(t) -> list[str]:
    names = attr(t, "layer_types", "layers_block_type")
    if names is not None:
        return list(names)
    if hasattr(t, "state_size") and not hasattr(t, "num_attention_heads"):
        return ["mamba"] * t.num_hidden_layers
    window = attr(t, "sliding_window")
    if window and attr(t, "use_sliding_window", default=True):
        return ["sliding_attention"] * t.num_hidden_layers
    return ["full_attention"] * t.num_hidden_layers


def expected_bytes(t) -> tuple[int, int]:
    """(bytes per token, bytes per state slot) over every layer of the text config `t`."""
    per_token = per_slot = 0
    names = layer_names(t)
    shared = attr(t, "num_kv_shared_layers", default=0)  # Gemma 3n: the last ones reuse earlier KV
    for name in names[: len(names) - shared]:
        if name in ("full_attention", "attention", "indexed_attention", "sliding_attention", "chunked_attention",
                    "hybrid"):
            per_token += attention_bytes(t)
            if name == "sliding_attention" and t.model_type == "mimo_v2_flash":
                per_token += attention_bytes(t)  # its model gives sliding layers twice the K/V heads
        if name in ("linear_attention", "mamba", "conv", "hybrid"):
            per_slot += state_bytes(t)
    return per_token, per_slot


# ---------------------------------------------------------------- the rows


def build(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type]()


@cache
def rows() -> tuple[Row, ...]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    logging.getLogger("transformers").setLevel(logging.ERROR)
    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            hf = build(model_type)
        except Exception as exc:  # a config class whose own defaults fail its validation
            out.append(Row(model_type, f"defaults do not build ({type(exc).__name__})"))
            continue
        out.append(row(model_type, hf))
    return tuple(out)


def row(model_type: str, hf) -> Row:
    config = hf.to_dict()
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    names = frozenset(config) | frozenset(text)
    try:
        spec = model_from_config(config)
    except InputError as exc:
        field = re.search(r"'([A-Za-z_]\w*)", str(exc))
        named = field.group(1) if field else "?"
        return Row(model_type, f"refused: '{named}'", message=str(exc), fields=names)
    plan = plan_kv_storage(spec.decls, page_size=64)
    slot = sum(p.unit_bytes for p in plan.sub_pools if isinstance(p.geometry, State))
    token = sum(p.unit_bytes for p in plan.sub_pools if not isinstance(p.geometry, State))
    expected = expected_bytes(getattr(hf, "text_config", None) or hf)
    chain = ", ".join(p.name for p in plan.sub_pools)
    return Row(model_type, f"planned: {chain}", token, slot, *expected)


def table() -> str:
    planned = [r for r in rows() if r.result.startswith("planned")]
    lines = [
        f"transformers {transformers.__version__}: {len(rows())} causal-LM model types, "
        f"{len(planned)} planned, {len(rows()) - len(planned)} refused.",
        "",
        "| model type | result | bytes per token | bytes per state slot |",
        "| - | - | -: | -: |",
    ]
    for r in rows():
        token = "" if r.per_token is None else f"{r.per_token:,}"
        slot = "" if r.per_slot is None else f"{r.per_slot:,}"
        lines.append(f"| {r.model_type} | {r.result} | {token} | {slot} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- tests


def test_every_causal_lm_config_is_planned_exactly_or_refused_by_field():
    for r in rows():
        if r.result.startswith("planned"):
            assert (r.per_token, r.per_slot) == (r.expected_token, r.expected_slot), r
        elif r.result.startswith("refused"):
            assert "\n" not in r.message
            named = set(re.findall(r"'([A-Za-z_]\w*)'", r.message))
            assert named & (r.fields | STANDARD_FIELDS), r


def test_the_hybrids_and_windowed_families_are_planned():
    planned = {r.model_type for r in rows() if r.result.startswith("planned")}
    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "zamba", "zamba2",
                       "lfm2", "kimi_linear", "minimax", "gemma2", "cohere2", "olmo2", "olmo3", "phi3",
                       "exaone4", "smollm3", "seed_oss", "hunyuan_v1_dense", "qwen2_moe",
                       "mamba", "mamba2", "falcon_mamba", "bamba", "granitemoehybrid", "gemma3n", "gemma3n_text",
                       "ministral", "mistral", "recurrent_gemma"):
        assert model_type in planned, model_type


def test_coverage_table_in_docs_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert START in text and END in text
    current = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert current == table(), "docs/models.md is stale: run this file with --write"


def write_doc() -> None:
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{table()}\n{END}{tail}", encoding="utf-8")


if __name__ == "__main__" and "--write" in sys.argv:
    write_doc()
