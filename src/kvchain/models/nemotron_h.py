"""Nemotron-H: one mixer per layer, named by `hybrid_override_pattern` ("M" Mamba2, "*" attention,
"-" MLP, "E" MoE) or by a `layers_block_type` list, which wins when both are given."""

from __future__ import annotations

from ..decl import KVPart
from .fields import Fields
from .parts import (
    LAYER_TYPE_KINDS,
    Context,
    FamilyLayers,
    Kind,
    attention_geometry,
    conv_kernel,
    mamba2_state,
    optional_window_lifetime,
)

_PATTERN_KINDS = {"M": Kind.RECURRENT, "*": Kind.FULL, "-": Kind.NONE, "E": Kind.NONE}


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    # Like transformers, the list or pattern sets the depth (num_hidden_layers is derived from it).
    kinds = fields.layer_kinds(("layers_block_type", "layer_types"), LAYER_TYPE_KINDS, None)
    if kinds is None:
        kinds = _pattern_kinds(fields)
    if Kind.WINDOW in kinds or Kind.CHUNKED in kinds:
        raise fields.error("layers_block_type", "names windowed attention, which Nemotron-H does not have")

    attention = None
    if Kind.FULL in kinds:
        geometry = attention_geometry(fields, ctx, head_dim_names=("head_dim", "attention_head_dim"))
        attention = KVPart(geometry, optional_window_lifetime(fields))
    state = None
    if Kind.RECURRENT in kinds:
        state = mamba2_state(
            fields,
            ctx,
            heads=fields.integer("mamba_num_heads"),
            heads_field="mamba_num_heads",
            head_dim=fields.integer("mamba_head_dim"),
            groups=fields.first_integer(("n_groups", "mamba_n_groups")),
            groups_field="n_groups",
            d_state=fields.integer("ssm_state_size"),
            d_conv=conv_kernel(fields, ("conv_kernel", "mamba_d_conv")),
        )
    by_kind = {Kind.FULL: [attention], Kind.RECURRENT: [state], Kind.NONE: None}
    layers = [by_kind[kind] for kind in kinds]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))


def _pattern_kinds(fields: Fields) -> list[Kind]:
    pattern = fields.string("hybrid_override_pattern")
    if not pattern:
        raise fields.error("hybrid_override_pattern", "is missing (and no layers_block_type list is given)")
    unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
    if unknown:
        raise fields.error(
            "hybrid_override_pattern", f"has unknown layer codes {unknown}; expected M, *, - or E"
        )
    return [_PATTERN_KINDS[c] for c in pattern]
