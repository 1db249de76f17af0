"""A step's state checkpoints taken together (`KVChainPool._checkpoint_all`: one slot take, one
`copy_state`) hand the tree the same states as taking them one by one (WIN-14): prefixes served
again from those checkpoints give transformers' tokens."""

from __future__ import annotations

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig, GenerateResult
from support.engine import INTERVAL, PAGE, checkpoint_dir, mismatches, tight_budget, workload

FAMILY = "nemotron_h"
N = 12


def _serve_twice(batch: bool) -> tuple[GenerateResult, GenerateResult, list[int]]:
    """The workload served twice by one engine (the second time every prompt matches a checkpoint
    of the first): both results and the number of states each `copy_state` copied."""
    cfg = EngineConfig(budget_bytes=tight_budget(FAMILY, 6), page_size=PAGE, max_running=8, max_batched_tokens=96,
                       context_len=128, checkpoint_interval=INTERVAL, ignore_eos=True, inline=True)
    with Engine(load_checkpoint(checkpoint_dir(FAMILY)), cfg) as engine:
        engine.pool.batch_checkpoints = batch
        copies: list[int] = []
        copy_state = engine.storage.copy_state

        def counted(src, dst):
            copies.append(len(dst))
            return copy_state(src, dst)

        engine.storage.copy_state = counted
        first = engine.generate(workload(N))
        second = engine.generate(workload(N))
    return first, second, copies


def test_checkpoints_taken_together_hold_each_requests_state_win14():
    """WIN-14: the checkpoints of one step taken in one operation are the states each request's own
    checkpoint would hold: the second serving restores them and still gives transformers' tokens,
    and as many checkpoints are taken as one by one."""
    first, second, copies = _serve_twice(batch=True)
    assert second.stats.cached_tokens > 0
    assert mismatches(first, FAMILY, N) == []
    assert mismatches(second, FAMILY, N) == []
    assert max(copies) >= 2  # some step took several checkpoints in one copy
    one_first, one_second, one_copies = _serve_twice(batch=False)
    assert max(one_copies) == 1
    taken = first.stats.checkpoints + second.stats.checkpoints
    assert taken == one_first.stats.checkpoints + one_second.stats.checkpoints > 0
