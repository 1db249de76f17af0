"""Which recurrent state a layer marked recurrent keeps, read from the fields the config carries.

transformers names every recurrent layer alike (`linear_attention`, `mamba`, `conv`), so the state's
shape is told by which head fields are present: Gated DeltaNet (`linear_num_key_heads`), Kimi Delta
Attention (`linear_num_heads`), Mamba2 (Mamba heads with a head dim), Mamba1 (`mamba_expand`),
LFM2's short convolution (`conv_L_cache`), or MiniMax lightning attention (`linear_attn_alpha_factor`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..decl import KVPart
from .fields import Fields
from .parts import (
    Context,
    conv_kernel,
    delta_rule_state,
    gated_deltanet_state,
    lightning_state,
    mamba1_state,
    mamba2_state,
    short_conv_state,
)

_MAMBA2_HEADS = ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
_MAMBA2_HEAD_DIM = ("mamba_d_head", "mamba_head_dim", "mamba_headdim")
_MAMBA2_GROUPS = ("mamba_n_groups", "n_groups", "mamba_ngroups")
_MAMBA_D_STATE = ("mamba_d_state", "ssm_state_size")
_MAMBA_D_CONV = ("mamba_d_conv", "conv_kernel")

#: Fields any of the readers below keys on; a config with none of them has no recurrent layers.
RECURRENT_FIELDS = (
    "linear_num_key_heads",
    "linear_num_heads",
    "mamba_expand",
    "conv_L_cache",
    "linear_attn_alpha_factor",
    *_MAMBA2_HEADS,
)


def has_recurrent_fields(fields: Fields) -> bool:
    return any(fields.present(name) for name in RECURRENT_FIELDS)


def recurrent_state(fields: Fields, ctx: Context, layer_field: str) -> KVPart:
    """The state part of one recurrent layer; `layer_field` (the list that named the layer
    recurrent) is named when the config carries no state fields this can read."""
    if fields.present("linear_num_key_heads"):
        return gated_deltanet_state(
            fields,
            ctx,
            key_heads=fields.integer("linear_num_key_heads"),
            value_heads=fields.integer("linear_num_value_heads"),
            key_head_dim=fields.integer("linear_key_head_dim"),
            value_head_dim=fields.integer("linear_value_head_dim"),
            d_conv=conv_kernel(fields, ("linear_conv_kernel_dim",)),
        )
    if fields.present("linear_num_heads"):
        heads = fields.integer("linear_num_heads")
        return delta_rule_state(
            ctx,
            heads=fields.split_exact("linear_num_heads", heads, ctx.tp),
            head_dim=fields.integer("linear_head_dim"),
            d_conv=conv_kernel(fields, ("linear_conv_kernel_dim",)),
        )
    if _first_present(fields, _MAMBA2_HEAD_DIM) and _first_present(fields, _MAMBA2_HEADS):
        heads_field = _first_present(fields, _MAMBA2_HEADS)
        groups_field = _first_present(fields, _MAMBA2_GROUPS) or _MAMBA2_GROUPS[0]
        return mamba2_state(
            fields,
            ctx,
            heads=fields.integer(heads_field),
            heads_field=heads_field,
            head_dim=fields.first_integer(_MAMBA2_HEAD_DIM),
            groups=fields.first_integer(_MAMBA2_GROUPS),
            groups_field=groups_field,
            d_state=fields.first_integer(_MAMBA_D_STATE),
            d_conv=conv_kernel(fields, _MAMBA_D_CONV),
        )
    if fields.present("mamba_expand"):
        return mamba1_state(
            fields,
            ctx,
            intermediate=fields.integer("mamba_expand") * fields.integer("hidden_size"),
            intermediate_field="mamba_expand * hidden_size",
            d_state=fields.first_integer(_MAMBA_D_STATE),
            d_conv=conv_kernel(fields, _MAMBA_D_CONV),
        )
    if fields.present("conv_L_cache"):
        hidden = fields.split_exact("hidden_size", fields.integer("hidden_size"), ctx.tp)
        return short_conv_state(ctx, channels=hidden, d_conv=conv_kernel(fields, ("conv_L_cache",)))
    if fields.present("linear_attn_alpha_factor"):
        heads = fields.integer("num_attention_heads")
        return lightning_state(
            ctx,
            heads=fields.split_exact("num_attention_heads", heads, ctx.tp),
            head_dim=fields.head_dim(heads),
        )
    raise fields.error(
        layer_field,
        "names recurrent layers, but the config has none of the state fields kvchain reads "
        f"(expected one of {', '.join(RECURRENT_FIELDS)})",
    )


def _first_present(fields: Fields, names: Sequence[str]) -> str | None:
    return next((name for name in names if fields.present(name)), None)
