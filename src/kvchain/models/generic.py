"""The one structural path: any decoder config that states its layers the way transformers does.

Which layer keeps what comes from the first structure field present: a `layer_types` or
`layers_block_type` list, attention layer indices (`attn_layer_indices`, `full_attn_idxs`), a
`hybrid_override_pattern`, a `full_attention_interval`, a `sliding_window_pattern`, and last a
`sliding_window` on every layer. Attention is MLA when the config has MLA ranks, else (grouped)
multi-head; recurrent layers keep the state `recurrent.py` reads from the config's head fields.
Structures kvchain does not model are refused by name instead of being planned wrongly."""

from __future__ import annotations

from ..decl import MHA, MLA, FullLifetime, Geometry, KVPart, WindowLifetime
from .fields import Fields
from .parts import LAYER_TYPE_KINDS, Context, FamilyLayers, Kind, LayerParts
from .recurrent import has_recurrent_fields, recurrent_state

#: Layer names a generic config may use: transformers' standard ones, LFM2's `conv`, Zamba's `hybrid`.
KINDS = {**LAYER_TYPE_KINDS, "conv": Kind.RECURRENT, "hybrid": Kind.HYBRID}
#: with an MLA indexer (DeepSeek-V3.2's sparse attention): an indexed layer keeps every token's
#: latent and indexer key, and its indexer picks which of them attention reads
INDEXED_KINDS = {**KINDS, "indexed_attention": Kind.FULL}

_PATTERN_KINDS = {"M": Kind.RECURRENT, "*": Kind.FULL, "-": Kind.NONE, "E": Kind.NONE}

#: Fields that, when set (truthy), mean a structure whose cache kvchain does not declare.
UNMODELLED = {
    "is_encoder_decoder": "encoder-decoder models (the decoder also caches cross-attention)",
    "cross_attention_layers": "cross-attention layers",
    "per_layer_config": "per-layer attention settings",
    "num_attention_heads_per_layer": "a head count that varies by layer",
    "block_types": "RG-LRU recurrent blocks",
    "attn_layers": "LSH and local attention layers",
}

#: Fields whose one value means such a structure: Dory's looped layers keep a cache per loop.
UNMODELLED_VALUES = {"recurrent_kv_cache_mode": ("per_loop", "layers looped with a KV cache per loop")}


#: GPT-2-era names of the standard fields (transformers maps them with an `attribute_map`).
ALIASES = {
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
}


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    fields = with_standard_names(fields)
    _refuse_unmodelled(fields)
    num_layers = fields.num_layers()
    kinds, source = layer_kinds(fields, num_layers)
    kinds = _without_kv_sharing_layers(fields, kinds)
    attention = _attention_parts(fields, ctx, kinds)
    state = None
    if any(k in (Kind.RECURRENT, Kind.HYBRID) for k in kinds):
        state = recurrent_state(fields, ctx, source)
    layers: list[LayerParts] = []
    for kind in kinds:
        if kind is Kind.NONE:
            layers.append(None)
        elif kind is Kind.RECURRENT:
            layers.append([state])
        elif kind is Kind.HYBRID:
            layers.append([attention[Kind.FULL], state])
        else:
            layers.append([attention[kind]])
    return FamilyLayers(layers, fields.first_integer(("max_position_embeddings", "model_max_length")))


def with_standard_names(fields: Fields) -> Fields:
    """The config's fields with GPT-2-era names (`n_layer`, `n_head`, ...) read as the standard ones."""
    values = fields.values
    filled = {std: values[old] for std, old in ALIASES.items() if values.get(std) is None and old in values}
    if not filled:
        return fields
    return Fields({**values, **filled}, fields.family, outer=fields.outer)


def layer_kinds(fields: Fields, num_layers: int) -> tuple[list[Kind], str]:
    """Per-layer kinds, and the field they were read from (named in later errors)."""
    known = INDEXED_KINDS if _mla_indexer(fields) else KINDS
    for name in ("layer_types", "layers_block_type"):
        kinds = fields.layer_kinds((name,), known, num_layers)
        if kinds is not None:
            return kinds, name
    if "attn_layer_indices" in fields.values and not fields.values["attn_layer_indices"] and (
        has_recurrent_fields(fields)
    ):  # Bamba: a null or empty list means no attention layer (transformers' `layers_block_type`)
        return [Kind.RECURRENT] * num_layers, "attn_layer_indices"
    for name in ("attn_layer_indices", "full_attn_idxs"):
        indices = fields.integers(name)
        if indices is not None:
            for i in indices:
                if i >= num_layers:
                    raise fields.error(name, f"names layer {i}, but the model has {num_layers} layers")
            return [Kind.FULL if i in indices else Kind.RECURRENT for i in range(num_layers)], name
    pattern = fields.string("hybrid_override_pattern")
    if pattern:
        return _pattern_kinds(fields, pattern, num_layers), "hybrid_override_pattern"
    if fields.present("full_attention_interval"):
        interval = fields.integer("full_attention_interval")
        kinds = [Kind.FULL if (i + 1) % interval == 0 else Kind.RECURRENT for i in range(num_layers)]
        return kinds, "full_attention_interval"
    if has_recurrent_fields(fields):
        raise fields.error(
            "layer_types",
            "is missing: the config has recurrent-state fields but no list or pattern saying which "
            "layers are recurrent (expected 'layer_types', 'layers_block_type' or 'attn_layer_indices')",
        )
    window = fields.window()
    for name in ("sliding_window_pattern", "_sliding_window_pattern"):
        if window is not None and fields.present(name):
            every = fields.integer(name)
            return [Kind.WINDOW if (i + 1) % every else Kind.FULL for i in range(num_layers)], name
    if window is not None and fields.flag("use_sliding_window", True):
        return [Kind.WINDOW] * num_layers, "sliding_window"
    return [Kind.FULL] * num_layers, "num_hidden_layers"


