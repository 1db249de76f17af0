"""Hybrid model families: a HF `config.json` becomes the layer declarations the planner groups
into sub-pools, plus presets of real published configs."""

from __future__ import annotations

from .presets import PresetInfo, list_presets, load_config_file, load_preset_config, model_from_preset
from .registry import model_from_config
from .spec import ModelSpec

__all__ = [
    "ModelSpec",
    "PresetInfo",
    "list_presets",
    "load_config_file",
    "load_preset_config",
    "model_from_config",
    "model_from_preset",
]
