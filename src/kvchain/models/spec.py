"""`ModelSpec`: what a parsed config hands to the planner."""

from __future__ import annotations

from dataclasses import dataclass

from ..decl import KVLayerDecl


@dataclass(frozen=True)
class ModelSpec:
    """One model's KV declarations as one tensor-parallel rank holds them.

    `decls` has one entry per layer that holds KV state, numbered by model layer index (MLP-only
    layers are absent); `max_context` is the longest context the config supports."""

    name: str
    family: str
    decls: tuple[KVLayerDecl, ...]
    max_context: int
    tp_size: int
