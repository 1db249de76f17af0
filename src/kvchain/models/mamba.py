"""Mamba, Falcon-Mamba and Mamba2: every layer is an SSM mixer and none attends, so each layer keeps
only recurrent state and the plan's token-id owner mints the virtual ids (`plan.py::TokenIds`).

transformers names these fields without a `mamba_` prefix: `state_size`, `conv_kernel`, `expand`
(or `intermediate_size`), and Mamba2's `num_heads`, `head_dim`, `n_groups`."""

from __future__ import annotations

from .fields import Fields
from .parts import Context, FamilyLayers, conv_kernel, mamba1_state, mamba2_state

#: model_types parsed here: Mamba1 mixers, and Mamba2 (heads with a head dim, B/C in groups).
MAMBA1_TYPES = ("mamba", "falcon_mamba")
MAMBA2_TYPES = ("mamba2",)

#: A recurrent model has no positional limit; this is the longest context it is planned for
#: when its config states none (a request row addresses this many tokens).
UNBOUNDED_CONTEXT = 1 << 20


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    if model_type in MAMBA2_TYPES:
        state = _mamba2(fields, ctx)
    else:
        state = _mamba1(fields, ctx)
    max_context = fields.integer("max_position_embeddings", UNBOUNDED_CONTEXT)
    return FamilyLayers([[state] for _ in range(num_layers)], max_context)


def _mamba1(fields: Fields, ctx: Context):
    """Inner channels `intermediate_size` (transformers sets it to expand * hidden_size)."""
    if fields.present("intermediate_size"):
        inner, inner_field = fields.integer("intermediate_size"), "intermediate_size"
    else:
        inner, inner_field = fields.integer("expand") * fields.integer("hidden_size"), "expand * hidden_size"
    return mamba1_state(
        fields,
        ctx,
        intermediate=inner,
        intermediate_field=inner_field,
        d_state=fields.integer("state_size"),
        d_conv=conv_kernel(fields, ("conv_kernel",)),
    )


def _mamba2(fields: Fields, ctx: Context):
    """The heads must tile the inner size expand * hidden_size, as the mixer's projections assume."""
    heads = fields.integer("num_heads")
    head_dim = fields.integer("head_dim")
    if fields.present("expand") and fields.present("hidden_size"):
        inner = fields.integer("expand") * fields.integer("hidden_size")
        if heads * head_dim != inner:
            raise fields.error(
                "num_heads", f"= {heads} x head_dim {head_dim} does not match expand * hidden_size {inner}"
            )
    return mamba2_state(
        fields,
        ctx,
        heads=heads,
        heads_field="num_heads",
        head_dim=head_dim,
        groups=fields.integer("n_groups"),
        groups_field="n_groups",
        d_state=fields.integer("state_size"),
        d_conv=conv_kernel(fields, ("conv_kernel",)),
    )
