"""`kvchain simulate --spec-tokens K --spec-acceptance P`: what a draft costs every pool, and the
steps it saves.

A fused draft's KV lives in the target's pool, so each pool the simulator compares is planned
over the target's layers and the draft's (`fused_decls`): the draft is modelled as the engine
makes one from a checkpoint (`engine/speculative_draft.py`), the target's first layer and its
first full-attention layer, renumbered after the target's. Every pool then prices the draft's
bytes per token and per request the way it prices the target's, which is the memory cost that
shows in the comparison.

The acceptance rate sets how many tokens a decode step yields (`SpecSteps`): a round verifies the
last token and K proposals, and proposal i is kept when it and every one before it are accepted,
each with probability P, so a step yields 1 + the accepted count, `expected_tokens_per_round` on
average. Each request's count at each output position is a seeded draw that depends on the
request and the position only, so every pool compared sees the same rounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


#: splitmix64's constants: a cheap, well-mixed hash of (seed, request, position) into 64 bits
_GOLDEN, _MIX1, _MIX2, _MASK = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, (1 << 64) - 1


def _uniform(*keys: int) -> float:
    """A uniform draw in (0, 1) that depends only on `keys`."""
    x = 0
    for key in keys:
        x = (x + _GOLDEN + (key & _MASK)) & _MASK
        x = ((x ^ (x >> 30)) * _MIX1) & _MASK
        x = ((x ^ (x >> 27)) * _MIX2) & _MASK
        x ^= x >> 31
    return ((x >> 11) + 0.5) / float(1 << 53)


@dataclass(frozen=True)
class SpecSteps:
    """Tokens one decode step of a request yields under speculative decoding with `k` proposals,
    each accepted with probability `acceptance`: 1 + the accepted prefix, drawn from `seed`, the
    request id and its output position (`Scheduler.decode_tokens`). The accepted count `a` has
    P(a >= i) = acceptance**i for i <= k, so one uniform draw u gives a = min(k, floor(log u / log P))."""

    k: int
    acceptance: float
    seed: int = 0

    def __post_init__(self) -> None:
        expected_tokens_per_round(self.k, self.acceptance)  # the same checks, the same messages

    def accepted(self, rid: int, position: int) -> int:
        if self.acceptance >= 1.0:
            return self.k
        if self.acceptance <= 0.0:
            return 0
        u = _uniform(self.seed, rid, position)
        return min(self.k, int(math.log(u) / math.log(self.acceptance)))

    def __call__(self, req) -> int:
        return 1 + self.accepted(req.rid, req.generated)
