"""The simulator's host tier (`kvchain simulate --host-budget`) on cases worked by hand: a tiny
pool of 15 full-attention pages of 4 tokens (64 bytes a page), no window, no state."""

from __future__ import annotations

import numpy as np

from kvchain.engine.policies import VllmPolicy
from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.prefill_budget import Decision
from kvchain.sim.baselines import PoolConfig, kvchain_pool
from kvchain.sim.host_tier import HostTier, HostTierPool, page_hashes, with_host_tier
from support.simworld import world

PAGE_BYTES = 64


def tiny(host: int | None):
    pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=True)
    assert pool.page_size == 4 and pool.plan.owner.page_bytes == PAGE_BYTES
    return with_host_tier(pool, host) if host else pool


def req(rid, prompt, max_new, tokens=None):
    t = np.arange(1, prompt + 1, dtype=np.int32) + 1000 * rid if tokens is None else tokens
    return ScheduledRequest(rid, 0, t, max_new, max_new)


def test_host_evicts_least_recently_used_and_never_a_swap_reservation():
    """300 bytes: a, b, c of 100 each fill it; a is touched, so d evicts b (the least recently
    used). A 200-byte swap reservation then evicts c and a, never d's newer entry first; a second
    one cannot fit beside it (100 left) and is refused, and nothing more is evicted for it."""
    host = HostTier(300)
    for key in "abc":
        assert host.put((key,), 100) == 100
    host.touch(("a",))
    assert host.put(("d",), 100) == 100
    assert list(host.entries) == [("c",), ("a",), ("d",)]
    assert host.put(("d",), 100) == 0  # already there: nothing copied
    assert host.reserve_swap(200)
    assert list(host.entries) == [("d",)] and host.used == 300
    assert not host.reserve_swap(200)
    assert list(host.entries) == [("d",)]
    host.release_swap(200)
    assert host.used == 100


def test_page_hashes_name_the_prefix_not_the_page():
    a = np.arange(8, dtype=np.int32)
    b = np.concatenate([np.arange(4, 8), np.arange(4)]).astype(np.int32)
    assert page_hashes(a, 4)[0] != page_hashes(b, 4)[1]  # same page tokens, different prefix
    assert page_hashes(a, 4) == page_hashes(np.concatenate([a, [9, 9]]), 4)


def _finish(pool, r):
    sched = Scheduler(pool, max_batched_tokens=64, max_running=8)
    sched.add([r])
    sched.run()
    assert r.phase is Phase.FINISHED


def test_an_evicted_prefix_is_backed_up_and_loaded_back_on_a_match():
    """A (32 tokens, one output token) finishes: the tree holds its 8 pages. Evicting them all
    backs 8 pages up to the host (8 x 64 = 512 bytes). B is A's prompt and 8 tokens more: it
    matches its first 39 tokens, 9 whole pages; the device has none of them and the host the
    first 8, so they are loaded back (512 bytes) and B starts with 32 cached tokens, all of them
    host hits, and computes 8. Without a host tier B computes all 40."""
    for host, cached in ((10_000, 32), (None, 0)):
        pool = tiny(host)
        a = req(0, 32, 1)
        _finish(pool, a)
        assert pool.tree.held_pages() == {"full": 8}
        pool.tree.evict_all()
        b = req(1, 40, 1, tokens=np.concatenate([a.prompt, np.arange(5000, 5008, dtype=np.int32)]))
        ctx = pool.begin_pass([], frees_coming=False)
        assert pool.try_admit(ctx, b, 64).decision is Decision.ADMIT
        assert (b.cached, b.computed) == (cached, 40)
        if host:
            assert pool.host_counters["copied_bytes"] == 512 + 512
            assert pool.host_counters["loaded_bytes"] == 512
            assert pool.host_counters["host_hit_tokens"] == 32
        pool.tree.verify()


