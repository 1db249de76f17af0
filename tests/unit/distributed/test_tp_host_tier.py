"""A host tier behind tensor-parallel ranks: each rank backs up and loads back its own shard of the
heads, in lockstep (`HiCacheController.lockstep`: copies end at the same logical points on every
rank, so what is pending never depends on when a copy ran), and the ranks' decisions agree every
step. Without the lockstep they diverged: a take handed out holes in another order on each rank."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import pytest

from kvchain.dist.tp_engine import generate_in_ranks
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import EngineConfig
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import pages_for, size_plan
from support.engine import PAGE, checkpoint_dir, workload

N = 9


def _rank_budget(family: str) -> int:
    """`support.engine.tight_budget` for one request, over a rank's plan (half the heads)."""
    plan = plan_kv_storage(load_checkpoint(checkpoint_dir(family)).model_spec(tp_size=2).decls, page_size=PAGE)
    fixed = size_plan(plan, 2**30, context_len=128, max_running_requests=8).fixed.total
    token_pages = sum(p.page_bytes for p in plan.sub_pools if p.kind is not PoolKind.STATE)
    state = plan.state.page_bytes if plan.state is not None else 0
    return fixed + pages_for(92, PAGE) * token_pages + 3 * state


@pytest.mark.parametrize("family", ["gemma3", "nemotron_h"])
def test_two_ranks_with_a_host_tier_agree_and_print_what_they_print_without_it(family: str) -> None:
    """Gemma 3's windows and Nemotron-H's state checkpoints evicted to each rank's host pools and
    loaded back: both ranks' digests agree every step, and they print what two ranks without a host
    tier print, with more prefix hits."""
    config = EngineConfig(budget_bytes=_rank_budget(family), page_size=PAGE, max_running=8, max_batched_tokens=48,
                          context_len=128, ignore_eos=True, checkpoint_interval=8)
    requests = workload(N)
    without = generate_in_ranks(str(checkpoint_dir(family)), config, requests, 2)
    runs = generate_in_ranks(str(checkpoint_dir(family)), replace(config, host_budget=4 * 2**20), requests, 2)
    assert runs[0].digests == runs[1].digests
    for run in runs:
        stats = run.result.stats
        assert stats.host_hits > 0 and stats.host_loads > 0
        assert stats.cached_tokens > without[0].result.stats.cached_tokens
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in without[0].result.outputs]
    assert not mp.active_children()
