"""Speculative rounds leave every checkpoint plain decoding leaves (from their scratch slots).

Two turns of chat through an engine with and without the draft: turn 1 decodes, and its requests'
state checkpoints go into the prefix tree as they pass each grid point; turn 2's prompts are turn
1's prompts and outputs plus a new message, so what they find cached is set by the checkpoints
turn 1 left. A round that stepped over a grid point would leave none there: its turn-2 request
would match less. The prompts share no prefix and the budget evicts nothing, so timing does not
change what is cached."""

from __future__ import annotations

import numpy as np
import pytest
from spec_support import draft_dir

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from support.engine import INTERVAL, PAGE, checkpoint_dir

FAMILY = "qwen3_next"


def two_turns(draft: bool, whole: bool = False):
    rng = np.random.default_rng(3)
    first = [GenerateRequest(rng.integers(0, 256, int(n)).tolist(), int(m))
             for n, m in zip(rng.integers(5, 30, 4), rng.integers(14, 30, 4))]
    cfg = EngineConfig(page_size=PAGE, max_running=4, max_batched_tokens=48, context_len=128,
                       checkpoint_interval=INTERVAL, ignore_eos=True, overlap=True,
                       **({"draft_model_path": str(draft_dir(FAMILY, whole)), "num_speculative_tokens": 3}
                          if draft else {}))
    with Engine(load_checkpoint(checkpoint_dir(FAMILY)), cfg) as engine:
        one = engine.generate(first)
        second = [GenerateRequest(list(r.prompt_token_ids) + o.token_ids + rng.integers(0, 256, 5).tolist(), 4)
                  for r, o in zip(first, one.outputs)]
        two = engine.generate(second)
    return one, two


@pytest.mark.parametrize("whole", [False, True])
def test_prefix_hits_after_speculative_decoding_equal_plain_decoding(whole):
    plain_one, plain_two = two_turns(draft=False)
    spec_one, spec_two = two_turns(draft=True, whole=whole)
    assert [o.token_ids for o in spec_one.outputs] == [o.token_ids for o in plain_one.outputs]
    assert spec_one.stats.spec_rounds > 0
    assert spec_one.stats.checkpoints == plain_one.stats.checkpoints
    hits = [o.cached_tokens for o in spec_two.outputs]
    assert hits == [o.cached_tokens for o in plain_two.outputs]
    assert all(h > 0 for h in hits)
