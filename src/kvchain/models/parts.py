"""Building blocks the family parsers share: the parse context, attention parts, and the recurrent
state layouts (Mamba1, Mamba2, Gated DeltaNet) sized per tensor-parallel rank."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..decl import MHA, FullLifetime, KVPart, Lifetime, State, StateLifetime, StateTensor, WindowLifetime
from .fields import Fields

#: One entry per model layer: its parts, or None for a layer with no KV state (an MLP block).
LayerParts = Sequence[KVPart] | None


class Kind(enum.Enum):
    """What a layer's sequence mixer keeps, as a family's layer list or pattern names it."""

    FULL = "full"
    WINDOW = "window"
    CHUNKED = "chunked"
    RECURRENT = "recurrent"
    HYBRID = "hybrid"  # attention and a recurrent mixer in one layer (Zamba's hybrid blocks)
    NONE = "none"


#: `layer_types` names transformers uses, plus the legacy ones it still reads ("attention", "mamba").
LAYER_TYPE_KINDS = {
    "full_attention": Kind.FULL,
    "attention": Kind.FULL,
    "sliding_attention": Kind.WINDOW,
    "chunked_attention": Kind.CHUNKED,
    "linear_attention": Kind.RECURRENT,
    "mamba": Kind.RECURRENT,
    "mlp": Kind.NONE,
    "moe": Kind.NONE,
}


def kinds_subset(*kinds: Kind) -> dict[str, Kind]:
    """The `layer_types` names a family accepts: those mapping to one of `kinds`."""
    return {name: kind for name, kind in LAYER_TYPE_KINDS.items() if kind in kinds}


@dataclass(frozen=True)
class Context:
    """What every family parser needs besides the config: the TP degree, the attention KV dtype,
    the model dtype (conv states are kept in it) and the lifetime given to every state part."""

    tp: int
    kv_dtype: str
    model_dtype: str
    state_lifetime: StateLifetime


@dataclass(frozen=True)
class FamilyLayers:
    """A family parser's answer: one entry per model layer, and the longest context it supports."""

    layers: list[LayerParts]
    max_context: int


# ---------------------------------------------------------------- attention


def attention_geometry(
    fields: Fields,
    ctx: Context,
    *,
    heads_default: int | None = None,
    kv_heads_default: int | None = None,
    head_dim_names: Sequence[str] = ("head_dim",),
    head_dim_default: int | None = None,
) -> MHA:
    """The per-rank K/V geometry of a (grouped-query) attention layer.

    A missing `num_key_value_heads` means plain multi-head attention; a missing `head_dim` is
    hidden_size // num_attention_heads unless the family has its own default."""
    if heads_default is None:
        heads = fields.integer("num_attention_heads")
    else:
        heads = fields.integer("num_attention_heads", heads_default)
    kv_heads = fields.integer(
        "num_key_value_heads", kv_heads_default if kv_heads_default is not None else heads
    )
    head_dim = fields.head_dim(heads, names=head_dim_names, default=head_dim_default)
    per_rank = fields.split_heads("num_key_value_heads", kv_heads, ctx.tp)
    return MHA(per_rank, head_dim, dtype=ctx.kv_dtype)


def attention_lifetime(kind: Kind, window: int | None, fields: Fields, window_field: str) -> Lifetime:
    """The lifetime of one attention layer of `kind`; window kinds need the family's window size."""
    if kind is Kind.FULL:
        return FullLifetime()
    if window is None:
        raise fields.error(window_field, f"is missing, yet the config has {kind.value} attention layers")
    return WindowLifetime(window, chunked=kind is Kind.CHUNKED)


def optional_window_lifetime(fields: Fields) -> Lifetime:
    """Attention that slides when the config sets `sliding_window` and is full when it is null
    (the hybrids whose published configs leave it null)."""
    window = fields.window()
    return attention_lifetime(Kind.WINDOW if window is not None else Kind.FULL, window, fields, "sliding_window")


# ---------------------------------------------------------------- recurrent state