def _attention_parts(fields: Fields, ctx: Context, kinds: list[Kind]) -> dict[Kind, KVPart]:
    wanted = {Kind.FULL if k is Kind.HYBRID else k for k in kinds} - {Kind.RECURRENT, Kind.NONE}
    if not wanted:
        return {}
    geometry = attention_geometry(fields, ctx)
    parts = {}
    for kind in wanted:
        if kind is Kind.FULL:
            parts[kind] = KVPart(geometry, FullLifetime())
        elif kind is Kind.WINDOW:
            window = fields.window()
            if window is None:
                raise fields.error(
                    "sliding_window", "is missing, yet the config has sliding attention layers"
                )
            parts[kind] = KVPart(geometry, WindowLifetime(window))
        else:
            chunk = fields.optional_integer("attention_chunk_size")
            if chunk is None:
                raise fields.error(
                    "attention_chunk_size", "is missing, yet the config has chunked attention layers"
                )
            parts[kind] = KVPart(geometry, WindowLifetime(chunk, chunked=True))
    return parts


def attention_geometry(fields: Fields, ctx: Context) -> Geometry:
    """MLA (a `kv_lora_rank` latent plus a `qk_rope_head_dim` rope key, not split over TP ranks)
    when the config has MLA ranks; else K/V heads of `head_dim` (or `attention_head_dim`, or
    hidden_size // heads; JetMoe calls it `kv_channels`) and values of `v_head_dim` where that differs."""
    if fields.present("kv_lora_rank"):
        return MLA(
            fields.integer("kv_lora_rank"), fields.integer("qk_rope_head_dim", minimum=0), dtype=ctx.kv_dtype,
            index_head_dim=fields.integer("index_head_dim") if _mla_indexer(fields) else 0,
        )
    if not fields.present("num_attention_heads") and fields.present("state_size"):
        raise fields.error(
            "num_attention_heads",
            "is missing: every layer is a Mamba mixer ('state_size') and none attends, but kvchain's "
            "chain needs a full-attention layer to own the token ids",
        )
    heads = fields.integer("num_attention_heads")
    kv_heads = kv_head_count(fields, heads)
    head_dim = fields.head_dim(heads, names=("head_dim", "attention_head_dim", "kv_channels"))
    v_head_dim = fields.optional_integer("v_head_dim")
    per_rank = fields.split_heads("num_key_value_heads", kv_heads, ctx.tp)
    v_dim = None if v_head_dim == head_dim else v_head_dim
    return MHA(per_rank, head_dim, v_head_dim=v_dim, dtype=ctx.kv_dtype)


def kv_head_count(fields: Fields, heads: int) -> int:
    """`num_key_value_heads`; else Falcon's rule: `num_kv_heads` under the new decoder architecture,
    one shared head under `multi_query` (Falcon-7B, SantaCoder), else one per attention head."""
    if fields.present("num_key_value_heads"):
        return fields.integer("num_key_value_heads")
    if not fields.flag("new_decoder_architecture", False) and fields.flag("multi_query", False):
        return 1
    return fields.integer("num_kv_heads", heads)


def _without_kv_sharing_layers(fields: Fields, kinds: list[Kind]) -> list[Kind]:
    """Gemma 3n: the last `num_kv_shared_layers` layers read the KV of the last earlier layer of
    their own attention type and cache none of their own, so they declare nothing."""
    shared = fields.integer("num_kv_shared_layers", 0, minimum=0)
    if not shared:
        return kinds
    first = len(kinds) - shared
    if first <= 0:
        raise fields.error("num_kv_shared_layers", f"= {shared} leaves no layer of the {len(kinds)} to hold KV")
    producers = set(kinds[:first])
    for i, kind in enumerate(kinds[first:], start=first):
        if kind not in producers:
            raise fields.error(
                "num_kv_shared_layers", f"makes layer {i} ({kind.value}) reuse KV no earlier {kind.value} layer holds"
            )
    return kinds[:first] + [Kind.NONE] * shared


def _mla_indexer(fields: Fields) -> bool:
    """A sparse-attention indexer over MLA, whose key kvchain keeps beside the latent."""
    return bool(fields.values.get("index_n_heads")) and fields.present("kv_lora_rank")


def _refuse_unmodelled(fields: Fields) -> None:
    if fields.values.get("index_n_heads") and not _mla_indexer(fields):
        raise fields.error("index_n_heads", f"= {fields.values['index_n_heads']!r}: kvchain does not model a "
                           "sparse-attention indexer over MHA (it keeps an indexer's key only beside MLA's latent: "
                           "expected 'kv_lora_rank' with it, or 'index_n_heads' absent, null or 0)")
    for name, (refused, what) in UNMODELLED_VALUES.items():
        if fields.values.get(name) == refused:
            raise fields.error(name, f"= {refused!r}: kvchain does not model {what}")
    for name, what in UNMODELLED.items():
        value = fields.values.get(name)
        if value:
            raise fields.error(
                name, f"= {value!r}: kvchain does not model {what} (expected it absent, null, 0 or false)"
            )


def _pattern_kinds(fields: Fields, pattern: str, num_layers: int) -> list[Kind]:
    unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
    if unknown:
        raise fields.error(
            "hybrid_override_pattern", f"has unknown layer codes {unknown}; expected M, *, - or E"
        )
    if len(pattern) != num_layers:
        raise fields.error(
            "hybrid_override_pattern", f"lists {len(pattern)} layers but num_hidden_layers is {num_layers}"
        )
    return [_PATTERN_KINDS[c] for c in pattern]

