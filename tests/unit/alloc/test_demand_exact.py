"""`request_demand` to the page: each purpose's row of DEMAND_RULES, worked out by hand on one plan
(state, a 64-token window, full attention; 16-token pages), so every charge is an exact number."""

from __future__ import annotations

import pytest

from kvchain.alloc.demand import (
    DemandPurpose,
    KVDemand,
    WindowRetirement,
    request_demand,
    retained_window,
    span_pages,
)
from kvchain.decl import MHA, State, StateTensor
from kvchain.errors import InputError
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage

SSM = State((StateTensor("ssm", (4, 4), "float32"),))
STATE, WINDOW, FULL = 0, 1, 2  # chain order of the plan below


def _plan(checkpoint=None):
    plan = plan_kv_storage(small_hybrid(MHA(1, 8), (64,), state=SSM, checkpoint_interval=checkpoint),
                           page_size=16)
    assert [p.name for p in plan.sub_pools] == ["state", "window64", "full"]
    return plan


def test_kvdemand_adds_band_by_band():
    a = KVDemand((1, 2, 3), 4, 5)
    b = KVDemand((10, 20, 30), 40, 50)
    assert a + b == KVDemand((11, 22, 33), 44, 55)
    assert KVDemand.zero(3) == KVDemand((0, 0, 0), 0, 0)


def test_span_pages_counts_a_misaligned_run():
    """A run of n tokens starting at the last slot of a page spans 1 + ceil((n - 1) / ps) pages."""
    assert [span_pages(n, 4) for n in (-3, 0, 1, 2, 4, 5, 6, 9, 10)] == [0, 0, 1, 2, 2, 2, 3, 3, 4]


def test_retained_window_adds_an_interval_only_when_sharing_with_checkpoints():
    """WIN-11: the window behind the latest checkpoint is kept only when prefixes are shared."""
    assert retained_window(64, 256, True) == 320
    assert retained_window(64, 256, False) == 64
    assert retained_window(64, None, True) == 64
    assert retained_window(64, 0, True) == 64


def test_admit_with_a_cached_prefix_charges_beyond_it():
    """ADM-1, ADM-2, ADM-3: 1000 input + 200 output with 512 cached: full = ceil(1200/16) - 512/16
    = 75 - 32 = 43; this pass writes the 488 uncached tokens, so the window is charged
    span(64 + 488 = 552) = 1 + ceil(551/16) = 36; one state slot."""
    d = request_demand(_plan(), DemandPurpose.ADMIT, input_len=1000, output_len=200, cached_len=512)
    assert d == KVDemand((1, 36, 43), 43, 1)


def test_admit_with_an_unaligned_cached_prefix_rounds_the_prefix_up():
    """ADM-1: 500 cached tokens hold ceil(500/16) = 32 pages, so 75 - 32 = 43 are charged; a 40-token
    chunk charges the window span(64 + 40) = 1 + ceil(103/16) = 8."""
    d = request_demand(_plan(), DemandPurpose.ADMIT, input_len=1000, output_len=200, cached_len=500,
                       chunk_len=40)
    assert d == KVDemand((1, 8, 43), 43, 1)


def test_window_charge_never_exceeds_full_attention():
    """ADM-2: a 10-token request holds one page; the window is charged min(1, span(74) = 6) = 1."""
    d = request_demand(_plan(), DemandPurpose.ADMIT, input_len=10)
    assert d == KVDemand((1, 1, 1), 1, 1)


def test_a_one_token_pass_still_charges_the_token_it_writes():
    """ADM-2: a pass of 0 or 1 token is charged the retained window plus one token: span(65) = 5."""
    plan = _plan()
    for chunk in (0, 1):
        d = request_demand(plan, DemandPurpose.ADMIT, input_len=1000, chunk_len=chunk)
        assert d == KVDemand((1, 5, 63), 63, 1)
    assert request_demand(plan, DemandPurpose.ADMIT, input_len=1000, chunk_len=2).pages == (1, 6, 63)


def test_a_plan_without_state_charges_no_slot():
    """ADM-3 where there is no state: no slot is charged."""
    plan = plan_kv_storage(small_hybrid(MHA(1, 8), (64,)), page_size=16)
    assert [p.name for p in plan.sub_pools] == ["window64", "full"]
    assert request_demand(plan, DemandPurpose.ADMIT, input_len=100) == KVDemand((7, 7), 7, 0)


def test_an_empty_request_is_charged_its_state_slot_only():
    d = request_demand(_plan(), DemandPurpose.ADMIT, input_len=0)
    assert d == KVDemand((1, 0, 0), 0, 1)


