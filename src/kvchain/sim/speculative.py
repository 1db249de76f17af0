"""`kvchain simulate --spec-tokens K --spec-acceptance P`: what a draft costs every pool.

A fused draft's KV lives in the target's pool, so each pool the simulator compares is planned
over the target's layers and the draft's (`fused_decls`): the draft is modelled as the engine
makes one from a checkpoint (`engine/speculative_draft.py`), the target's first layer and its
first full-attention layer, renumbered after the target's. Every pool then prices the draft's
bytes per token and per request the way it prices the target's, which is the memory cost that
shows in the comparison. The acceptance rate does not change what the pools hold: it sets how
many tokens one target forward yields per request, `expected_tokens_per_round`, reported beside
the comparison (each round verifies the last token and K proposals; proposal i is kept when it
and every one before it are accepted, each with probability P)."""

from __future__ import annotations

from collections.abc import Sequence

from ..decl import FullLifetime, KVLayerDecl
from ..errors import InputError


def draft_decls(decls: Sequence[KVLayerDecl]) -> list[KVLayerDecl]:
    """The modelled draft: the target's first declared layer and its first full-attention layer."""
    if not decls:
        raise InputError("a model with no declared layers has no draft to model")
    ordered = sorted(decls, key=lambda d: d.layer_id)
    full = next((d for d in ordered if any(isinstance(p.lifetime, FullLifetime) for p in d.parts)), ordered[0])
    return [ordered[0]] if full is ordered[0] else [ordered[0], full]


def fused_decls(decls: Sequence[KVLayerDecl]) -> list[KVLayerDecl]:
    """The target's layers, then the draft's, numbered after the target's last layer."""
    offset = max(d.layer_id for d in decls) + 1
    return list(decls) + [KVLayerDecl(offset + i, d.parts) for i, d in enumerate(draft_decls(decls))]


def expected_tokens_per_round(k: int, acceptance: float) -> float:
    """Tokens one round yields per request: 1 (the target's own) + the expected accepted prefix of
    `k` proposals, each accepted with probability `acceptance`: sum_{i=0..k} acceptance**i."""
    if not isinstance(k, int) or k < 1:
        raise InputError(f"--spec-tokens must be a positive integer, not {k!r}")
    if not 0.0 <= acceptance <= 1.0:
        raise InputError(f"--spec-acceptance is a probability in [0, 1], not {acceptance}")
    return float(sum(acceptance**i for i in range(k + 1)))


def spec_summary(decls: Sequence[KVLayerDecl], k: int, acceptance: float, page_size: int) -> dict:
    """What the speculative mode adds to the report: the draft's layers, its KV bytes per token in
    the fused plan, and tokens per target forward per request."""
    from ..plan import plan_kv_storage

    alone = plan_kv_storage(list(decls), page_size=page_size)
    fused = plan_kv_storage(fused_decls(decls), page_size=page_size)

    def token_bytes(plan) -> int:
        return sum(p.unit_bytes for p in plan.sub_pools if p.is_attention)

    return {"spec_tokens": k, "spec_acceptance": acceptance, "draft_layers": len(draft_decls(decls)),
            "token_bytes_target": token_bytes(alone), "token_bytes_with_draft": token_bytes(fused),
            "tokens_per_target_forward": expected_tokens_per_round(k, acceptance)}
