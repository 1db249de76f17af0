"""`request_demand`: one demand model read from DEMAND_RULES (ADM-14..16)."""

from __future__ import annotations

import pytest

from kvchain.alloc.demand import (
    DEMAND_RULES,
    DemandPurpose,
    FullCharge,
    StateCharge,
    WindowCharge,
    WindowRetirement,
    request_demand,
    span_pages,
)
from kvchain.decl import MHA, State, StateTensor
from kvchain.errors import InputError
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage

SSM = State((StateTensor("ssm", (4, 4), "float32"),))


def _plan(checkpoint=None, page_size=16):
    """Full attention with the state on its layer, then a 64-token window."""
    return plan_kv_storage(small_hybrid(MHA(1, 8), (64,), state=SSM, checkpoint_interval=checkpoint),
                           page_size=page_size)


def test_rules_are_a_table():
    assert set(DEMAND_RULES) == set(DemandPurpose)
    assert DEMAND_RULES[DemandPurpose.ADMIT].window is WindowCharge.PASS
    assert DEMAND_RULES[DemandPurpose.LOAD_BACK].full is FullCharge.CACHED
    assert DEMAND_RULES[DemandPurpose.LOAD_BACK].state is StateCharge.CHECKPOINT


def test_span_pages():
    assert span_pages(0, 16) == 0
    assert span_pages(1, 16) == 1
    assert span_pages(16, 16) == 2  # 16 tokens misaligned span two pages
    assert span_pages(17, 16) == 2
    assert span_pages(18, 16) == 3


def test_admit_charges_lifetime_tokens_window_pass_and_state_in_full():
    """ADM-1, ADM-2, ADM-3."""
    plan = _plan()
    names = [p.name for p in plan.sub_pools]
    d = request_demand(plan, DemandPurpose.ADMIT, input_len=1000, output_len=200)
    pages = dict(zip(names, d.pages))
    assert pages["full"] == -(-1200 // 16) == d.virtual_pages  # input + expected output
    assert pages["window64"] == span_pages(64 + 1000, 16)  # retained window + this pass's tail
    assert pages["state"] == 1 == d.state_slots
    chunked = dict(zip(names, request_demand(plan, DemandPurpose.ADMIT, input_len=1000, output_len=200,
                                             chunk_len=128).pages))
    assert chunked["window64"] == span_pages(64 + 128, 16)


def test_ceiling_window_peak_follows_retirement():
    """ADM-15: with eager retirement the window peaks at window + 1 tokens; without retirement it
    holds every row like full attention."""
    plan = _plan()
    eager = request_demand(plan, DemandPurpose.CEILING, input_len=1000, output_len=200)
    never = request_demand(plan, DemandPurpose.CEILING, input_len=1000, output_len=200,
                           window_retirement=WindowRetirement.NEVER)
    assert eager.pages[1] == span_pages(65, 16)
    assert never.pages[1] == never.pages[2] == 75


def test_checkpoint_retention_floor_widens_the_window():
    """WIN-13: with prefix sharing and checkpoints every 256 tokens, the window behind the latest
    checkpoint is retained: up to window + interval rows."""
    plan = _plan(checkpoint=256)
    shared = request_demand(plan, DemandPurpose.CEILING, input_len=4000, output_len=100,
                            checkpoint_interval=256, shares_prefixes=True)
    alone = request_demand(plan, DemandPurpose.CEILING, input_len=4000, output_len=100, checkpoint_interval=256)
    assert shared.pages[1] == span_pages(64 + 256 + 1, 16) > alone.pages[1]
    assert shared.state_slots == 2  # a running slot and a tracking slot


def test_cached_prefix_and_load_back():
    plan = _plan()
    d = request_demand(plan, DemandPurpose.ADMIT, input_len=1000, output_len=0, cached_len=512)
    assert d.pages[2] == -(-1000 // 16) - 512 // 16
    load = request_demand(plan, DemandPurpose.LOAD_BACK, input_len=512, cached_len=512)
    assert load.pages[2] == 32 and load.pages[1] == span_pages(64, 16) and load.state_slots == 1


def test_bad_lengths():
    with pytest.raises(InputError):
        request_demand(_plan(), DemandPurpose.ADMIT, input_len=10, cached_len=20)
