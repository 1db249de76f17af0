"""The same engine on `CudaDevice`: the kernels, the metadata upload and the overlap loop are the
CPU code on CUDA streams; greedy tokens equal transformers' (fp32). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvchain.engine.serve import Engine, EngineConfig
from support.engine import (
    FAMILIES,
    INTERVAL,
    PAGE,
    checkpoint_dir,
    reference,
    tight_budget,
    workload,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_on_cuda_is_transformers_output(family):
    cfg = EngineConfig(budget_bytes=tight_budget(family, 4), page_size=PAGE, max_running=8, max_batched_tokens=48,
                       context_len=128, checkpoint_interval=INTERVAL, ignore_eos=True, device="cuda")
    with Engine(checkpoint_dir(family), cfg) as engine:
        result = engine.generate(workload(12))
    want, _ = reference(family, 12)
    assert [o.token_ids for o in result.outputs] == want
    assert result.stats.compaction_moves > 0
