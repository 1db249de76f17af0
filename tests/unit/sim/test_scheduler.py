"""The model-free scheduler over the kvchain pool: every admitted request finishes, none waits
forever, the prefix tree never hands out freed pages, and nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchain.alloc.demand import KVDemand, retained_window, span_pages
from kvchain.cache.radix import CheckpointStrategy
from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.errors import CapacityError
from kvchain.plan import PoolKind
from kvchain.prefill_budget import ChainPrefillBudget, Decision
from support.simworld import workload, world


def _run(pool, requests, *, budget=64, running=16, check_every_step=True, max_steps=20_000, decode_tight=False):
    sched = Scheduler(pool, max_batched_tokens=budget, max_running=running, max_wait_steps=2_000)
    sched.add(requests)
    while not sched.idle:
        assert sched.step_no < max_steps, "the workload did not drain"
        sched.step()
        if check_every_step and pool.tree is not None:
            pool.tree.verify()
        _check_window_bound(pool, sched, decode_tight)
    pool.check_idle()
    if pool.tree is not None:
        pool.tree.verify()
    return sched


def _check_window_bound(pool, sched, decode_tight=False):
    """LIM-5: no running request holds more of its own window rows than admission priced: the
    retained window plus the chunk it last wrote (one token for a request past its first decode,
    when `decode_tight`; else up to the step's token budget)."""
    table = pool.storage.table
    for req in sched.running:
        row = req.row
        chunk = 1 if decode_tight and req.generated >= 2 else sched.max_batched_tokens
        for band in pool.chain.window_bands:
            own = table.own_pages(np.array([row]))
            held = int(np.count_nonzero(band.ids.v2p[own] >= 0))
            bound = span_pages(retained_window(band.pool.window, pool.checkpoint_interval, pool.shares)
                               + chunk, pool.page_size)
            assert held <= bound, f"row {row} holds {held} {band.name} pages, priced at most {bound}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([0, 8, 16]), state=st.booleans(),
       chain_kib=st.integers(10, 40), strategy=st.sampled_from(list(CheckpointStrategy)),
       budget=st.sampled_from([16, 64, 256]))
def test_every_admitted_request_finishes_and_nothing_leaks(seed, window, state, chain_kib, strategy, budget):
    """ADM-9..11, CHK-15: over random workloads with shared prefixes, every request ends
    finished, aborted or rejected (none waits forever); every request that was admitted finishes;
    the tree never returns freed pages; at idle nothing leaks and byte accounting is exact."""
    pool = world(chain_kib=chain_kib, window=window, state=state, strategy=strategy)
    requests = workload(seed)
    sched = _run(pool, requests, budget=budget)
    for req in requests:
        assert req.phase in (Phase.FINISHED, Phase.ABORTED, Phase.REJECTED), req
        if req.admitted_step >= 0:
            assert req.phase is Phase.FINISHED, f"request {req.rid} was admitted but {req.phase}: {req.reason}"
        if req.phase is Phase.FINISHED:
            assert req.generated == req.output_len
    assert sched.stats.finished > 0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([0, 16]), state=st.booleans(),
       chain_kib=st.integers(10, 30), policy=st.sampled_from(["optimistic", "vllm", "sglang", "ideal"]),
       budget=st.sampled_from([16, 64]))
def test_retracting_policies_finish_everything_and_leak_nothing(seed, window, state, chain_kib, policy, budget):
    """Under the policies that admit optimistically and retract (kvchain `optimistic`, vLLM, sglang)
    and the ideal projection: every admitted request finishes (retracted ones recompute), the tree
    verifies every step, nothing leaks at idle; the recomputed tokens never exceed the prefill
    tokens spent."""
    from kvchain.engine.policies import IdealPolicy, SglangPolicy, VllmPolicy, admission_policy

    pool = world(chain_kib=chain_kib, window=window, state=state)
    pool.policy = {"optimistic": admission_policy("optimistic"), "vllm": VllmPolicy(), "sglang": SglangPolicy(),
                   "ideal": IdealPolicy()}[policy]
    requests = workload(seed)
    sched = _run(pool, requests, budget=budget)
    for req in requests:
        if req.admitted_step >= 0:
            assert req.phase is Phase.FINISHED and req.generated == req.output_len, (req.rid, req.reason)
    assert sched.stats.recomputed_tokens <= sched.stats.prefill_tokens


