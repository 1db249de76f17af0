"""`kvchain simulate --spec-tokens K --spec-acceptance P`: the draft fused into every pool, and the
tokens a round yields, worked by hand."""

from __future__ import annotations

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
from kvchain.errors import InputError
from kvchain.sim.speculative import draft_decls, expected_tokens_per_round, fused_decls, spec_summary

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
