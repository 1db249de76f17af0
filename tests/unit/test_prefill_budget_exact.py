"""`ChainPrefillBudget` and `ProjectedPrefillBudget` to the page: what each pass asks the allocator,
worked out by hand on one plan (state, a 64-token window, full attention; 16-token pages).

The allocator is a recorder that answers by a rule the test sets, so each test sees exactly which
joint demand the pass priced (admitted + reserve + this request) and what it decided from the
answers: the arithmetic of admission, apart from the layout search (tested in alloc/)."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.demand import KVDemand
from kvchain.decl import MHA, State, StateTensor
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage
from kvchain.prefill_budget import (
    Admission,
    ChainPrefillBudget,
    Decision,
    ProjectedPrefillBudget,
    mamba_prefill_chunk_grid,
    peak_pages,
)

SSM = State((StateTensor("ssm", (4, 4), "float32"),))
ZERO = KVDemand.zero(3)
WINDOW = 1  # chain order: state, window64, full


class Recorder:
    """An allocator that records every joint demand it is asked about and answers `rule(demand)`."""

    def __init__(self, rule=lambda d: True):
        self.rule = rule
        self.asked: list[tuple[KVDemand, tuple[int, ...] | None]] = []

    def admits(self, demand, reclaimable=None):
        self.asked.append((demand, reclaimable))
        return self.rule(demand)


class Storage:
    def __init__(self, rule=lambda d: True):
        self.plan = plan_kv_storage(small_hybrid(MHA(1, 8), (64,), state=SSM), page_size=16)
        assert [p.name for p in self.plan.sub_pools] == ["state", "window64", "full"]
        assert self.plan.owner.index == 2
        self.allocator = Recorder(rule)


def _budget(rule=lambda d: True, reserve=ZERO, frees_coming=False, **kw):
    storage = Storage(rule)
    return ChainPrefillBudget(storage, reserve, frees_coming, **kw), storage.allocator


def test_chunk_grid_cuts_on_the_checkpoint_grid():
    """WIN-16: every chunk but a prompt's last ends on the grid; WIN-15: a limit short of the next
    grid point cuts nothing."""
    assert mamba_prefill_chunk_grid(0, 100, 50, 16) == 50  # the rest fits: the prompt's last chunk
    assert mamba_prefill_chunk_grid(0, 50, 50, 16) == 50  # exactly the rest
    assert mamba_prefill_chunk_grid(0, 49, 50, 16) == 48
    assert mamba_prefill_chunk_grid(10, 40, 100, 16) == 38  # 10 + 40 = 50 -> grid point 48
    assert mamba_prefill_chunk_grid(16, 15, 100, 16) == 0
    assert mamba_prefill_chunk_grid(20, 5, 100, 16) == 0  # grid point 16 lies behind the start
    assert mamba_prefill_chunk_grid(0, 40, 100, None) == 40
    assert mamba_prefill_chunk_grid(0, 40, 100, 0) == 40


def test_a_pass_asks_for_what_it_admitted_plus_the_reserve_plus_the_request():
    """ADM-1, ADM-2, ADM-3, ADM-6: 1000 input + 200 output with 512 cached is charged full
    75 - 32 = 43 pages, window span(64 + 488) = 36, one state slot; the ask adds the reserve and
    credits the reclaimable pages. A second request (100 tokens, a 64-token chunk: full 7, window
    min(7, span(128) = 9) = 7) is asked on top of the first."""
    reserve = KVDemand((1, 4, 10), 10, 1)
    budget, alloc = _budget(reserve=reserve, reclaimable=(0, 2, 5))
    first = budget.consider(1000, 200, 512, 10_000)
    assert first == Admission(Decision.ADMIT, 488, KVDemand((1, 36, 43), 43, 1))
    assert alloc.asked == [(KVDemand((2, 40, 53), 53, 2), (0, 2, 5))]
    second = budget.consider(100, 0, 0, 64)
    assert second == Admission(Decision.ADMIT, 64, KVDemand((1, 7, 7), 7, 1))
    assert alloc.asked[1] == (KVDemand((3, 47, 60), 60, 3), (0, 2, 5))
    assert budget.admitted == KVDemand((2, 43, 50), 50, 2) and budget.admitted_count == 2


def test_took_stops_counting_what_the_pool_took_and_withdraw_undoes_an_admission():
    """What the pool took of a request's demand is live: the pass stops counting it, never more
    than the request was charged. `withdraw` removes a decided ADMIT entirely."""
    budget, _ = _budget()
    a1 = budget.consider(1000, 200, 512, 10_000)  # (1, 36, 43), 43, 1
    a2 = budget.consider(100, 0, 0, 64)  # (1, 7, 7), 7, 1
    budget.took(a1, KVDemand((1, 31, 31), 31, 1))
    assert budget.admitted == KVDemand((1, 12, 19), 19, 1)
    budget.took(a2, KVDemand((5, 100, 100), 100, 5))  # more than charged: only the charge goes
    assert budget.admitted == KVDemand((0, 5, 12), 12, 0)
    budget.took(Admission(Decision.WAIT), KVDemand((1, 1, 1), 1, 1))
    assert budget.admitted == KVDemand((0, 5, 12), 12, 0)
    budget.withdraw(a2)
    assert budget.admitted == KVDemand((-1, -2, 5), 5, -1) and budget.admitted_count == 1


def test_withdraw_returns_the_pass_to_where_it_was():
    budget, _ = _budget()
    a1 = budget.consider(1000, 200, 512, 10_000)
    a2 = budget.consider(100, 0, 0, 64)
    budget.withdraw(a2)
    assert budget.admitted == a1.demand and budget.admitted_count == 1
    budget.withdraw(a1)
    assert budget.admitted == ZERO and budget.admitted_count == 0


def test_a_shared_prefix_window_is_charged_behind_the_latest_checkpoint():
    """ADM-2, WIN-11: with prefixes shared and checkpoints every 16 tokens, the window retains
    64 + 16 rows, so a 64-token chunk charges span(80 + 64) = 1 + ceil(143/16) = 10 pages;
    without sharing span(64 + 64) = 9."""
    shared, _ = _budget(checkpoint_interval=16, shares_prefixes=True)
    assert shared.consider(1000, 0, 0, 64) == Admission(Decision.ADMIT, 64, KVDemand((1, 10, 63), 63, 1))
    alone, _ = _budget(checkpoint_interval=16)
    assert alone.consider(1000, 0, 0, 64) == Admission(Decision.ADMIT, 64, KVDemand((1, 9, 63), 63, 1))


def test_a_one_token_limit_admits_one_token():
    """Without a checkpoint grid any positive limit cuts a chunk: one token, window span(65) = 5."""
    budget, _ = _budget()
    assert budget.consider(100, 0, 0, 1) == Admission(Decision.ADMIT, 1, KVDemand((1, 5, 7), 7, 1))


def test_a_one_token_request_is_admitted():
    """The shortest request there is: one input token, one full page, window min(1, span(65) = 5)."""
    budget, alloc = _budget()
    assert budget.consider(1, 0, 0, 64) == Admission(Decision.ADMIT, 1, KVDemand((1, 1, 1), 1, 1))
    assert alloc.asked == [(KVDemand((1, 1, 1), 1, 1), None)]


def test_the_pass_charges_the_tracking_slot_it_is_told_the_pool_takes():
    """ADM-3: the plan declares no checkpoint interval (one slot), but the pool takes a tracking slot
    per request: a 100-token request's 64-token chunk is charged a running and a tracking slot,
    full 7 pages, window min(7, span(128) = 9) = 7."""
    budget, alloc = _budget(tracking_slot=True)
    assert budget.consider(100, 0, 0, 64) == Admission(Decision.ADMIT, 64, KVDemand((2, 7, 7), 7, 2))
    assert alloc.asked == [(KVDemand((2, 7, 7), 7, 2), None)]


def test_a_limit_short_of_the_grid_waits_without_asking():
    """WIN-15: the token budget left does not reach the next checkpoint: wait, price nothing."""
    budget, alloc = _budget(checkpoint_interval=16)
    a = budget.consider(100, 0, 16, 15)
    assert a == Admission(Decision.WAIT, reason="the token budget left does not reach the next checkpoint")
    assert alloc.asked == []


def test_a_request_waits_while_memory_is_coming_back():
    """ADM-9: no fit, but a forward in flight (or a request admitted earlier in the pass) will give
    memory back: wait, without searching smaller chunks."""
    budget, alloc = _budget(rule=lambda d: False, frees_coming=True)
    wait = Admission(Decision.WAIT, reason="memory is coming back from running work")
    assert budget.consider(1000, 0, 0, 256) == wait
    assert len(alloc.asked) == 1
    fits_once = iter([True, False])
    budget, alloc = _budget(rule=lambda d: next(fits_once))
    assert budget.consider(100, 0, 0, 64).decision is Decision.ADMIT
    assert budget.consider(1000, 0, 0, 256) == wait
    assert len(alloc.asked) == 2


def test_nothing_coming_back_takes_the_largest_chunk_that_fits():
    """ADM-10: the window may hold 8 pages. 1000 tokens in 256-token chunks charge span(64 + 256)
    = 21 window pages; span(64 + c) <= 8 holds up to c = 49 (span(113) = 8, span(114) = 9), so the
    pass asks for every chunk from 256 down to 49 and admits 49 (full: ceil(1000/16) = 63)."""
    budget, alloc = _budget(rule=lambda d: d.pages[WINDOW] <= 8)
    a = budget.consider(1000, 0, 0, 256)
    assert a == Admission(Decision.ADMIT, 49, KVDemand((1, 8, 63), 63, 1), chunk_cap=49)
    assert [d.pages[WINDOW] for d, _ in alloc.asked[:2]] == [21, 21]
    assert len(alloc.asked) == 256 - 49 + 1
    assert budget.admitted == a.demand and budget.admitted_count == 1


def test_the_smaller_chunks_stay_on_the_checkpoint_grid():
    """ADM-10, WIN-16: with checkpoints every 16 tokens the smaller chunks are 240, 224, ..., 48
    (span(64 + 48) = 8 fits): 14 asks, the chunk admitted is 48."""
    budget, alloc = _budget(rule=lambda d: d.pages[WINDOW] <= 8, checkpoint_interval=16)
    a = budget.consider(1000, 0, 0, 256)
    assert a.decision is Decision.ADMIT and a.chunk_len == 48
    assert len(alloc.asked) == (256 - 48) // 16 + 1


def test_no_chunk_that_fits_aborts_with_the_requests_numbers():
    """ADM-11: nothing fits and nothing will free memory: abort, naming the demand per band."""
    budget, alloc = _budget(rule=lambda d: False, checkpoint_interval=16)
    a = budget.consider(1000, 0, 0, 20)  # a 16-token chunk; under 16 none is cut
    assert a.decision is Decision.ABORT and a.chunk_len == 0 and a.demand is None
    assert a.reason == ("unschedulable: 1000 input + 0 output tokens (0 cached) need state 1, window64 6, "
                        "full 63 pages and no chunk of it fits while nothing else will free memory")
    assert len(alloc.asked) == 1
    assert budget.admitted == ZERO and budget.admitted_count == 0


def test_chunk_only_charges_the_scheduled_chunk():
    """Allocate-on-demand admission: a 64-token first chunk of a 1000 + 200 request is charged as a
    64-token request: full 4, window min(4, span(128)), one slot. A 4-token chunk inside the cached
    prefix's last page charges no page at all; the abort lists the bands it needs only."""
    budget, alloc = _budget(chunk_only=True)
    assert budget.consider(1000, 200, 0, 64) == Admission(Decision.ADMIT, 64, KVDemand((1, 4, 4), 4, 1))
    budget, alloc = _budget(rule=lambda d: False, chunk_only=True)
    a = budget.consider(12, 5, 8, 4)
    assert a.reason.startswith("unschedulable: 12 input + 5 output tokens (8 cached) need state 1 pages ")
    assert [d.pages for d, _ in alloc.asked] == [(1, 0, 0)] * 4  # chunks 4, 3, 2, 1


