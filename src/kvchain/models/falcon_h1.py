"""Falcon-H1: every layer runs attention and a Mamba2 mixer side by side, so every layer holds an
attention part and a state part."""

from __future__ import annotations

from ..decl import FullLifetime, KVPart
from .fields import Fields
from .parts import Context, FamilyLayers, attention_geometry, conv_kernel, mamba2_state


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    attention = KVPart(attention_geometry(fields, ctx), FullLifetime())

    heads = fields.integer("mamba_n_heads")
    if fields.present("mamba_d_ssm"):
        d_ssm = fields.integer("mamba_d_ssm")
    else:
        d_ssm = fields.integer("mamba_expand") * fields.integer("hidden_size")
    head_dim = _mamba_head_dim(fields, d_ssm, heads)
    state = mamba2_state(
        fields,
        ctx,
        heads=heads,
        heads_field="mamba_n_heads",
        head_dim=head_dim,
        groups=fields.integer("mamba_n_groups"),
        groups_field="mamba_n_groups",
        d_state=fields.integer("mamba_d_state"),
        d_conv=conv_kernel(fields, ("mamba_d_conv",)),
    )
    layers = [[attention, state] for _ in range(num_layers)]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))


def _mamba_head_dim(fields: Fields, d_ssm: int, heads: int) -> int:
    """`mamba_d_head`, or d_ssm // mamba_n_heads when it says "auto"; the heads must tile d_ssm."""
    if fields.values.get("mamba_d_head") == "auto":
        if d_ssm % heads:
            raise fields.error("mamba_n_heads", f"= {heads} does not divide the Mamba inner size {d_ssm}")
        return d_ssm // heads
    head_dim = fields.integer("mamba_d_head")
    if head_dim * heads != d_ssm:
        raise fields.error(
            "mamba_d_head",
            f"= {head_dim} x mamba_n_heads {heads} does not match the Mamba inner size {d_ssm}",
        )
    return head_dim
