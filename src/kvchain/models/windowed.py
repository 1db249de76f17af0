"""Attention-only families that interleave bounded and global attention layers:
gpt-oss (sliding/full), Gemma 3 (local/global), Llama 4 (chunked/NoPE-global) and MiMo-V2-Flash
(sliding layers with twice the global layers' K/V heads)."""

from __future__ import annotations

import dataclasses

from ..decl import KVPart
from .fields import Fields
from .generic import attention_geometry as kv_geometry
from .parts import Context, FamilyLayers, Kind, attention_geometry, attention_lifetime, kinds_subset

_SLIDING_OR_FULL = kinds_subset(Kind.FULL, Kind.WINDOW)
_CHUNKED_OR_FULL = kinds_subset(Kind.FULL, Kind.CHUNKED)


def parse_gpt_oss(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    """gpt-oss: `layer_types` alternates sliding and full attention (sliding first, as
    transformers derives it when the list is absent); the window is 128 tokens."""
    num_layers = fields.num_layers()
    geometry = attention_geometry(fields, ctx)
    kinds = fields.layer_kinds(("layer_types",), _SLIDING_OR_FULL, num_layers)
    if kinds is None:
        kinds = [Kind.WINDOW if (i + 1) % 2 else Kind.FULL for i in range(num_layers)]
    window = fields.integer("sliding_window", 128)
    layers = [[KVPart(geometry, attention_lifetime(k, window, fields, "sliding_window"))] for k in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))


#: Gemma3TextConfig defaults that published Gemma 3 configs rely on (the 12B and 4B text_config
#: omit head_dim, which is 256 there, not hidden_size // num_attention_heads).
_GEMMA3_DEFAULTS = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131072,
    "sliding_window_pattern": 6,
}


def parse_gemma3(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    """Gemma 3: five local (sliding-window) layers to one global layer. `layer_types` wins;
    otherwise layer i is global when (i + 1) % sliding_window_pattern == 0."""
    num_layers = fields.num_layers()
    geometry = attention_geometry(
        fields,
        ctx,
        heads_default=_GEMMA3_DEFAULTS["num_attention_heads"],
        kv_heads_default=_GEMMA3_DEFAULTS["num_key_value_heads"],
        head_dim_default=_GEMMA3_DEFAULTS["head_dim"],
    )
    kinds = fields.layer_kinds(("layer_types",), _SLIDING_OR_FULL, num_layers)
    if kinds is None:
        pattern = fields.integer("sliding_window_pattern", _GEMMA3_DEFAULTS["sliding_window_pattern"])
        kinds = [Kind.WINDOW if (i + 1) % pattern else Kind.FULL for i in range(num_layers)]
    window = fields.integer("sliding_window", _GEMMA3_DEFAULTS["sliding_window"])
    layers = [[KVPart(geometry, attention_lifetime(k, window, fields, "sliding_window"))] for k in kinds]
    max_context = fields.integer("max_position_embeddings", _GEMMA3_DEFAULTS["max_position_embeddings"])
    return FamilyLayers(layers, max_context)


_LLAMA4_CHUNK_DEFAULT = 8192
_LLAMA4_NOPE_INTERVAL_DEFAULT = 4


def parse_llama4(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    """Llama 4: RoPE layers attend within aligned chunks of `attention_chunk_size` tokens; NoPE
    layers (`no_rope_layers[i] == 0`, every 4th by default) attend globally. `layer_types` wins;
    an empty `no_rope_layers` (as Scout ships) means the default interval, as in transformers."""
    num_layers = fields.num_layers()
    geometry = attention_geometry(fields, ctx)
    chunk = _llama4_chunk(fields)
    kinds = fields.layer_kinds(("layer_types",), _CHUNKED_OR_FULL, num_layers)
    if kinds is None:
        uses_rope = _llama4_rope_layers(fields, num_layers)
        kinds = [Kind.CHUNKED if rope and chunk is not None else Kind.FULL for rope in uses_rope]
    layers = [[KVPart(geometry, attention_lifetime(k, chunk, fields, "attention_chunk_size"))] for k in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))


def _llama4_chunk(fields: Fields) -> int | None:
    if "attention_chunk_size" in fields.values:  # an explicit null turns chunking off
        return fields.optional_integer("attention_chunk_size")
    return _LLAMA4_CHUNK_DEFAULT


def _llama4_rope_layers(fields: Fields, num_layers: int) -> list[bool]:
    flags = fields.integers("no_rope_layers")
    if flags:
        if len(flags) != num_layers:
            raise fields.error(
                "no_rope_layers", f"lists {len(flags)} layers but num_hidden_layers is {num_layers}"
            )
        if any(f not in (0, 1) for f in flags):
            raise fields.error("no_rope_layers", "entries must be 0 (NoPE, global) or 1 (RoPE, chunked)")
        return [bool(f) for f in flags]
    interval = fields.integer("no_rope_layer_interval", _LLAMA4_NOPE_INTERVAL_DEFAULT)
    return [(i + 1) % interval != 0 for i in range(num_layers)]


def parse_mimo_v2_flash(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    """MiMo-V2-Flash: the first layer and every sixth are global, the rest slide. A sliding layer
    keeps twice the global layers' K/V heads (`swa_num_key_value_heads` in the hub's config; the
    doubling is hard-coded in transformers' model, which ignores that field), keys of `head_dim`
    and values of `v_head_dim` in both. The hub's `sliding_window_size` counts the tokens before the
    query, so the window is one more (as transformers reads it)."""
    num_layers = fields.num_layers()
    full = kv_geometry(fields, ctx)
    global_heads = fields.integer("num_key_value_heads")
    swa_heads = fields.integer("swa_num_key_value_heads", 2 * global_heads)
    sliding = dataclasses.replace(full, kv_heads=fields.split_heads("swa_num_key_value_heads", swa_heads, ctx.tp))
    kinds = fields.layer_kinds(("layer_types",), _SLIDING_OR_FULL, num_layers)
    if kinds is None:
        kinds = [Kind.FULL if i == 0 or (i + 1) % 6 == 0 else Kind.WINDOW for i in range(num_layers)]
    size = fields.optional_integer("sliding_window_size", minimum=1)
    window = size + 1 if size is not None else fields.window()
    layers = [[KVPart(sliding if k is Kind.WINDOW else full, attention_lifetime(k, window, fields, "sliding_window"))]
              for k in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))