def test_ceiling_peak_counts_the_smallest_chunk_tail():
    """ADM-15: under eager retirement the window peaks at window + the smallest chunk:
    min_chunk 1 -> span(65) = 5, 0 (clamped to 1) -> 5, 2 -> span(66) = 6, 32 -> span(96) = 7."""
    plan = _plan()
    peak = {m: request_demand(plan, DemandPurpose.CEILING, input_len=1000, output_len=200, min_chunk=m).pages
            for m in (0, 1, 2, 32)}
    assert peak == {0: (1, 5, 75), 1: (1, 5, 75), 2: (1, 6, 75), 32: (1, 7, 75)}
    assert request_demand(plan, DemandPurpose.CEILING, input_len=1000, output_len=200).pages == (1, 5, 75)


def test_ceiling_without_retirement_charges_the_window_every_row():
    """ADM-15: rows that are never retired stay: the window holds what full attention holds."""
    d = request_demand(_plan(), DemandPurpose.DECODE_PREALLOC, input_len=1000, output_len=200, cached_len=160,
                       window_retirement=WindowRetirement.NEVER)
    assert d == KVDemand((1, 65, 65), 65, 1)


def test_shared_prefixes_with_checkpoints_widen_the_ceiling_and_take_a_tracking_slot():
    """ADM-15, WIN-11: retained = 64 + 256, peak span(321) = 1 + ceil(320/16) = 21; the state takes
    a running and a tracking slot. Without sharing the peak is span(65) = 5."""
    plan = _plan(checkpoint=256)
    shared = request_demand(plan, DemandPurpose.CEILING, input_len=4000, output_len=100,
                            checkpoint_interval=256, shares_prefixes=True)
    assert shared == KVDemand((2, 21, 257), 257, 2)
    alone = request_demand(plan, DemandPurpose.CEILING, input_len=4000, output_len=100, checkpoint_interval=256)
    assert alone == KVDemand((2, 5, 257), 257, 2)


def test_the_pools_tracking_slot_overrides_what_the_plan_declares():
    """ADM-3: `tracking_slot` says whether the pool takes a tracking slot per request: True charges
    a running and a tracking slot on a plan without a checkpoint interval, False one running slot
    on a plan with one. A 100-token admission charges 7 full pages, window min(7, span(164)) = 7."""
    tracked = request_demand(_plan(), DemandPurpose.ADMIT, input_len=100, tracking_slot=True)
    assert tracked == KVDemand((2, 7, 7), 7, 2)
    untracked = request_demand(_plan(checkpoint=256), DemandPurpose.ADMIT, input_len=100, tracking_slot=False)
    assert untracked == KVDemand((1, 7, 7), 7, 1)
    load = request_demand(_plan(), DemandPurpose.LOAD_BACK, input_len=100, cached_len=64, tracking_slot=True)
    assert load.state_slots == 1  # a load-back charges one checkpoint slot whatever the pool tracks


def test_load_back_charges_the_cached_prefix_and_one_checkpoint_slot():
    """ADM-14: a load-back of a 512-token prefix charges its 32 pages, the window behind its end
    (span(min(64, 512)) = span(64) = 5) and one checkpoint slot, even when the state tracks two."""
    d = request_demand(_plan(checkpoint=256), DemandPurpose.LOAD_BACK, input_len=600, output_len=50,
                       cached_len=512)
    assert d == KVDemand((1, 5, 32), 32, 1)
    short = request_demand(_plan(), DemandPurpose.LOAD_BACK, input_len=40, cached_len=40)
    assert short == KVDemand((1, 3, 3), 3, 1)  # 40 tokens: 3 pages, the window spans no more


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(input_len=-1), "0 <= cached (0) <= input (-1), output 0 >= 0"),
        (dict(input_len=10, output_len=-1), "0 <= cached (0) <= input (10), output -1 >= 0"),
        (dict(input_len=10, cached_len=-1), "0 <= cached (-1) <= input (10), output 0 >= 0"),
        (dict(input_len=10, cached_len=11), "0 <= cached (11) <= input (10), output 0 >= 0"),
    ],
)
def test_bad_lengths_are_refused_with_their_numbers(kwargs, message):
    with pytest.raises(InputError) as err:
        request_demand(_plan(), DemandPurpose.ADMIT, **kwargs)
    assert str(err.value) == f"request lengths must satisfy {message}"


def test_a_prefix_as_long_as_the_input_is_allowed():
    d = request_demand(_plan(), DemandPurpose.ADMIT, input_len=32, output_len=16, cached_len=32)
    assert d == KVDemand((1, 1, 1), 1, 1)