def test_no_load_back_for_a_request_admission_would_abort_with_its_match():
    """A's 8 pages are evicted to the host, as above. C is A's prompt and 36 tokens more: 17 pages,
    more than the pool's 15, so admission aborts it with or without a match. Loaded first, A's
    512 bytes came back for nothing; asked of admission first, nothing is loaded."""
    pool = tiny(10_000)
    a = req(0, 32, 1)
    _finish(pool, a)
    pool.tree.evict_all()
    c = req(2, 68, 1, tokens=np.concatenate([a.prompt, np.arange(6000, 6036, dtype=np.int32)]))
    ctx = pool.begin_pass([], frees_coming=False)
    assert pool.try_admit(ctx, c, 64).decision is Decision.ABORT
    assert pool.host_counters["loaded_bytes"] == 0 and pool.host_counters["host_hit_tokens"] == 0
    assert pool.tree.held_pages() == {"full": 0}
    pool.tree.verify()


def _retract_and_readmit(host):
    """X: a 16-token prompt, prefilled (4 pages) with its first token sampled, then retracted;
    then readmitted."""
    pool = tiny(host)
    pool.policy = VllmPolicy(watermark=0.0)
    x = req(0, 16, 8)
    sched = Scheduler(pool, max_batched_tokens=64, max_running=8)
    ctx = pool.begin_pass([], frees_coming=False)
    assert pool.try_admit(ctx, x, 64).decision is Decision.ADMIT and x.computed == 16
    x.generated, x.phase = 1, Phase.RUNNING
    sched.running.append(x)
    sched._preempt(x)
    assert pool.storage.table.active.sum() == 0 and x.computed == 0
    sched.step()
    assert x.phase is Phase.RUNNING and x.computed == 16
    return pool, sched, x


def test_a_retracted_request_is_swapped_out_and_back_instead_of_recomputed():
    """With a host tier X's 4 pages (256 bytes) go to the host, none to the tree; readmitted, it
    gets 15 of its 16 tokens back from the host (4 pages, 256 bytes) and computes the one token
    every admission computes: 1 recomputed. Without a host tier its pages are cached in the tree
    and it finds 3 whole pages (12 tokens) of the 15 it may match: 4 recomputed. A host of 100
    bytes cannot hold X (256), so it recomputes as without one."""
    pool, sched, x = _retract_and_readmit(10_000)
    assert pool.host_counters["swapped_out"] == 1 and pool.host_counters["swapped_tokens"] == 15
    assert pool.host_counters["copied_bytes"] == 256 + 256
    assert (x.cached, sched.stats.recomputed_tokens) == (15, 1)
    assert pool.host.swap_bytes == 0  # given back once it is in
    for host in (None, 100):
        pool, sched, x = _retract_and_readmit(host)
        assert (x.cached, sched.stats.recomputed_tokens) == (12, 4)
        if host:
            assert pool.host_counters["swap_refused"] == 1 and pool.host.swap_bytes == 0


def test_host_budget_builds_a_host_tier_pool_and_reports_it():
    from kvchain.models import model_from_preset
    from kvchain.sim.runner import StepTimeModel, run_pool
    from kvchain.sim.workloads import workload_from_name

    decls = model_from_preset("llama-3.1-8b").decls
    pool = kvchain_pool(decls, PoolConfig(2**30, host_budget=2**30))
    assert isinstance(pool, HostTierPool) and pool.host.capacity == 2**30
    assert not isinstance(kvchain_pool(decls, PoolConfig(2**30)), HostTierPool)
    result, _ = run_pool(pool, workload_from_name("multi_turn", 6, 0), step_time=StepTimeModel())
    assert result.host is not None and result.host_hit_rate is not None
    assert result.device_hit_rate == result.hit_rate - result.host_hit_rate
    assert StepTimeModel().seconds(0, 0, 10**9) - StepTimeModel().seconds(0, 0) == 40e-3  # 25 GB/s
