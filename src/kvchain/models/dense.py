"""Llama-style decoders (Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants): one attention
part per layer, full unless the config turns on a sliding window."""

from __future__ import annotations

from ..decl import KVPart
from .fields import Fields
from .parts import Context, FamilyLayers, Kind, attention_geometry, attention_lifetime, kinds_subset

#: model_types parsed here.
MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")

#: Mistral-style configs enable the window by giving `sliding_window` (there is no switch).
_WINDOW_ON_BY_DEFAULT = {"mistral", "mixtral"}
#: Qwen-style configs window only layers >= `max_window_layers` (transformers' default 28).
_MAX_WINDOW_LAYERS = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
_QWEN_MAX_WINDOW_LAYERS_DEFAULT = 28


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    geometry = attention_geometry(fields, ctx)
    window = _window(fields, model_type)
    kinds = fields.layer_kinds(("layer_types",), kinds_subset(Kind.FULL, Kind.WINDOW), num_layers)
    if kinds is None:
        kinds = _kinds_from_window(fields, model_type, num_layers, window)
    elif window is None:
        window = fields.window()  # the list wins over the switch
    layers = [
        [KVPart(geometry, attention_lifetime(kind, window, fields, "sliding_window"))] for kind in kinds
    ]
    return FamilyLayers(layers, fields.integer("max_position_embeddings"))


def _window(fields: Fields, model_type: str) -> int | None:
    if not fields.flag("use_sliding_window", model_type in _WINDOW_ON_BY_DEFAULT):
        return None
    return fields.window()


def _kinds_from_window(fields: Fields, model_type: str, num_layers: int, window: int | None) -> list[Kind]:
    if window is None:
        return [Kind.FULL] * num_layers
    if model_type in _MAX_WINDOW_LAYERS:
        first = fields.integer("max_window_layers", _QWEN_MAX_WINDOW_LAYERS_DEFAULT, minimum=0)
        return [Kind.WINDOW if i >= first else Kind.FULL for i in range(num_layers)]
    return [Kind.WINDOW] * num_layers