def test_exact_admission_never_retracts():
    """`exact` reserves every output in full: over random workloads on pools small enough that an
    admission reserving running outputs short would retract, no step ever fails to grow, so
    nothing is preempted."""
    for seed in range(6):
        pool = world(chain_kib=6 + seed, window=16 if seed % 2 else 0, state=seed % 3 != 0)
        sched = _run(pool, workload(seed, max_output=60), budget=64, check_every_step=False)
        assert sched.stats.preemptions == 0 and sched.stats.recomputed_tokens == 0


def test_forced_checkpoint_stalls_still_finish(monkeypatch):
    """LIM-3/4/5: with no free slot for checkpoints half of the time, admitted requests still finish and
    never hold more window rows than priced (checked every step)."""
    pool = world(chain_kib=20, window=16, state=True, strategy=CheckpointStrategy.EXTRA_BUFFER)
    storage = pool.storage
    original = storage.alloc_state_slots
    calls = {"n": 0, "forced": False}
    state_only = [p.kind is PoolKind.STATE for p in pool.plan.sub_pools]

    def flaky(n):
        calls["n"] += 1
        # a take right after eviction made room is never forced: the room is there
        calls["forced"] = calls["n"] % 2 == 0 and not calls.pop("room", False)
        if calls["forced"]:
            raise CapacityError("no free tracking slot (forced)")
        return original(n)

    make_room = pool._make_room

    def no_room_for_slots(pages):
        """Nor can eviction give a slot: a demand for state slots alone finds no room while forced."""
        if calls["forced"] and all(s or not n for s, n in zip(state_only, pages)):
            return False
        calls["room"] = made = make_room(pages)
        return made

    monkeypatch.setattr(storage, "alloc_state_slots", flaky)
    monkeypatch.setattr(pool, "_make_room", no_room_for_slots)
    requests = workload(3, n=50)
    sched = _run(pool, requests)
    assert pool.stats_counters["checkpoint_stalls"] > 0
    assert all(r.phase is Phase.FINISHED for r in requests if r.admitted_step >= 0)
    assert sched.stats.finished > 30


@pytest.mark.parametrize("state", [False, True])
def test_long_decodes_never_hold_more_window_rows_than_priced(state):
    """LIM-5: without the prefix tree (so every window row a request keeps is its own), requests that
    decode far past the window never hold more window rows than admission priced for them, checked
    every step, and all of them finish."""
    pool = world(chain_kib=24, window=16, state=state, prefix_cache=False)
    requests = workload(5, n=30, max_output=160)
    sched = _run(pool, requests, budget=16, decode_tight=True)
    assert max(r.output_len for r in requests) > 4 * 16, "the workload never decodes past the window"
    assert all(r.phase is Phase.FINISHED for r in requests if r.admitted_step >= 0)
    assert sched.stats.finished > 20


def test_prefix_reuse_allocates_fewer_pages():
    """A workload with shared prefixes takes measurably fewer full-attention pages with the tree."""
    taken = {}
    for cache in (True, False):
        pool = world(chain_kib=200, window=16, state=True, prefix_cache=cache)
        owner = pool.chain.owner
        count = {"n": 0}
        original = owner.hand_out

        def counting(n, after, fired=None, _o=original, _c=count):
            _c["n"] += n
            return _o(n, after, fired)

        owner.hand_out = counting
        requests = workload(11, n=60, shared=0.9, prefix_len=48, spread=6)
        _run(pool, requests, check_every_step=False)
        taken[cache] = count["n"]
    assert taken[True] < 0.85 * taken[False], taken


