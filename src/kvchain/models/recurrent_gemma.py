"""RecurrentGemma (Griffin): `block_types` repeats over the layers; a `recurrent` block keeps an
RG-LRU state and an `attention` block keeps local attention over `attention_window_size` tokens.

No layer attends over the whole context, so the plan's token-id owner mints the virtual ids
(`plan.py::TokenIds`). The state shapes follow transformers' `RecurrentGemmaRecurrentBlock`: a
depthwise conv1d over `lru_width` channels keeps its last `conv1d_width - 1` inputs in the model
dtype, and the RG-LRU keeps one `lru_width` vector, "always computed in full precision" (float32)."""

from __future__ import annotations

from ..decl import KVPart, State, StateTensor, WindowLifetime
from .fields import Fields
from .mamba import UNBOUNDED_CONTEXT
from .parts import Context, FamilyLayers, attention_geometry, conv_kernel

MODEL_TYPES = ("recurrent_gemma",)

#: RecurrentGemmaConfig defaults the published configs rely on.
_BLOCK_TYPES = ("recurrent", "recurrent", "attention")
_WINDOW = 2048
_CONV1D_WIDTH = 4


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    pattern = _block_types(fields)
    blocks = [pattern[i % len(pattern)] for i in range(num_layers)]  # transformers tiles the pattern
    window = WindowLifetime(fields.integer("attention_window_size", _WINDOW))
    attention = KVPart(attention_geometry(fields, ctx), window)
    state = _rg_lru_state(fields, ctx)
    layers = [[attention] if block == "attention" else [state] for block in blocks]
    return FamilyLayers(layers, fields.integer("max_position_embeddings", UNBOUNDED_CONTEXT))


def _block_types(fields: Fields) -> tuple[str, ...]:
    value = fields.values.get("block_types", _BLOCK_TYPES)
    if not isinstance(value, (list, tuple)) or not value or any(b not in ("recurrent", "attention") for b in value):
        raise fields.error("block_types", f"must be a non-empty list of 'recurrent' / 'attention', got {value!r}")
    return tuple(value)


def _rg_lru_state(fields: Fields, ctx: Context) -> KVPart:
    """The conv1d and RG-LRU channels are `lru_width` (hidden_size when unset), split over TP ranks."""
    width_field = "lru_width" if fields.values.get("lru_width") is not None else "hidden_size"
    channels = fields.split_exact(width_field, fields.integer(width_field), ctx.tp)
    d_conv = conv_kernel(fields, ("conv1d_width",)) if fields.present("conv1d_width") else _CONV1D_WIDTH
    tensors = (
        StateTensor("conv", (channels, d_conv - 1), ctx.model_dtype),
        StateTensor("rg_lru", (channels,), "float32"),
    )
    return KVPart(State(tensors), ctx.state_lifetime)
