"""A lazy checkpoint on a full pool makes room in the prefix cache, as any other take does (CAP-2).

Tiny chain worked by hand: 960 bytes, full-attention pages of 4 tokens at 64 B, state slots at
32 B, a checkpoint every 16 tokens (`extra_buffer_lazy`: a slot is taken only at a grid point)."""

from __future__ import annotations

import numpy as np

from kvchain.cache.radix import CheckpointStrategy
from kvchain.engine.policies import VllmPolicy
from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.plan import PoolKind
from kvchain.prefill_budget import Decision
from support.simworld import world


def _req(rid: int, prompt: int) -> ScheduledRequest:
    return ScheduledRequest(rid, 0, np.arange(1, prompt + 1, dtype=np.int32) + 1000 * rid, 2, 2)


def _admit(pool, r: ScheduledRequest, limit: int) -> None:
    policy, pool.policy = pool.policy, VllmPolicy(watermark=0.0)  # charge the chunk only
    a = pool.try_admit(pool.begin_pass([], frees_coming=False), r, limit)
    pool.policy = policy
    assert a.decision is Decision.ADMIT
    r.phase = Phase.RUNNING


def test_lazy_checkpoint_on_a_full_pool_evicts_a_cached_page_instead_of_stalling():
    """CAP-2 for checkpoints. A (20 tokens) is prefilled, checkpointed at 16 and finished: the tree
    holds its 5 pages (320 B) and the state at 16 (32 B); 608 B are free. B (36 tokens, shares
    nothing) takes its row's state slot (32 B) and 9 pages (576 B): the chain is full. At B's grid
    point 32 the lazy checkpoint needs one 32 B slot: the tree evicts in its own order until it fits
    (here A's page past its checkpoint, a leaf no match can end at, before its least recently used
    state) and the checkpoint is taken, so B's prefix is matchable at 32 and A's still at 16. Before, the
    slot take failed and the checkpoint was abandoned (a stall), so on a full pool a state model's
    tree kept pages no match can use (a match needs a state) and lost the states it could."""
    pool = world(chain_kib=1, window=0, interval=16, rows=4, strategy=CheckpointStrategy.EXTRA_BUFFER_LAZY)
    assert pool.chain.layout.chain_bytes == 960
    assert [(p.kind, p.page_bytes) for p in pool.plan.sub_pools] == [(PoolKind.STATE, 32), (PoolKind.FULL, 64)]
    a = _req(0, 20)
    _admit(pool, a, 64)
    pool.processed([a])
    assert pool.stats_counters["checkpoints"] == 1
    a.generated = a.output_len
    pool.finish(a)
    assert pool.tree.held_pages() == {"state": 1, "full": 5}
    b = _req(1, 36)
    _admit(pool, b, 36)
    full = [1 if p.kind is PoolKind.STATE else 0 for p in pool.plan.sub_pools]
    assert not pool.chain.units_fit(full)  # no free 32 B anywhere
    pool.processed([b])
    assert pool.stats_counters["checkpoints"] == 2 and pool.stats_counters["checkpoint_stalls"] == 0
    held = pool.tree.held_pages()
    # A's page past its checkpoint (tokens 16..19, a leaf no match can end at) went first: its 64 B
    # hold the slot, so A's state at 16 stays beside B's
    assert held == {"state": 2, "full": 4 + 8} and pool.tree.stats["evicted_state_slots"] == 0  # A: 4, B: 8
    assert pool.tree.stats["evicted_pages"] == 1
    assert pool.tree.match_prefix(b.tokens(35)).length == 32  # B's prefix is matchable at its grid point
    assert pool.tree.match_prefix(a.tokens(19)).length == 16  # and A's still at its own