def test_multi_turn_windows_reuse_the_previous_turn():
    """A window model (no state) reuses a whole previous turn: its window rows are retained at the
    sequence end."""
    pool = world(chain_kib=100, window=16, state=False)
    first = ScheduledRequest(0, 0, np.arange(1, 41), max_new=9, output_len=9)
    sched = _run(pool, [first])
    history = first.tokens(first.computed)
    second = ScheduledRequest(1, sched.step_no, np.concatenate([history, np.arange(500, 510)]), max_new=4, output_len=4)
    sched2 = Scheduler(pool, max_batched_tokens=64, max_running=4)
    sched2.add([second])
    sched2.run()
    assert second.cached >= (len(history) // 4) * 4 - 4
    pool.check_idle()


def test_oversize_request_is_rejected_at_arrival_with_numbers():
    """A request larger than an empty pool is rejected at arrival, naming what it needs."""
    pool = world(chain_kib=6, window=8, state=True, context=1024)
    big = ScheduledRequest(0, 0, np.arange(1, 400), max_new=5, output_len=5)
    small = ScheduledRequest(1, 0, np.arange(1, 10), max_new=5, output_len=5)
    sched = _run(pool, [big, small])
    assert big.phase is Phase.REJECTED and "input tokens need" in big.reason and "empty pool" in big.reason
    assert small.phase is Phase.FINISHED
    assert sched.stats.rejected == 1


def test_a_rejection_at_arrival_names_the_longest_input_an_empty_pool_holds():
    """At the limit the bytes a request needs can equal the pool's (its sub-pools' page grids align
    apart), so the rejection names the longest input that does fit, found as the clip prices it."""
    pool = world(chain_kib=2, window=8, state=False, context=1024)
    req = ScheduledRequest(0, 0, np.arange(1, 84), max_new=1, output_len=1)
    reason = pool.arrival_check(req)
    assert reason is not None and "need 1.81 KiB" in reason and "empty pool of 1.81 KiB" in reason
    longest = int(reason.split("holds at most ")[1].split()[0])
    assert 0 < longest < req.input_len

    def arrives(n: int) -> bool:
        return pool.arrival_check(ScheduledRequest(0, 0, np.arange(1, n + 1), max_new=1, output_len=1)) is None

    assert arrives(longest) and not arrives(longest + 1)


def test_a_prompt_past_the_context_length_is_rejected():
    pool = world(chain_kib=60, context=64)
    req = ScheduledRequest(0, 0, np.arange(1, 100), max_new=5, output_len=5)
    _run(pool, [req])
    assert req.phase is Phase.REJECTED and "context length 64" in req.reason


def _admits_into_an_empty_pool(input_len: int, output_len: int, **world_kwargs) -> bool:
    """Whether admission, alone in an empty pool like the test's, admits the request."""
    pool = world(**world_kwargs)
    budget = ChainPrefillBudget(pool.storage, KVDemand.zero(len(pool.plan.sub_pools)), False,
                                pool.checkpoint_interval, pool.shares)
    return budget.consider(input_len, output_len, 0, input_len).decision is Decision.ADMIT


def test_memory_clip_lowers_max_new():
    """ADM-16: the clip and admission share request_demand: an output too long for the pool is
    clipped at arrival, not rejected, to exactly the most output admission admits into an empty
    pool (one token more it refuses), and the clipped request runs to its end."""
    shape = {"chain_kib": 6, "window": 8, "state": True, "context": 4096}
    pool = world(**shape)
    req = ScheduledRequest(0, 0, np.arange(1, 20), max_new=10_000, output_len=10_000)
    input_len = req.input_len
    _run(pool, [req], max_steps=50_000)
    clip = req.max_new
    assert req.phase is Phase.FINISHED and clip < 4096 - 19  # memory, not the context, bound it
    assert pool.stats_counters["clipped"] == 2
    assert _admits_into_an_empty_pool(input_len, clip, **shape), "the clip let through what admission refuses"
    assert not _admits_into_an_empty_pool(input_len, clip + 1, **shape), "the clip held back what admission admits"


def test_unschedulable_request_is_aborted_with_its_reason():
    """ADM-11: when nothing will give memory back and no chunk fits now, the request is aborted as
    unschedulable instead of waiting forever. Here a load reservation pins memory no request frees."""
    pool = world(chain_kib=8, window=8, state=True)
    storage = pool.storage
    pinned, _reservation = storage.alloc_load("full", 2 * storage.allocator.owner.grid.n_grid // 3)
    req = ScheduledRequest(0, 0, np.arange(1, 120), max_new=8, output_len=8)
    sched = Scheduler(pool, max_batched_tokens=256, max_running=4)
    sched.add([req])
    sched.run(max_steps=100)
    assert req.phase is Phase.ABORTED and req.reason.startswith("unschedulable"), req.reason
    del pinned


def test_waits_while_running_work_will_free_memory():
    """ADM-9: a request that does not fit now waits while running requests will give memory back,
    and is admitted once they finish."""
    pool = world(chain_kib=10, window=8, state=True)
    hog = ScheduledRequest(0, 0, np.arange(1, 150), max_new=20, output_len=20)
    late = ScheduledRequest(1, 1, np.arange(300, 460), max_new=4, output_len=4)
    _run(pool, [hog, late], budget=256)
    assert hog.phase is Phase.FINISHED and late.phase is Phase.FINISHED
    assert late.admitted_step > late.arrival  # it waited for the running request, not aborted


@pytest.mark.parametrize("strategy", list(CheckpointStrategy))
def test_state_matches_land_on_checkpoints(strategy):
    """WIN-9/10: with checkpoints a match ends on the grid; with no_buffer at a sequence end."""
    pool = world(chain_kib=100, window=16, state=True, strategy=strategy, interval=16)
    prefix = np.arange(1, 51)  # 50 tokens
    a = ScheduledRequest(0, 0, np.concatenate([prefix, [7, 8]]), max_new=3, output_len=3)
    _run(pool, [a])
    b = ScheduledRequest(1, 0, np.concatenate([prefix, [9, 10, 11]]), max_new=3, output_len=3)
    _run(pool, [b])
    if strategy is CheckpointStrategy.NO_BUFFER:
        assert b.cached == 0  # a's sequence end is not b's prefix
    else:
        assert b.cached == 48  # the last grid point (16) at or before the shared 50 tokens


@pytest.mark.parametrize("window", [0, 16])
def test_a_running_prompt_is_shared_with_requests_that_arrive_while_it_runs(window):
    """Prompt pages go to the tree once the prompt is prefilled (a model without state), so a
    request that arrives while the first still decodes matches its prompt; the tree never hands out freed pages."""
    pool = world(chain_kib=100, window=window, state=False, context=512)
    prefix = np.arange(1, 161)
    first = ScheduledRequest(0, 0, np.concatenate([prefix, [7001]]), max_new=30, output_len=30)
    second = ScheduledRequest(1, 4, np.concatenate([prefix, [7002, 7003]]), max_new=5, output_len=5)
    sched = _run(pool, [first, second], budget=64)
    assert second.admitted_step < first.finished_step  # it ran while the first one did
    assert second.cached >= 128, second.cached
    assert sched.stats.finished == 2


def test_the_loop_drives_the_one_step_sequence():
    """Every step that computes tokens is one forward of the step sequence (`engine/steps.py`):
    launched, recorded with the pool, processed at once, and nothing is left in flight at idle."""
    pool = world(chain_kib=200, window=16, state=True)
    launched = []
    original = pool.storage.record_forward

    def recording(record, *args, **kwargs):
        launched.append(record.step)
        return original(record, *args, **kwargs)

    pool.storage.record_forward = recording
    sched = _run(pool, workload(3, n=30, shared=0.5, prefix_len=32, spread=4), check_every_step=False)
    busy = sum(1 for h in sched.stats.history if h.output_tokens or h.prefill_tokens)
    assert pool.steps.stats.launched == pool.steps.stats.processed == busy == len(launched) > 0
    assert not pool.steps.in_flight


@pytest.mark.parametrize(("seed", "chain_kib"), [(2, 14), (5, 10), (5, 14)])
def test_an_admission_copies_the_state_it_matched_from_the_tree(seed, chain_kib, monkeypatch):
    """A lock keeps a matched path's pages, not its state: the room an admission made for itself
    evicted the state it had matched, the take handed that slot id to the admitted row, and the
    row copied the slot onto itself (bytes that are not the checkpoint's; on these seeds once
    each). Every state copy of an admission now reads the matched node's slot, still the tree's."""
    from kvchain.engine.pool import KVChainPool

    copied: list[tuple[int, int, int]] = []  # (matched node's slot after admission, source, destination)
    admit = KVChainPool.try_admit

    def watched(self, ctx, req, token_limit):
        seen = {}
        copy = self.storage.copy_state

        def copy_state(src, dst):
            seen["src"], seen["dst"] = int(src[0]), int(dst[0])
            copy(src, dst)

        self.storage.copy_state = copy_state
        try:
            a = admit(self, ctx, req, token_limit)
        finally:
            del self.storage.copy_state
        if seen:
            copied.append((req.pool_state["node"].state_slot, seen["src"], seen["dst"]))
        return a

    monkeypatch.setattr(KVChainPool, "try_admit", watched)
    pool = world(chain_kib=chain_kib, window=16, state=True, slots=17)
    _run(pool, workload(seed, n=60, shared=0.8), check_every_step=False)
    assert len(copied) >= 10
    assert [c for c in copied if c[0] != c[1] or c[1] == c[2]] == []


def test_a_run_that_reaches_its_step_cap_with_work_left_raises():
    """A loop that cannot finish its requests (a livelock) is an error, never requests quietly left
    'waiting' in the result."""
    from kvchain.engine.scheduler import SchedulerStuck

    pool = world(chain_kib=64, window=8, state=True)
    sched = Scheduler(pool, max_batched_tokens=256, max_running=4)
    sched.add([ScheduledRequest(0, 0, np.arange(1, 40), max_new=8, output_len=8)])
    with pytest.raises(SchedulerStuck, match="1 requests still unserved after 2 steps"):
        sched.run(max_steps=2)
