"""Hymba (NVIDIA Hymba-1.5B): every layer runs attention heads and a Mamba1 mixer in parallel.

Attention is global on the layers in `global_attn_idx` and sliding-window (`sliding_window`)
elsewhere, so a Hymba chain holds state, window and full sub-pools at once. Hymba also shares KV
across layers: in each `kv_reuse_group` the first layer produces K/V and the others read it, so
only producers hold attention KV (as the reference model's cache does); every layer holds its own
Mamba state."""

from __future__ import annotations

from ..decl import MHA, FullLifetime, KVPart, WindowLifetime
from .fields import Fields
from .parts import Context, FamilyLayers, LayerParts, conv_kernel, mamba1_state


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    hidden = fields.integer("hidden_size")
    intermediate = fields.integer("mamba_expand") * hidden

    geometry = _attention_geometry(fields, ctx, hidden, intermediate)
    window = fields.optional_integer("sliding_window")
    if window is None:
        window = fields.optional_integer("attn_window_size")
    global_layers = set(_layer_ids(fields, "global_attn_idx", num_layers))
    consumers = _kv_consumers(fields, num_layers)

    state = mamba1_state(
        fields,
        ctx,
        intermediate=intermediate,
        intermediate_field="mamba_expand * hidden_size",
        d_state=fields.integer("mamba_d_state"),
        d_conv=conv_kernel(fields, ("mamba_d_conv",)),
    )
    full = KVPart(geometry, FullLifetime())
    windowed = full if window is None else KVPart(geometry, WindowLifetime(window))
    layers: list[LayerParts] = []
    for i in range(num_layers):
        if i in consumers:
            layers.append([state])
        else:
            layers.append([state, full if i in global_layers else windowed])
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))


def _attention_geometry(fields: Fields, ctx: Context, hidden: int, intermediate: int) -> MHA:
    """Queries and keys use head_dim = attention width // heads (64 for 1.5B); values are as wide
    as the Mamba branch they are averaged with: intermediate // heads (128 for 1.5B)."""
    heads = fields.integer("num_attention_heads")
    kv_heads = fields.integer("num_key_value_heads", heads)
    attn_hidden = fields.integer("attn_hidden_size", -1, minimum=-1)
    attn_hidden = attn_hidden if attn_hidden > 0 else hidden
    key_dim = fields.integer("kq_head_dim", -1, minimum=-1)
    if key_dim <= 0:
        if attn_hidden % heads:
            raise fields.error(
                "num_attention_heads", f"= {heads} does not divide the attention width {attn_hidden}"
            )
        key_dim = attn_hidden // heads
    if intermediate % heads:
        raise fields.error(
            "num_attention_heads", f"= {heads} does not divide the Mamba inner size {intermediate}"
        )
    per_rank = fields.split_heads("num_key_value_heads", kv_heads, ctx.tp)
    return MHA(per_rank, key_dim, v_head_dim=intermediate // heads, dtype=ctx.kv_dtype)


def _layer_ids(fields: Fields, name: str, num_layers: int) -> list[int]:
    ids = fields.integers(name) or []
    for i in ids:
        if i >= num_layers:
            raise fields.error(name, f"names layer {i}, but the model has {num_layers} layers")
    return ids


def _kv_consumers(fields: Fields, num_layers: int) -> set[int]:
    """Layers that read another layer's K/V instead of caching their own."""
    groups = fields.sequence("kv_reuse_group")
    if groups:
        consumers: set[int] = set()
        for g, group in enumerate(groups):
            if not isinstance(group, (list, tuple)) or not group:
                raise fields.error("kv_reuse_group", f"entry {g} must be a non-empty list of layer ids")
            ids = [fields.as_integer(f"kv_reuse_group[{g}]", i, 0) for i in group]
            if any(i >= num_layers for i in ids):
                raise fields.error(
                    "kv_reuse_group", f"entry {g} names a layer beyond the model's {num_layers}"
                )
            consumers.update(ids[1:])
        return consumers
    every = fields.integer("kv_reuse_every_i_layer", -1, minimum=-1)
    if every > 0:
        return {i for i in range(num_layers) if i % every}
    return set()