def test_peak_pages_by_hand():
    """Two requests on 4-token pages: 3 tokens with 2 to go, 8 with 6 to go. After 2 steps they hold
    5 and 10 tokens: 2 + 3 = 5 pages; after 6 only the second is left, 14 tokens = 4 pages."""
    assert peak_pages(np.array([3, 8]), np.array([2, 6]), 4) == 5
    assert peak_pages(np.array([4, 8]), np.array([0, 0]), 4) == 3  # nothing grows: 1 + 2 pages
    assert peak_pages(np.array([1]), np.array([7]), 4) == 2
    assert peak_pages(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4) == 0


def _projected(rule=lambda d: True, **kw):
    storage = Storage(rule)
    return ProjectedPrefillBudget(storage, kw.pop("reserve", ZERO), False, **kw), storage.allocator


def test_projected_admission_charges_full_attention_at_its_peak():
    """One running request holds 100 tokens (7 pages) with 50 to go. A 200 + 30 request: peak at
    step 30, ceil(130/16) + ceil(230/16) = 9 + 15 = 24 pages, 17 beyond what is held; windows and
    state as charged alone (13, 1) plus the reserve. Then a 64 + 100 request with 20 cached (chunk
    44): peak at step 30, 9 + 15 + ceil(94/16) = 30, minus 20 held and its 2 cached pages = 8."""
    budget, alloc = _projected(reserve=KVDemand((1, 5, 9), 9, 1), lengths=[100], remaining=[50], held=7,
                               reclaimable=(0, 1, 2))
    a1 = budget.consider(200, 30, 0, 1000)
    assert a1 == Admission(Decision.ADMIT, 200, KVDemand((1, 13, 13), 13, 1))
    assert alloc.asked == [(KVDemand((2, 18, 17), 17, 2), (0, 1, 2))]
    assert (budget.lengths, budget.remaining, budget.held, budget.partial_slots) == ([100, 200], [50, 30], 20, 1)
    a2 = budget.consider(64, 100, 20, 1000)
    assert a2 == Admission(Decision.ADMIT, 44, KVDemand((1, 2, 2), 2, 1))
    assert alloc.asked[1] == (KVDemand((3, 20, 8), 8, 3), (0, 1, 2))
    assert budget.held == 24  # ceil((20 + 44) / 16) = 4 more
    budget.withdraw(a2)
    assert (budget.lengths, budget.remaining, budget.held, budget.partial_slots) == ([100, 200], [50, 30], 20, 1)
    assert budget.admitted == a1.demand and budget.admitted_count == 1


