"""`kvchain simulate --spec-tokens K --spec-acceptance P`: the draft fused into every pool, and the
tokens a round yields, worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.decl import (
    MHA,
    FullLifetime,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from kvchain.engine.request import ScheduledRequest
from kvchain.errors import InputError
from kvchain.sim.baselines import PoolConfig, kvchain_pool
from kvchain.sim.runner import run_pool
from kvchain.sim.speculative import (
    SpecSteps,
    draft_decls,
    expected_tokens_per_round,
    fused_decls,
    spec_summary,
)

GEO = MHA(2, 16, dtype="float32")  # 256 bytes per token per layer
STATE = State((StateTensor("conv", (16, 3)), StateTensor("ssm", (2, 8, 4), "float32")))
#: window, state, full, full: the draft is layer 0 (window) and layer 2 (the first full layer)
TARGET = kv_layer_decls([KVPart(GEO, WindowLifetime(16)), KVPart(STATE, StateLifetime()),
                         KVPart(GEO, FullLifetime()), KVPart(GEO, FullLifetime())])


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(3, 0.5) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens_per_round(4, 1.0) == 5  # every proposal accepted
    assert expected_tokens_per_round(2, 0.0) == 1  # only the target's own token
    with pytest.raises(InputError):
        expected_tokens_per_round(2, 1.5)
    with pytest.raises(InputError):
        expected_tokens_per_round(0, 0.5)


def test_the_draft_is_fused_after_the_target():
    draft = draft_decls(TARGET)
    assert [d.layer_id for d in draft] == [0, 2]
    fused = fused_decls(TARGET)
    assert [d.layer_id for d in fused] == [0, 1, 2, 3, 4, 5]
    assert fused[4].parts == TARGET[0].parts and fused[5].parts == TARGET[2].parts


def test_every_pool_prices_the_draft_bytes():
    """Attention bytes per token: target 3 layers * 256 = 768; the draft adds a window and a full
    layer, 2 * 256 = 512."""
    out = spec_summary(TARGET, 3, 0.5, page_size=16)
    assert out["token_bytes_target"] == 768
    assert out["token_bytes_with_draft"] == 768 + 512
    assert out["tokens_per_target_forward"] == 1.875 and out["draft_layers"] == 2


def _one_request_steps(decode_tokens) -> tuple[int, int]:
    """One request, an 8-token prompt and 10 outputs, alone in a roomy pool: (steps, outputs)."""
    pool = kvchain_pool(TARGET, PoolConfig(2**22, page_size=16, context_len=256, max_running=4))
    req = ScheduledRequest(0, 0, np.arange(1, 9, dtype=np.int32), 10, 10)
    result, _ = run_pool(pool, [req], decode_tokens=decode_tokens)
    return result.steps, result.output_tokens


def test_a_decode_step_yields_the_accepted_proposals_and_one():
    """The prefill step samples output 1; then each decode step yields 1 + the accepted count,
    capped at the outputs left. Plain (or P = 0): 1 + 9 steps. Every proposal accepted with k = 3:
    4 + 4 + 1 outputs after the first, 1 + 3 = 4 steps. k = 2, P = 1: 3 + 3 + 3, 1 + 3 = 4 steps;
    k = 1: 2 + 2 + 2 + 2 + 1, 1 + 5 = 6 steps."""
    assert _one_request_steps(None) == (10, 10)
    assert _one_request_steps(SpecSteps(3, 0.0)) == (10, 10)
    assert _one_request_steps(SpecSteps(3, 1.0)) == (4, 10)
    assert _one_request_steps(SpecSteps(2, 1.0)) == (4, 10)
    assert _one_request_steps(SpecSteps(1, 1.0)) == (6, 10)


def test_seeded_draws_average_the_expected_tokens_per_round():
    """P(accepted >= i) = P**i: over 20000 seeded positions the mean of 1 + accepted is within 1%
    of sum(P**i for i in 0..k), the same for the same seed, and each count lies in [0, k]."""
    steps = SpecSteps(3, 0.6, seed=5)
    counts = [steps.accepted(rid, pos) for rid in range(100) for pos in range(200)]
    assert set(counts) == {0, 1, 2, 3}
    mean = 1 + sum(counts) / len(counts)
    assert mean == pytest.approx(expected_tokens_per_round(3, 0.6), rel=0.01)
    assert counts == [SpecSteps(3, 0.6, seed=5).accepted(rid, pos) for rid in range(100) for pos in range(200)]
    assert counts != [SpecSteps(3, 0.6, seed=6).accepted(rid, pos) for rid in range(100) for pos in range(200)]
    with pytest.raises(InputError):
        SpecSteps(3, 1.5)
