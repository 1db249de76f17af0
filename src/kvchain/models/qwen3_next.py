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
    kinds_subset,
)
from .recurrent import recurrent_state

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
        state = recurrent_state(fields, ctx, "layer_types")
    layers = [[attention] if kind is Kind.FULL else [state] for kind in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))
