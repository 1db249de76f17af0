"""The draft on the plan: a fused draft's layers in the target's plan, numbered after the target's.

Its KV takes pages of the target's bands (or a band of its own for a window the target lacks), so
sizing, the memory clip and admission price its bytes with the target's; a draft with recurrent
layers shares the target's state band, which then needs a checkpoint policy (`plan_kv_storage`
refuses it otherwise, PlanError)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..decl import KVLayerDecl, KVPart, StateLifetime
from ..plan import KVStoragePlan, plan_kv_storage


def plan_with_draft(decls: Sequence[KVLayerDecl], draft: Sequence[KVLayerDecl], *, page_size: int,
                    checkpoint_interval: int | None, num_speculative_tokens: int = 0,
                    draft_offset: int | None = None) -> KVStoragePlan:
    """The target's plan with a fused draft. `checkpoint_interval`: the prefix cache's grid for the
    target's recurrent state (None: no checkpoint policy), declared on the target's state lifetime,
    which a draft with recurrent layers needs (`plan_kv_storage` refuses it otherwise, PlanError).
    `num_speculative_tokens` (k): a round's k + 1 scratch state slots are declared on that lifetime
    too (`StateLifetime.speculative_slots`), so every price of a request (the floor, the memory
    clip, admission) counts them with its running and tracking slots. `draft_offset`: where the
    draft's layer ids start (default: one past `decls`' last; a pipeline stage's `decls` are its own
    layers, so it passes the whole target's, `draft_layer_offset`)."""
    scratch = num_speculative_tokens + 1 if num_speculative_tokens > 0 else 0
    if checkpoint_interval is not None or scratch:
        def priced(part: KVPart) -> KVPart:
            if isinstance(part.lifetime, StateLifetime):
                interval = part.lifetime.checkpoint_interval if checkpoint_interval is None else checkpoint_interval
                return dataclasses.replace(part, lifetime=StateLifetime(interval, scratch))
            return part

        decls = [KVLayerDecl(d.layer_id, tuple(priced(p) for p in d.parts)) for d in decls]
    return plan_kv_storage(decls, page_size=page_size, draft=draft, draft_offset=draft_offset)


def draft_layer_offset(decls: Sequence[KVLayerDecl]) -> int:
    """Where a fused draft's layer ids start: one past the target's last declared layer."""
    return max(d.layer_id for d in decls) + 1


def fuse_draft_layers(model: torch.nn.Module, offset: int) -> None:
    """Number the draft's layers after the target's (`layer_idx += offset` on every module that has
    one), so its attention and mixers address the draft's layers of the fused plan. A mixer that
    keeps no index of its own (RecurrentGemma's) is numbered first, or it would keep the target's. A
    shared attention block (Zamba's) is told its layer per call, as the draft's own decoder loop
    counts it: it keeps the offset to add to that (`shared_attention.offset_layers`)."""
    from .mixers import number_mixer_layers
    from .shared_attention import is_shared_attention, offset_layers

    number_mixer_layers(model)
    for module in model.modules():
        if is_shared_attention(module):
            offset_layers(module, offset)
        elif isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx += offset
