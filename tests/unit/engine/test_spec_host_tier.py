"""Speculative decoding with a host tier: prefixes evicted from a pool that holds the draft's KV
beside the target's go to the host and come back on later matches (the draft's pages with the
target's, and the state checkpoints), and the outputs are plain greedy decoding's, transformers'."""

from __future__ import annotations

import pytest
from spec_support import serve_spec

from support.engine import mismatches

N = 9
HOST = 4 * 2**20


@pytest.mark.parametrize(("family", "at_once"), [("gemma3", 1), ("nemotron_h", 2), ("qwen3_next", 2)])
def test_a_draft_with_a_host_tier_serves_plain_greedy_output(family: str, at_once: int) -> None:
    with_host = serve_spec(family, N, at_once=at_once, host_budget=HOST)
    without = serve_spec(family, N, at_once=at_once)
    assert with_host.stats.host_hits > 0 and with_host.stats.host_loads > 0 and with_host.stats.spec_rounds > 0
    assert with_host.stats.cached_tokens > without.stats.cached_tokens
    assert [o.token_ids for o in with_host.outputs] == [o.token_ids for o in without.outputs]
    assert mismatches(with_host, family, N) == []
