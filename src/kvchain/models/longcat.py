"""LongCat-Flash: each of its `num_layers` decoder layers runs two MLA attention sublayers, each with
its own cache (transformers numbers them 2*i and 2*i+1), so the model caches 2 * num_layers layers."""

from __future__ import annotations

from ..decl import FullLifetime, KVPart
from .fields import Fields
from .generic import attention_geometry
from .parts import Context, FamilyLayers


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    sublayers = 2 * fields.num_layers("num_layers")
    part = KVPart(attention_geometry(fields, ctx), FullLifetime())
    return FamilyLayers([[part] for _ in range(sublayers)], fields.integer("max_position_embeddings"))
