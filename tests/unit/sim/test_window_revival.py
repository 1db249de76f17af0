"""A request that recomputes a cached prefix whose window rows were evicted gives the tree its own
rows for it, so the prefix is matchable again (WIN-9: a match needs every window's rows behind its
end). Tiny pool worked by hand: pages of 4 tokens, one full-attention and one 8-token window
layer, no state."""

from __future__ import annotations

import numpy as np

from kvchain.engine.policies import VllmPolicy
from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.prefill_budget import Decision
from support.simworld import world

SHARED = np.arange(1, 17, dtype=np.int32)  # 16 tokens (4 pages) every request below starts with


def _req(rid: int, tail: int) -> ScheduledRequest:
    prompt = np.concatenate([SHARED, np.arange(1, tail + 1, dtype=np.int32) + 1000 * rid])
    return ScheduledRequest(rid, 0, prompt, 2, 2)


def _prefill(pool, r: ScheduledRequest, chunks: list[int]) -> None:
    """Admit `r` on its first chunk and run its prompt through `chunks` (token counts)."""
    policy, pool.policy = pool.policy, VllmPolicy(watermark=0.0)
    a = pool.try_admit(pool.begin_pass([], frees_coming=False), r, chunks[0])
    pool.policy = policy
    assert a.decision is Decision.ADMIT and r.computed == r.cached + chunks[0]
    r.phase = Phase.RUNNING
    pool.processed([r])
    for n in chunks[1:]:
        pool.extend([r], [r.computed + n])
        r.computed += n
        pool.processed([r])


def test_a_recomputed_shared_prefix_revives_the_trees_window_rows():
    """WIN-9. A (16 shared + 16 = 32 tokens) prefills in chunks of 8: each step retires its window
    rows behind the 8 tokens before the chunk, so when its prompt ends the tree takes its 8 pages
    with window rows bound only from page 4 on. B (16 shared + 8 of its own) walks 4 shared pages but cannot
    match them (the window rows behind token 16, pages 2-3, are gone): it recomputes them in a
    first chunk of 20, whose rows are all bound until that step ends. Handing its first 16 tokens
    to the tree then rebinds the tree's pages to B's window rows, so C (16 shared + 4) matches
    all 16. Without it the tree gets B's rows only when B's prompt ends (after its second chunk
    of 4), when B binds them from page 3 on: page 2 stays unbound and C matches nothing."""
    pool = world(chain_kib=8, window=8, state=False, rows=4)
    a = _req(0, 16)
    _prefill(pool, a, [8, 8, 8, 8])
    b = _req(1, 8)
    _prefill(pool, b, [20, 4])
    assert b.cached == 0 and pool.stats_counters["windows_revived"] == 1
    c = _req(2, 4)
    _prefill(pool, c, [4])
    assert c.cached == 16
