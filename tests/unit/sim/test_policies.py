"""Each scheduling policy on a tiny pool worked by hand: 15 full-attention pages of 4 tokens (60
tokens), no window, no state, so every number below is a page count one can check on paper."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.engine.policies import (
    DecayingRatioPolicy,
    ExactPolicy,
    IdealPolicy,
    OnlineEstimatePolicy,
    SglangPolicy,
    VllmPolicy,
    admission_policy,
)
from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.prefill_budget import Decision, peak_pages
from support.simworld import world

PAGES = 15


def tiny(policy, prefix_cache=False):
    pool = world(chain_kib=1, window=0, state=False, rows=8, prefix_cache=prefix_cache)
    assert pool.page_size == 4 and pool.chain.units_fit([PAGES]) and not pool.chain.units_fit([PAGES + 1])
    pool.policy = policy
    return pool


def req(rid, prompt, max_new, *, arrival=0, priority=0, output=None):
    return ScheduledRequest(rid, arrival, np.arange(1, prompt + 1, dtype=np.int32) + 1000 * rid, max_new,
                      max_new if output is None else output, priority=priority)


def running(pool, r, limit=64):
    """Admit `r` through the pool (charging only its prompt, whatever the policy) and mark its
    prompt prefilled with its first token sampled."""
    policy, pool.policy = pool.policy, VllmPolicy(watermark=0.0)
    ctx = pool.begin_pass([], frees_coming=False)
    a = pool.try_admit(ctx, r, limit)
    pool.policy = policy
    assert a.decision is Decision.ADMIT and r.computed == r.prompt_len
    r.generated, r.phase = 1, Phase.RUNNING
    return r


# -- vLLM ------------------------------------------------------------------------------------------


def test_vllm_admits_on_the_scheduled_chunk_with_its_watermark():
    """watermark 0.2 of 960 chain bytes = 3 pages of 64 B. A 60-token prompt with a 100-token output
    is charged only the chunk it schedules: 48 tokens = 12 pages, and 12 + 3 = 15 fits; a second
    request's one page would not (16 > 15), and it waits for the first's memory. Exact admission
    charges the whole request (40 pages) and refuses it outright."""
    pool = tiny(VllmPolicy(watermark=0.2))
    ctx = pool.begin_pass([], frees_coming=False)
    a = pool.try_admit(ctx, req(0, 60, 100), 48)
    assert a.decision is Decision.ADMIT and a.chunk_len == 48
    assert pool.try_admit(ctx, req(1, 4, 1), 16).decision is Decision.WAIT

    exact = tiny(ExactPolicy())
    assert exact.try_admit(exact.begin_pass([], frees_coming=False), req(0, 60, 100), 48).decision is Decision.ABORT


def test_vllm_preempts_the_newest_and_it_recomputes():
    """Two 16-token prompts with 40 outputs each, both admitted in step 0 (4 pages each, nothing
    reserved). In step 13 rid 0 grows to 29 tokens (8 pages) and rid 1 would too: 16 > 15 pages,
    so the newest, rid 1, is preempted with 28 tokens computed; the step admits nothing. As the
    engine does, it is readmitted as soon as its recompute chunk fits (step 14: 28 tokens = 7 pages
    beside rid 0's 8) and preempted again the step after (8 + 8 > 15), in steps 13, 15 and 17; from
    step 18 rid 0 holds 9 pages and the 7 no longer fit. rid 0 finishes at 55 tokens in step 39;
    rid 1 comes back in step 40 (its third recompute of 28 tokens: 84 recomputed, 16 + 16 + 84
    prefill tokens in all) and decodes its 27 remaining tokens: the run ends after step 67."""
    pool = tiny(VllmPolicy(watermark=0.0))
    a, b = req(0, 16, 40), req(1, 16, 40)
    sched = Scheduler(pool, max_batched_tokens=64, max_running=8)
    sched.add([a, b])
    while not sched.idle:
        sched.step()
    assert (a.preemptions, b.preemptions) == (0, 3)
    assert sched.stats.recomputed_tokens == 84 and sched.stats.prefill_tokens == 116
    assert a.finished_step == 39 and b.admitted_step == 40 and b.finished_step == 67 and sched.stats.steps == 68
    pool.check_idle()


# -- sglang ----------------------------------------------------------------------------------------


def test_sglang_charges_new_output_in_full_and_running_output_at_the_ratio():
    """Running A: 16 tokens (4 pages), 39 outputs left; at ratio 0.7 it keeps ceil(39 * 0.7) = 28
    tokens reserved: pages(44) - 4 = 7 pages. 11 pages are free: B (8 + 8 = 16 tokens, 4 pages)
    fits exactly (7 + 4 = 11), C (8 + 9 = 17 tokens, 5 pages) does not. After 600 steps the ratio
    has decayed to 0.1: A keeps ceil(3.9) = 4 tokens, pages(20) - 4 = 1 page, and C fits."""
    pool = tiny(SglangPolicy())
    a = running(pool, req(0, 16, 40))
    assert pool.try_admit(pool.begin_pass([a], frees_coming=True), req(1, 8, 8), 64).decision is Decision.ADMIT
    pool.storage.free_rows(np.array([pool.storage.table.active.nonzero()[0][-1]]))  # drop B again
    c = req(2, 8, 9)
    assert pool.try_admit(pool.begin_pass([a], frees_coming=True), c, 64).decision is Decision.WAIT
    for _ in range(600):
        pool.policy.on_step()
    assert pool.policy.ratio == pytest.approx(0.1)
    assert pool.try_admit(pool.begin_pass([a], frees_coming=True), c, 64).decision is Decision.ADMIT


def test_sglang_retracts_the_fewest_outputs_first_and_reestimates():
    """Victims: the fewest generated tokens first, the longest prompt among equals. After a
    retraction the ratio is (decoded + 20 per running request) / their max_new, at least 0.7:
    (30 + 90 + 40) / 200 = 0.8."""
    p = SglangPolicy()
    x, y, z = req(0, 10, 100), req(1, 30, 100), req(2, 20, 100)
    x.generated, y.generated, z.generated = 5, 5, 90
    assert [r.rid for r in p.victim_order([x, y, z])] == [1, 0, 2]
    x.generated = 30
    p.on_retract([y], [x, z])
    assert p.ratio == pytest.approx(0.8)


def test_decaying_ratio_stays_within_its_bounds():
    p = DecayingRatioPolicy(init=0.5, floor=0.2, decay_steps=3)
    seen = []
    for _ in range(5):
        p.on_step()
        seen.append(round(p.ratio, 6))
    assert seen == [0.4, 0.3, 0.2, 0.2, 0.2]
    r = req(0, 4, 10)
    assert p.admit_output(r) == 2 and p.reserve_output(r) == 2  # ceil(10 * 0.2)


def test_online_estimate_learns_the_output_share():
    """Before `warmup` finishes the prior share applies; after, the 90th percentile of the shares
    finished requests generated."""
    p = OnlineEstimatePolicy(prior=0.5, warmup=4)
    r = req(0, 4, 100)
    assert p.admit_output(r) == 50
    for out in (10, 20, 30, 40):
        p.on_finish(req(1, 4, 100, output=out))
    assert p.share == pytest.approx(0.4) and p.admit_output(r) == 40
    p.on_retract([r], [])
    assert p.admit_output(r) == 100


# -- ideal -----------------------------------------------------------------------------------------


def test_peak_pages_by_hand():
    """Lengths 10 and 20, 5 and 1 tokens to go. One-token pages: at k=1 both hold 11 + 21 = 32; at
    k=5 only the first, 15. Four-token pages: ceil(11/4) + ceil(21/4) = 3 + 6 = 9 at k=1."""
    assert peak_pages(np.array([10, 20]), np.array([5, 1]), 1) == 32
    assert peak_pages(np.array([10, 20]), np.array([5, 1]), 4) == 9
    assert peak_pages(np.array([10, 20]), np.array([0, 0]), 4) == 8  # nothing grows: what they hold now
    assert peak_pages(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4) == 0


def test_ideal_admits_what_exact_reservation_refuses():
    """Running A: 16 tokens, 4 outputs left. New B: 16-token prompt, 40-token output. Exact
    reservation charges A 1 page and B 14: 4 held + 15 > 15 pages. The ideal projection knows A
    ends first: at k=4 both hold 20 tokens (10 pages), at k=40 B alone holds 56 (14 pages); the
    peak 14 less the 4 held leaves B 10 of the 11 free pages: admitted."""
    exact = tiny(ExactPolicy())
    a = running(exact, req(0, 16, 5))
    assert exact.try_admit(exact.begin_pass([a], frees_coming=True), req(1, 16, 40), 64).decision is Decision.WAIT
    ideal = tiny(IdealPolicy())
    a = running(ideal, req(0, 16, 5))
    assert ideal.try_admit(ideal.begin_pass([a], frees_coming=True), req(1, 16, 40), 64).decision is Decision.ADMIT


def test_optimistic_projects_the_chunk_it_schedules_not_the_whole_prompt():
    """Running A: 16 tokens held (4 pages), 4 outputs left, reserved at the ratio 0.7: 3. New B: a
    40-token prompt, 40 outputs charged 28, its first chunk 16 tokens. Charged at the chunk: A and
    B hold 16 each; at k=3 they hold 19 each (5 + 5 pages), at k=28 B alone 44 (11 pages): the peak
    11 less A's 4 held is 7 of the 11 free pages, admitted. Charged at the whole prompt, B holds 40:
    at k=3 5 + 11 = 16 pages, at k=28 68 tokens = 17; 17 - 4 = 13 > 11, and B waits."""
    chunked = tiny(DecayingRatioPolicy(chunk_only=True, projected=True))
    a = running(chunked, req(0, 16, 5))
    ctx = chunked.begin_pass([a], frees_coming=True)
    got = chunked.try_admit(ctx, req(1, 40, 40), 16)
    assert got.decision is Decision.ADMIT and got.chunk_len == 16
    whole = tiny(DecayingRatioPolicy(chunk_only=False, projected=True))
    a = running(whole, req(0, 16, 5))
    assert whole.try_admit(whole.begin_pass([a], frees_coming=True), req(1, 40, 40), 16).decision is Decision.WAIT


def test_optimistic_admits_one_prompt_in_part_at_a_time():
    """Two 40-token prompts with 4 outputs (3 charged), 16-token chunks. The first is admitted on
    its chunk (16 tokens; 19 at its peak: 5 pages) and takes 4 pages. The second would take the
    partial slot the first used: charged its whole prompt, 16 + 40 tokens grow to 19 + 43 (5 + 11
    pages), 16 less the 4 held is 12 of the 11 free pages, and it waits. A prompt that fits its
    chunk whole (8 tokens) leaves the slot to the next."""
    pool = tiny(DecayingRatioPolicy(chunk_only=True, projected=True))
    ctx = pool.begin_pass([], frees_coming=False)
    first = pool.try_admit(ctx, req(0, 40, 4), 16)
    assert first.decision is Decision.ADMIT and first.chunk_len == 16
    assert pool.try_admit(ctx, req(1, 40, 4), 16).decision is Decision.WAIT

    pool = tiny(DecayingRatioPolicy(chunk_only=True, projected=True))
    ctx = pool.begin_pass([], frees_coming=False)
    assert pool.try_admit(ctx, req(0, 8, 4), 16).decision is Decision.ADMIT
    second = pool.try_admit(ctx, req(1, 40, 4), 16)
    assert second.decision is Decision.ADMIT and second.chunk_len == 16


def test_ideal_uses_real_output_lengths():
    r = req(0, 10, 100, output=7)
    r.generated = 3
    assert IdealPolicy().admit_output(r) == 4 and ExactPolicy().admit_output(r) == 97


# -- the victim loop -------------------------------------------------------------------------------


def _three_running(pool):
    return [running(pool, req(i, 16, 40)) for i in range(3)]  # 4 pages each: 12 held, 3 free


def test_retraction_stops_at_the_first_set_that_makes_room():
    """A grows a 16-token chunk (4 pages), B and C one token (1 page each): 6 pages, 3 free. Retracting
    C (the first candidate) frees its 4 pages and drops its own page: 5 <= 7, so the walk stops at
    [C] without asking about B."""
    pool = tiny(DecayingRatioPolicy())
    a, b, c = _three_running(pool)
    plan = [(a, 32), (b, 17), (c, 17)]
    assert pool.retract_victims(plan, [c, b, a]) == [c]
    assert pool.storage.table.active.sum() == 3  # asking frees nothing


def test_retraction_refuses_when_no_set_makes_room():
    """A grows to 60 tokens (11 more pages) and B one token: 12 pages. The only candidate, B, frees 4
    and its own page: 11 needed against 3 + 4 free. No victim set makes room: none is retracted."""
    pool = tiny(DecayingRatioPolicy())
    a, b, _c = _three_running(pool)
    assert pool.retract_victims([(a, 60), (b, 17)], [b]) is None
    assert pool.storage.table.active.sum() == 3


# -- priorities ------------------------------------------------------------------------------------


def _priority_run(priorities, high_new=4):
    """Three 16-token requests with 4 outputs each (5 pages under exact reservation: the whole pool
    once they decode), then a newcomer of priority 0 (the most important) at step 1."""
    pool = tiny(ExactPolicy())
    low = [req(i, 16, 4, priority=p) for i, p in enumerate(priorities)]
    high = req(3, 16, high_new, arrival=1, priority=0)
    sched = Scheduler(pool, max_batched_tokens=64, max_running=8, priority=True)
    sched.add([*low, high])
    sched.step()
    sched.step()
    return sched, low, high


def test_priority_preempts_the_least_important_newest_just_enough():
    """In step 1 the three hold 17 tokens (5 pages) each and keep nothing more reserved; the
    newcomer needs pages(20) = 5. All three are less important (priority 5): the newest, rid 2,
    frees its 5 pages, which is enough, so it alone is preempted and the newcomer runs in step 1."""
    sched, low, high = _priority_run([5, 5, 5])
    assert [r.preemptions for r in low] == [0, 0, 1]
    assert high.admitted_step == 1 and sched.stats.priority_preemptions == 1
    assert low[2].phase is Phase.WAITING and low[2].computed == 0


def test_priority_never_preempts_when_no_victim_set_makes_room():
    """The newcomer needs pages(16 + 24) = 10 pages; only rid 2 is less important, and its 5 pages
    are not enough: no victim set makes room, nothing is preempted, and the newcomer waits."""
    sched, low, high = _priority_run([0, 0, 5], high_new=24)
    assert sched.stats.preemptions == 0 and high.admitted_step == -1
    while not sched.idle:
        sched.step()
    assert high.phase is Phase.FINISHED and all(r.preemptions == 0 for r in low)


# -- modes -----------------------------------------------------------------------------------------


def test_admission_modes():
    assert isinstance(admission_policy("exact"), ExactPolicy)
    optimistic = admission_policy("optimistic")
    assert isinstance(optimistic, DecayingRatioPolicy) and optimistic.chunk_only and optimistic.projected
    assert isinstance(admission_policy("optimistic-online"), OnlineEstimatePolicy)
    from kvchain.errors import InputError
    with pytest.raises(InputError, match="nope"):
        admission_policy("nope")
