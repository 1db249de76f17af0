"""Qwen3-Next: Gated DeltaNet linear-attention layers (recurrent state) with a full gated-attention
layer every `full_attention_interval` layers."""

from __future__ import annotations

from ..decl import FullLifetime, KVPart
from .fields import Fields
from .parts import (
    Context,
    FamilyLayers,
    Kind,
    attention_geometry,
    conv_kernel,
    gated_deltanet_state,
    kinds_subset,
)

_INTERVAL_DEFAULT = 4  # Qwen3NextConfig's default, and what the published configs use


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    """`layer_types` ("linear_attention"/"full_attention") wins; otherwise layer i is full
    attention when (i + 1) % full_attention_interval == 0."""
    num_layers = fields.num_layers()
    kinds = fields.layer_kinds(("layer_types",), kinds_subset(Kind.FULL, Kind.RECURRENT), num_layers)
    if kinds is None:
        interval = fields.integer("full_attention_interval", _INTERVAL_DEFAULT)
        kinds = [Kind.FULL if (i + 1) % interval == 0 else Kind.RECURRENT for i in range(num_layers)]

    attention = None
    if Kind.FULL in kinds:
        attention = KVPart(attention_geometry(fields, ctx), FullLifetime())
    state = None
    if Kind.RECURRENT in kinds:
        state = gated_deltanet_state(
            fields,
            ctx,
            key_heads=fields.integer("linear_num_key_heads"),
            value_heads=fields.integer("linear_num_value_heads"),
            key_head_dim=fields.integer("linear_key_head_dim"),
            value_head_dim=fields.integer("linear_value_head_dim"),
            d_conv=conv_kernel(fields, ("linear_conv_kernel_dim",)),
        )
    layers = [[attention] if kind is Kind.FULL else [state] for kind in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))
