"""Presets: published HF `config.json` files of real models, stored under `presets/`, plus reading a
user's own config file.

Each preset is the published config with one added top-level `_kvchain` object
(`{"hf_id": ..., "description": ...}`) that the parser never reads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .. import jsonio
from ..errors import InputError
from .registry import model_from_config, num_model_layers, resolve_family
from .spec import ModelSpec

_META_KEY = "_kvchain"


@dataclass(frozen=True)
class PresetInfo:
    """What `list_presets` says about one stored preset."""

    name: str
    family: str
    hf_id: str
    num_layers: int
    description: str


def _preset_dir() -> Any:
    return resources.files(__package__).joinpath("presets")


def _preset_names() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def list_presets() -> list[PresetInfo]:
    """Every stored preset, sorted by name."""
    infos = []
    for name in _preset_names():
        config = load_preset_config(name)
        meta = config.get(_META_KEY, {})
        infos.append(
            PresetInfo(
                name=name,
                family=resolve_family(config)[1],
                hf_id=str(meta.get("hf_id", "")),
                num_layers=num_model_layers(config),
                description=str(meta.get("description", "")),
            )
        )
    return infos


def load_preset_config(name: str) -> dict:
    """The stored config dict of preset `name` (a fresh copy each call)."""
    names = _preset_names()
    if not isinstance(name, str):
        raise InputError(f"a preset name is a string, not {type(name).__name__} (known presets: {', '.join(names)})")
    key = name.strip().lower()
    if key not in names:
        raise InputError(f"unknown preset {name!r} (known presets: {', '.join(names)})")
    text = _preset_dir().joinpath(f"{key}.json").read_text(encoding="utf-8")
    return json.loads(text)


def model_from_preset(name: str, **kwargs: Any) -> ModelSpec:
    """`model_from_config` on a stored preset; the spec is named after the preset unless
    `name=` is passed in kwargs."""
    config = load_preset_config(name)
    kwargs.setdefault("name", name.strip().lower())
    return model_from_config(config, **kwargs)


def load_config_file(path: str | os.PathLike) -> dict:
    """Read a `config.json` (or the one inside a checkpoint directory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"a config path is a str or a path, not {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise InputError(f"config file not found: {path}")
    config = jsonio.loads(jsonio.read_text(path, f"config file {path}"), str(path))
    if not isinstance(config, dict):
        raise InputError(f"{path}: a model config must be a JSON object, got a JSON {type(config).__name__}")
    return config
