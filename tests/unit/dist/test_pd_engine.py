"""`generate --pd`: a prefill process and a decode process give the single-process engine's outputs,
token for token, on hybrid tiny checkpoints (Gemma 3: sliding-window and full attention; Qwen3-Next:
full attention and linear-attention state)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from kvchain.dist.pd_engine import generate_pd
from kvchain.dist.transfer import nixl_available
from kvchain.engine.serve import Engine, EngineConfig
from support.engine import PAGE, checkpoint_dir, workload

NIXL_MISSING = nixl_available()
CONFIG = EngineConfig(budget_bytes=8 * 2**20, page_size=PAGE, context_len=128, max_running=8, ignore_eos=True)


@pytest.mark.parametrize("family,kind", [
    ("gemma3", "gloo"),
    pytest.param("qwen3_next", "nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
        NIXL_MISSING is not None, reason=str(NIXL_MISSING))]),
])
def test_pd_outputs_are_the_single_process_engines(family, kind):
    requests = workload(6, seed=3)
    path = checkpoint_dir(family)
    with Engine(path, CONFIG) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, CONFIG, requests, kind=kind, timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert all(len(o.token_ids) == r.max_new_tokens for o, r in zip(pd.outputs, requests))
    assert not mp.active_children()
