"""The engine against transformers, token for token (fp32, CPU).

For each family a tiny checkpoint is written with `save_pretrained` and loaded back through the
engine's loader; requests with shared prefixes are served batched under the overlap loop on
`ThreadDevice`, from a pool small enough that only a few run at once, pages move every few steps,
window rows retire and state checkpoints are taken and hit. The reference is transformers'
own `generate` on each prompt alone, computed once per test run. The same serving with the
write-after-read barrier removed, or with hand-out zeroing removed over an arena whose free bytes
hold NaN, must produce wrong tokens (strict xfails)."""

from __future__ import annotations

import pytest

from kvchain import faults
from kvchain.errors import InputError
from support.engine import (
    FAMILIES,
    LOGIT_TOL,
    check_family,
    logit_error,
    mismatches,
    serve,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_output_is_transformers_output(family):
    """CI slice: 12 requests per family."""
    check_family(family, 12)


@pytest.mark.sweep
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_output_is_transformers_output_64(family):
    check_family(family, 64)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_prefix_reuse_changes_nothing(family):
    on = serve(family, 12)
    off = serve(family, 12, prefix_cache=False)
    assert on.stats.cached_tokens > 0 and off.stats.cached_tokens == 0
    assert [o.token_ids for o in on.outputs] == [o.token_ids for o in off.outputs]


def test_no_overlap_gives_the_same_tokens():
    assert mismatches(serve("gpt_oss", 12, overlap=False), "gpt_oss", 12) == []


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_inline_streams_give_the_same_tokens(family):
    """`inline`: the same loop with every stream's work run on the host thread at launch."""
    result = serve(family, 12, inline=True, poison=True)
    assert mismatches(result, family, 12) == []
    assert logit_error(result, family, 12) < LOGIT_TOL[family]
    assert result.stats.compaction_moves > 0 and result.stats.cached_tokens > 0


@pytest.mark.parametrize("bad", [dict(device="cuda"), dict(forward_delay=0.001)])
def test_inline_is_refused_where_streams_are_needed(bad):
    with pytest.raises(InputError, match="inline"):
        serve("gemma3", 1, inline=True, **bad)


@pytest.mark.xfail(strict=True, reason="LIFE-4/5: without the write-after-read barrier the next step's "
                   "metadata upload overwrites the page tables the running forward reads")
@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_without_the_war_barrier_tokens_are_wrong(family):
    result = serve(family, 12, war_barrier=False, forward_delay=0.002)
    assert mismatches(result, family, 12) == []


@pytest.mark.xfail(strict=True, reason="ALLOC-20: without hand-out zeroing a page's unwritten tail keeps "
                   "the arena's stale NaN, which whole-page attention reads")
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_without_hand_out_zeroing_tokens_are_wrong(family):
    """An attention band next to a state band (their boundary moves as the pool fills)."""
    with faults.injected(faults.SKIP_ZEROING):
        result = serve(family, 12, poison=True)
    assert mismatches(result, family, 12) == []
