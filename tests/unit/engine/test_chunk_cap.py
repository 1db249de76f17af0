"""ADM-10: a request admitted at a chunk smaller than the token budget, because only at that size
does all of it fit, keeps its later chunks within that size. Before, the next chunk was sized by
the token budget alone: on a window model a larger chunk's transient window tail did not fit, the
request (alone in the pool) was retracted, admitted again at the small chunk, and so on forever."""

from __future__ import annotations

import pytest

from kvchain.engine.scheduler import Scheduler
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.engine.tiny import make_checkpoint

PROMPT = [30, 56, 65, 8, 32, 173, 172, 179, 59, 224, 203, 201, 7, 169, 56, 139, 220, 85, 41, 203, 204, 197, 104, 14,
          22, 138, 99, 208, 217, 242, 17, 48, 37, 34, 144, 177, 53, 106, 9, 171, 76, 237, 9, 245, 126, 82, 79]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return make_checkpoint("gemma3", tmp_path_factory.mktemp("chunk-cap") / "g", seed=1, sliding_window=8)


def test_a_request_admitted_at_a_small_chunk_prefills_in_small_chunks(windowed, monkeypatch):
    cfg = dict(page_size=4, context_len=128, overlap=False, prefix_cache=False, ignore_eos=True, inline=True)
    with Engine(str(windowed), EngineConfig(budget_bytes=290_000, **cfg)) as engine:
        want = engine.generate([GenerateRequest(PROMPT, 2)]).outputs[0].token_ids
    monkeypatch.setattr(Scheduler.run, "__defaults__", (500, None))  # a livelock ends as 'waiting'
    with Engine(str(windowed), EngineConfig(budget_bytes=279_017, **cfg)) as engine:
        result = engine.generate([GenerateRequest(PROMPT, 2)])
    out = result.outputs[0]
    assert out.finish_reason == "length" and out.token_ids == want
    assert result.stats.steps < 10  # a few small chunks, no retractions
