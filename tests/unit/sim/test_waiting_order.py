"""kvchain's waiting order (`sim/waiting.py`) on a case worked by hand: a tiny pool of 15
full-attention pages of 4 tokens, no window, no state, one request running at a time."""

from __future__ import annotations

import numpy as np

from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.sim.baselines import PoolConfig, kvchain_pool, vllm_hybrid_pool
from kvchain.sim.waiting import LongestPrefixScheduler, ReuseAwareScheduler, scheduler_class
from support.simworld import world


def _run(cls):
    """A (24 tokens) runs first and leaves its 6 pages in the tree. Then X (8 unrelated tokens)
    and Y (A's 24 tokens and 4 more) arrive in that order, with room for one at a time. First
    come first served admits X, and Y after it; the longest-prefix order admits Y first (it
    matches 24 tokens, X none), and Y computes only its 4 new tokens."""
    pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=True)
    a = ScheduledRequest(0, 0, np.arange(1, 25, dtype=np.int32), 1, 1)
    x = ScheduledRequest(1, 5, np.arange(500, 508, dtype=np.int32), 2, 2)
    y = ScheduledRequest(2, 5, np.concatenate([a.prompt, np.arange(900, 904, dtype=np.int32)]), 2, 2)
    sched = cls(pool, max_batched_tokens=64, max_running=1)
    sched.add([a, x, y])
    sched.run()
    assert all(r.phase is Phase.FINISHED for r in (a, x, y))
    return a, x, y


def test_fcfs_admits_in_arrival_order():
    _a, x, y = _run(Scheduler)
    assert x.admitted_step < y.admitted_step


def test_longest_prefix_admits_the_cached_request_first():
    _a, x, y = _run(LongestPrefixScheduler)
    assert y.admitted_step < x.admitted_step
    assert y.cached == 24


def test_kvchain_pools_take_the_order_asked_and_the_engines_first_come_first_served():
    from kvchain.models import model_from_preset

    decls = model_from_preset("llama-3.1-8b").decls
    lpm = PoolConfig(2**30, waiting_order="longest-prefix")
    assert scheduler_class(kvchain_pool(decls, lpm)) is LongestPrefixScheduler
    assert scheduler_class(kvchain_pool(decls, PoolConfig(2**30))) is ReuseAwareScheduler  # the default
    assert scheduler_class(kvchain_pool(decls, PoolConfig(2**30, eviction="lru"))) is Scheduler
    aware = PoolConfig(2**30, eviction="waiting-aware")
    assert scheduler_class(kvchain_pool(decls, aware)) is ReuseAwareScheduler
    assert scheduler_class(vllm_hybrid_pool(decls, aware)) is Scheduler
    assert scheduler_class(vllm_hybrid_pool(decls, lpm)) is Scheduler


def _evict_for_a_stranger(cls, eviction):
    """A (24 tokens, 6 pages) and then B (16 tokens, 4 pages) run and leave their pages in the
    tree; 5 of the 15 pages are free. X (32 unrelated tokens: 8 pages) and Y (A's 24 tokens and
    4 more) arrive in that order. X's admission must evict 3 pages: least recently used gives
    A's (older than B's), so Y finds nothing; waiting-aware eviction knows Y, waiting behind X,
    will match A, and gives B's instead, so Y matches 24 tokens. The order stays first come
    first served: X is admitted first either way."""
    pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=True)
    pool.eviction = eviction
    a = ScheduledRequest(0, 0, np.arange(1, 25, dtype=np.int32), 1, 1)
    b = ScheduledRequest(1, 1, np.arange(100, 116, dtype=np.int32), 1, 1)
    x = ScheduledRequest(2, 5, np.arange(500, 532, dtype=np.int32), 1, 1)
    y = ScheduledRequest(3, 5, np.concatenate([a.prompt, np.arange(900, 904, dtype=np.int32)]), 1, 1)
    sched = cls(pool, max_batched_tokens=64, max_running=1)
    sched.add([a, b, x, y])
    sched.run()
    assert all(r.phase is Phase.FINISHED for r in (a, b, x, y))
    assert x.admitted_step < y.admitted_step
    return y


def test_lru_eviction_gives_a_waiting_request_s_prefix_to_the_stranger_ahead_of_it():
    assert _evict_for_a_stranger(Scheduler, "lru").cached == 0


def test_waiting_aware_eviction_keeps_the_prefix_a_waiting_request_will_match():
    assert _evict_for_a_stranger(ReuseAwareScheduler, "waiting-aware").cached == 24