def test_projected_full_charge_is_never_negative():
    """Pages held beyond the projected peak are not credited to the request."""
    budget, alloc = _projected(lengths=[16], remaining=[0], held=50)
    budget.consider(17, 0, 0, 100)  # full 2, window min(2, span(81)); peak 1 + 2 = 3 < 50 held
    assert alloc.asked[0][0] == KVDemand((1, 2, 0), 0, 1)
    assert budget.held == 52  # the 17 tokens it takes hold ceil(17/16) = 2 pages


def test_projected_abort_names_the_requests_output():
    """ADM-11 under projection: the abort names the request's own numbers, its output included."""
    budget, _ = _projected(rule=lambda d: False)
    a = budget.consider(100, 30, 0, 100)
    assert a.decision is Decision.ABORT
    assert a.reason.startswith("unschedulable: 100 input + 30 output tokens (0 cached) need state 1, ")


def test_one_partial_prompt_at_a_time_under_chunk_only():
    """With `chunk_only` one request per pass is charged only the chunk it schedules (64 tokens of
    1000: peak ceil(74/16) = 5); the next is charged its whole prompt (500: with the first,
    5 + ceil(510/16) = 37 at step 10, minus the 4 pages held = 33). Withdrawing the partial one
    gives its slot back."""
    budget, alloc = _projected(chunk_only=True)
    a1 = budget.consider(1000, 10, 0, 64)
    assert a1.decision is Decision.ADMIT and alloc.asked[0][0] == KVDemand((1, 4, 5), 5, 1)
    assert (budget.lengths, budget.held, budget.partial_slots) == ([64], 4, 0)
    a2 = budget.consider(500, 10, 0, 64)
    assert a2.decision is Decision.ADMIT and alloc.asked[1][0] == KVDemand((2, 8, 33), 33, 2)
    assert (budget.lengths, budget.held, budget.partial_slots) == ([64, 500], 8, 0)
    budget.withdraw(a2)
    assert (budget.lengths, budget.held, budget.partial_slots) == ([64], 4, 0)
    budget, _ = _projected(chunk_only=True, partial_slots=2)
    budget.withdraw(budget.consider(1000, 10, 0, 64))
    assert (budget.lengths, budget.remaining, budget.held, budget.partial_slots) == ([], [], 0, 2)
