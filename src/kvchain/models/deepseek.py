"""DeepSeek-V2/V3: multi-head latent attention on every layer. The cache holds one compressed
latent (`kv_lora_rank`) plus one shared rope key (`qk_rope_head_dim`) per token, whatever the head
count, so tensor parallelism does not split it: every rank holds the whole latent."""

from __future__ import annotations

from ..decl import MLA, FullLifetime, KVPart
from .fields import Fields
from .parts import Context, FamilyLayers


def parse(fields: Fields, ctx: Context, model_type: str) -> FamilyLayers:
    num_layers = fields.num_layers()
    geometry = MLA(
        fields.integer("kv_lora_rank"), fields.integer("qk_rope_head_dim", minimum=0), dtype=ctx.kv_dtype
    )
    part = KVPart(geometry, FullLifetime())
    return FamilyLayers([[part] for _ in range(num_layers)], fields.integer("max_position_embeddings"))