def test_a_request_overtaken_four_times_goes_next():
    """A (24 tokens) leaves its pages in the tree; then X (8 unrelated tokens) and Y1..Y5 (A's
    24 tokens and 4 of their own) arrive in that order, one running at a time. Each Y matches 24
    tokens and X none, so Y1, Y2, Y3 and Y4 overtake X; then X has been overtaken 4 times
    (`MAX_OVERTAKEN`) and goes before Y5."""
    from kvchain.sim.waiting import MAX_OVERTAKEN

    assert MAX_OVERTAKEN == 4
    pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=True)
    a = ScheduledRequest(0, 0, np.arange(1, 25, dtype=np.int32), 1, 1)
    x = ScheduledRequest(1, 5, np.arange(500, 508, dtype=np.int32), 2, 2)
    ys = [ScheduledRequest(2 + i, 5, np.concatenate([a.prompt, np.arange(4, dtype=np.int32) + 900 + 10 * i]), 2, 2)
          for i in range(5)]
    sched = LongestPrefixScheduler(pool, max_batched_tokens=64, max_running=1)
    sched.add([a, x, *ys])
    sched.run()
    order = sorted([x, *ys], key=lambda r: r.admitted_step)
    assert order == [*ys[:4], x, ys[4]]
    assert all(y.cached == 24 for y in ys)


def test_the_hit_trace_names_the_admission_that_evicted_a_waiting_request_s_prefix():
    """The case above, least recently used, traced (`sim/hit_trace.py`): Y's 24 tokens were held
    before it was admitted and it matched none; they went as a leaf, to make room for X's
    admission, while Y waited second in the queue. With waiting-aware eviction nothing is lost."""
    from kvchain.sim.hit_trace import trace_hits

    def traced(eviction):
        pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=True)
        pool.eviction = eviction
        a = ScheduledRequest(0, 0, np.arange(1, 25, dtype=np.int32), 1, 1)
        b = ScheduledRequest(1, 1, np.arange(100, 116, dtype=np.int32), 1, 1)
        x = ScheduledRequest(2, 5, np.arange(500, 532, dtype=np.int32), 1, 1)
        y = ScheduledRequest(3, 5, np.concatenate([a.prompt, np.arange(900, 904, dtype=np.int32)]), 1, 1)
        return {t.rid: t for t in trace_hits(pool, [a, b, x, y], max_batched_tokens=64, max_running=1).admissions}

    y = traced("lru")[3]
    assert (y.held, y.matched, y.lost) == (24, 0, 24)
    assert (y.lost_to.kind, y.lost_to.cause, y.lost_to.protected) == ("leaf", "admit", False)
    assert y.lost_to.waiting == (2, 3) and y.when() == "while it waited, in the first 8"
    y = traced("waiting-aware")[3]
    assert (y.held, y.matched, y.lost, y.lost_to) == (24, 24, 0, None)


def _overtaken_by_a_longer_match(eviction):
    """The longest-prefix order together with waiting-aware eviction. A (16 tokens: 4 pages), C
    (8: 2 pages) and B (20: 5 pages) run in that order and leave 11 of the 15 pages in the tree.
    Then Y (A's 16 tokens and 4 more) and X (B's 20 tokens and 24 more: 11 pages) arrive in that
    order. X matches 20 tokens and Y 16, so the longest-prefix order admits X first, and X's 6
    new pages need 2 more than the 4 free. Least recently used gives A's 4 pages (the oldest), so
    Y, the very request the order made wait, finds nothing; waiting-aware eviction knows Y will
    match A and gives C's 2 pages instead, so Y matches its 16 tokens."""
    pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=True)
    pool.eviction = eviction
    a = ScheduledRequest(0, 0, np.arange(1, 17, dtype=np.int32), 1, 1)
    c = ScheduledRequest(1, 1, np.arange(300, 308, dtype=np.int32), 1, 1)
    b = ScheduledRequest(2, 2, np.arange(100, 120, dtype=np.int32), 1, 1)
    y = ScheduledRequest(3, 6, np.concatenate([a.prompt, np.arange(900, 904, dtype=np.int32)]), 1, 1)
    x = ScheduledRequest(4, 6, np.concatenate([b.prompt, np.arange(500, 524, dtype=np.int32)]), 1, 1)
    sched = LongestPrefixScheduler(pool, max_batched_tokens=64, max_running=1)
    sched.add([a, c, b, y, x])
    sched.run()
    assert all(r.phase is Phase.FINISHED for r in (a, b, c, x, y))
    assert x.admitted_step < y.admitted_step and x.cached == 20
    return y


def test_longest_prefix_order_alone_lets_the_overtaking_request_evict_the_overtaken_one_s_prefix():
    assert _overtaken_by_a_longer_match("lru").cached == 0


def test_longest_prefix_with_waiting_aware_eviction_keeps_the_overtaken_request_s_prefix():
    assert _overtaken_by_a_longer_match("waiting-aware").cached == 16
