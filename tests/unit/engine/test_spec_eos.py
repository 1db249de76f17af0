"""A speculative round launched on a token that ends its request (an end-of-sequence token still in
flight under the overlap loop): the request finishes while the round runs, and its row may go to
another request before the round is processed. The round's results are dropped and the row is cut
back to its verified tokens before the prefix tree caches it."""

from __future__ import annotations

import pytest

from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.engine.speculative_draft import make_draft_checkpoint
from kvchain.engine.tiny import make_checkpoint

#: the request whose first output token is made the end-of-sequence token, and one that runs on
FIRST = [126, 110, 152, 0, 110, 84, 17, 60, 166, 27]
OTHER = [115, 121, 10, 148, 153, 160, 127, 40, 249, 54, 184, 51, 47, 9, 196, 177]
BASE = dict(budget_bytes=64 << 20, page_size=4, ignore_eos=False, context_len=128, checkpoint_interval=8)


@pytest.fixture(scope="module", params=["gemma3", "qwen3_next"])
def ending(request, tmp_path_factory):
    """A target whose end-of-sequence token is FIRST's first output token, its draft, and the plain
    outputs of FIRST and OTHER (FIRST stops at once)."""
    family, root = request.param, tmp_path_factory.mktemp(f"spec-eos-{request.param}")
    plain = make_checkpoint(family, root / "plain", seed=1)
    with Engine(str(plain), EngineConfig(**BASE, overlap=False, prefix_cache=False)) as engine:
        eos = engine.generate([GenerateRequest(FIRST, 1)]).outputs[0].token_ids[0]
    target = make_checkpoint(family, root / "target", seed=1, eos_token_id=eos)
    reqs = [GenerateRequest(FIRST, 3), GenerateRequest(OTHER, 4)]
    with Engine(str(target), EngineConfig(**BASE, overlap=False)) as engine:
        want = [o.token_ids for o in engine.generate(reqs).outputs]
    assert want[0] == [eos]
    return target, make_draft_checkpoint(target, root / "draft", None), reqs, want


@pytest.mark.parametrize("max_running", [1, 2])
def test_a_request_that_ends_while_its_round_runs_leaves_the_others_right(ending, max_running):
    target, draft, reqs, want = ending
    cfg = EngineConfig(**BASE, overlap=True, max_running=max_running, draft_model_path=str(draft),
                       num_speculative_tokens=1)
    with Engine(str(target), cfg) as engine:
        result = engine.generate(reqs)
    assert [o.token_ids for o in result.outputs] == want
    assert result.stats.spec_dropped > 0  # the finished request's round was dropped
