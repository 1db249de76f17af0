"""Speculative decoding in the engine against plain greedy decoding of the target (and so against
transformers), under the overlap loop on ThreadDevice with compaction and prefix reuse, over an
arena whose free bytes are NaN. The draft is the target's own first layers (it proposes mostly
wrong tokens, so rounds reject) or the whole target (every proposal accepted)."""

from __future__ import annotations

import pytest
from spec_support import SPEC_FAMILIES, serve_spec

from support.engine import mismatches


def check(family: str, n: int, **kw):
    result = serve_spec(family, n, at_once=3, **kw)
    assert mismatches(result, family, n) == []
    s = result.stats
    assert s.spec_rounds > 0 and s.spec_proposed >= s.spec_rounds
    assert s.peak_running >= 2 and s.cached_tokens > 0  # batched, with prefix hits
    return result


@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_speculative_output_is_plain_greedy_output(family):
    """CI slice: 6 requests per family, from a pool where 3 fit at once."""
    result = check(family, 6)
    assert result.stats.compaction_moves > 0  # pages moved between the rounds
    assert result.stats.spec_accepted < result.stats.spec_proposed  # rounds reject (the draft is weak)


@pytest.mark.parametrize("family", ["bamba", "falcon_h1", "jamba", "recurrent_gemma", "minimax", "olmo_hybrid",
                                    "kimi_linear", "zamba2", "bailing_hybrid"])
def test_speculative_output_on_the_other_state_families(family):
    """The draft cut from each other kind of recurrent target: Bamba's attention layer listed by
    index, Falcon-H1's layers holding KV and state side by side, Jamba's Mamba1 blocks that pass no
    keywords down, RecurrentGemma's blocks that keep no layer index, MiniMax's lightning attention,
    OLMo Hybrid's DeltaNet, Kimi Linear's KDA beside latent attention (its draft keeps its layers'
    `mlp_layer_types`), Zamba2's Mamba2 with its first hybrid layer's shared attention block and
    Bailing's delta attention beside its gated latent attention."""
    check(family, 6)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_speculative_output_with_latent_attention(family):
    """DeepSeek-V3's draft (its first layer) and target both keep MLA latents in the fused pool: the
    verify forward writes the proposals' latents and reads them back through the same groups.
    DeepSeek-V3.2's also keep their indexer keys there, and the draft's indexer picks among its own."""
    check(family, 6)


@pytest.mark.parametrize("family", ["llama4", "mimo_v2_flash"])
def test_speculative_output_with_chunked_and_wide_windows(family):
    """Llama 4's draft keeps a chunked layer and MiMo-V2-Flash's a sliding layer with twice the
    global layers' K/V heads and sinks: each draft window is a band of the fused pool."""
    check(family, 6)


def test_a_shared_attention_draft_keeps_its_kv_in_its_own_layers(monkeypatch):
    """Zamba2's shared block is told its layer by the decoder loop, which a draft counts from 0: the
    fused draft's block must still address the draft's layers of the pool, after the target's (a
    draft that wrote its keys into the target's layers would corrupt what the target reads)."""
    from kvchain.engine import attention

    real, layers = attention.paged_attention, set()

    def spy(module, *args, kvchain_layer=None, **kwargs):
        layers.add(module.layer_idx if kvchain_layer is None else kvchain_layer)
        return real(module, *args, kvchain_layer=kvchain_layer, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", spy)
    result = serve_spec("zamba2", 2, at_once=3, whole=True)
    assert mismatches(result, "zamba2", 2) == []
    assert result.stats.spec_accepted == result.stats.spec_proposed > 0
    assert layers == {1, 3, 5, 7, 9, 11}  # the target's hybrid layers, then the draft's (offset 6)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_a_draft_that_is_the_target_has_every_proposal_accepted(family):
    result = check(family, 6, whole=True)
    s = result.stats
    assert s.spec_accepted == s.spec_proposed
    assert s.tokens_per_target_forward > 2  # rounds of 3 proposals: up to 4 tokens per request per forward


@pytest.mark.sweep
@pytest.mark.parametrize("family", SPEC_FAMILIES)
def test_speculative_output_is_plain_greedy_output_24(family):
    check(family, 24)
    check(family, 12, whole=True, k=2)
