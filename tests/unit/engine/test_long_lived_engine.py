"""An engine that serves call after call keeps nothing per request once the request has left: a
server runs one engine for weeks, so what it keeps per request served is a leak."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvchain.engine.sampling import SamplingParams
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from support.engine import checkpoint_dir, draft_dir, workload

CONFIG = EngineConfig(budget_bytes=4 << 20, page_size=4, context_len=128, max_running=8, checkpoint_interval=8)


@pytest.mark.parametrize(("family", "overlap", "draft"), [("gemma3", False, False), ("gemma3", True, False),
                                                          ("qwen3_next", True, False), ("gemma3", False, True)])
def test_nothing_per_request_outlives_it(family: str, overlap: bool, draft: bool) -> None:
    """Three calls of twelve requests (sampled ones with log-probabilities among them): after each,
    the pool's per-request records (outputs read back, outputs in flight, log-probabilities) are
    empty. The outputs read back were kept for every request ever served."""
    config = replace(CONFIG, overlap=overlap)
    if draft:
        config = replace(config, draft_model_path=str(draft_dir(family)), num_speculative_tokens=2)
    with Engine(checkpoint_dir(family), config) as engine:
        for call in range(3):
            requests = [GenerateRequest(r.prompt_token_ids, r.max_new_tokens,
                                        SamplingParams(temperature=0.8, seed=i) if i % 2 else None,
                                        logprobs=2 if i % 3 == 0 else None)
                        for i, r in enumerate(workload(12, seed=call))]
            result = engine.generate(requests)
            assert all(len(o.token_ids) > 0 for o in result.outputs)
            pool = engine.pool
            assert (len(pool._known), len(pool._future), len(pool.counters.logprobs)) == (0, 0, 0)
