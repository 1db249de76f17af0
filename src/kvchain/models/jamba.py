"""Jamba: Mamba1 layers with an attention layer every `attn_layer_period` layers (at
`attn_layer_offset`). Expert placement (`expert_layer_period`) does not change KV state."""

from __future__ import annotations

from ..decl import KVPart
from .fields import Fields
from .parts import (
    Context,
    FamilyLayers,
    Kind,
    attention_geometry,
    conv_kernel,
    kinds_subset,
    mamba1_state,
    optional_window_lifetime,
)

_PERIOD_DEFAULT = 8  # JambaConfig's defaults
_OFFSET_DEFAULT = 4


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    kinds = fields.layer_kinds(
        ("layer_types", "layers_block_type"), kinds_subset(Kind.FULL, Kind.RECURRENT), num_layers
    )
    if kinds is None:
        period = fields.integer("attn_layer_period", _PERIOD_DEFAULT)
        offset = fields.integer("attn_layer_offset", _OFFSET_DEFAULT, minimum=0)
        if offset >= period:
            raise fields.error(
                "attn_layer_offset", f"= {offset} must be smaller than attn_layer_period {period}"
            )
        kinds = [Kind.FULL if i % period == offset else Kind.RECURRENT for i in range(num_layers)]

    attention = None
    if Kind.FULL in kinds:
        # Jamba's attention honours sliding_window when a config sets one (published ones: null).
        attention = KVPart(attention_geometry(fields, ctx), optional_window_lifetime(fields))
    state = None
    if Kind.RECURRENT in kinds:
        state = mamba1_state(
            fields,
            ctx,
            intermediate=fields.integer("mamba_expand") * fields.integer("hidden_size"),
            intermediate_field="mamba_expand * hidden_size",
            d_state=fields.integer("mamba_d_state"),
            d_conv=conv_kernel(fields, ("mamba_d_conv",)),
        )
    layers = [[attention] if kind is Kind.FULL else [state] for kind in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))