def mamba1_state(
    fields: Fields,
    ctx: Context,
    *,
    intermediate: int,
    intermediate_field: str,
    d_state: int,
    d_conv: int,
) -> KVPart:
    """Mamba1 (Jamba, Hymba): a depthwise conv over the inner channels, and a (channels, d_state)
    SSM state. Inner channels split over TP ranks; the SSM state is kept in float32."""
    channels = fields.split_exact(intermediate_field, intermediate, ctx.tp)
    return _state_part(ctx, (channels, d_conv - 1), (channels, d_state))


def mamba2_state(
    fields: Fields,
    ctx: Context,
    *,
    heads: int,
    heads_field: str,
    head_dim: int,
    groups: int,
    groups_field: str,
    d_state: int,
    d_conv: int,
) -> KVPart:
    """Mamba2 (Nemotron-H, Falcon-H1): the conv runs over x, B and C together
    (heads*head_dim + 2*groups*d_state channels) and the SSM state is (heads, head_dim, d_state)
    in float32. Heads split over TP ranks; B/C groups split too, or are replicated one per rank
    when there are fewer groups than ranks (what serving engines do for n_groups=1)."""
    heads_per_rank = fields.split_exact(heads_field, heads, ctx.tp)
    groups_per_rank = fields.split_heads(groups_field, groups, ctx.tp)
    conv_channels = heads_per_rank * head_dim + 2 * groups_per_rank * d_state
    return _state_part(ctx, (conv_channels, d_conv - 1), (heads_per_rank, head_dim, d_state))


def gated_deltanet_state(
    fields: Fields,
    ctx: Context,
    *,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    d_conv: int,
) -> KVPart:
    """Gated DeltaNet (Qwen3-Next linear attention): a conv over q, k and v
    (2*key_dim + value_dim channels) and a (value_heads, key_head_dim, value_head_dim) float32
    recurrent state, heads split over TP ranks."""
    key_heads_per_rank = fields.split_exact("linear_num_key_heads", key_heads, ctx.tp)
    value_heads_per_rank = fields.split_exact("linear_num_value_heads", value_heads, ctx.tp)
    conv_channels = 2 * key_heads_per_rank * key_head_dim + value_heads_per_rank * value_head_dim
    return _state_part(ctx, (conv_channels, d_conv - 1), (value_heads_per_rank, key_head_dim, value_head_dim))


def conv_kernel(fields: Fields, names: Sequence[str]) -> int:
    """A causal conv's kernel width; the state keeps kernel-1 past inputs, so it must be >= 2."""
    return fields.first_integer(names, minimum=2)


def _state_part(ctx: Context, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...]) -> KVPart:
    tensors = (
        StateTensor("conv", conv_shape, ctx.model_dtype),
        StateTensor("ssm", ssm_shape, "float32"),
    )
    return KVPart(State(tensors), ctx.state_lifetime)


def short_conv_state(ctx: Context, *, channels: int, d_conv: int) -> KVPart:
    """A gated short convolution (LFM2's conv layers): only the last kernel-1 inputs, no SSM state."""
    return KVPart(State((StateTensor("conv", (channels, d_conv - 1), ctx.model_dtype),)), ctx.state_lifetime)


def delta_rule_state(ctx: Context, *, heads: int, head_dim: int, d_conv: int) -> KVPart:
    """Kimi Delta Attention (Kimi-Linear): separate short convs over q, k and v (3*heads*head_dim
    channels) and a (heads, head_dim, head_dim) float32 recurrent state."""
    return _state_part(ctx, (3 * heads * head_dim, d_conv - 1), (heads, head_dim, head_dim))


def lightning_state(ctx: Context, *, heads: int, head_dim: int) -> KVPart:
    """MiniMax lightning (linear) attention: a (heads, head_dim, head_dim) float32 KV state, no conv."""
    return KVPart(State((StateTensor("ssm", (heads, head_dim, head_dim), "float32"),)), ctx.state_lifetime)
