"""Sizing: one budget, spent in order; the batch-size-1 floor."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchain.decl import MHA, State, StateTensor
from kvchain.errors import BudgetError, InputError
from kvchain.memory.arena import arena_layout
from kvchain.models import model_from_preset
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage
from kvchain.sizing import check_bs1_floor, fixed_allocations, size_plan, window_peak_pages

GiB = 2**30
MHA8 = MHA(8, 64)
SSM = State((StateTensor("conv", (512, 3)), StateTensor("ssm", (8, 64, 16), "float32")))


def _plan(window=True, state=True, page_size=64):
    """Two blocks of a full-attention layer and two 1024-token window layers, with a state layer
    after each attention layer: sub-pools of 2 full, 4 window and 6 state layers."""
    decls = small_hybrid(MHA8, (1024, 1024) if window else (), state=SSM if state else None, state_layers=True,
                         blocks=2)
    return plan_kv_storage(decls, page_size=page_size)


def test_budget_is_spent_fixed_then_state_then_tokens():
    """DECL-10: fixed allocations first, state slots second, then the most full tokens whose
    windows fit; everything lies within the budget."""
    plan = _plan()
    s = size_plan(plan, 8 * GiB, context_len=8192, max_running_requests=64)
    assert s.fixed.total == fixed_allocations(plan, 8192, 64).total
    assert s.fixed.request_table == 65 * 8192 * 4
    assert s.used_bytes <= s.budget_bytes
    full, window, state = s.target("full"), s.target("window1024"), s.target("state")
    # balanced default: state slots serve as many requests as the tokens do at the context length
    assert s.state_slots == s.concurrency or s.limited_by == "max running requests"
    # one more full page (with its window share) would not fit
    chain_left = s.arena_bytes - s.sink_bytes - full.bytes - window.bytes - state.bytes
    per_page = plan.owner.page_bytes
    assert chain_left < per_page + plan.by_name("window1024").page_bytes + 3 * max(p.page_bytes for p in plan.sub_pools)
    # window target: each request of 8192 tokens retains at most a 1024-token window (+1 token)
    assert window.pages <= (full.pages // 128 + 1) * window_peak_pages(1024, 64)


def test_state_slots_explicit_or_as_a_share():
    """DECL-11."""
    plan = _plan()
    explicit = size_plan(plan, 8 * GiB, context_len=8192, state_slots=10)
    assert explicit.state_slots == 10 and explicit.limited_by == "state slots" and explicit.concurrency == 10
    share = size_plan(plan, 8 * GiB, context_len=8192, state_share=0.5)
    assert abs(share.target("state").bytes - 0.5 * (share.arena_bytes - share.sink_bytes)) < 3 * plan.state.page_bytes + 2**20
    more_state = size_plan(plan, 8 * GiB, context_len=8192, state_share=0.8)
    assert more_state.full_tokens < share.full_tokens


def test_more_budget_never_buys_fewer_tokens():
    plan = _plan(state=False)
    tokens = [size_plan(plan, b * GiB, context_len=4096).full_tokens for b in (1, 2, 4, 8)]
    assert tokens == sorted(tokens) and tokens[0] > 0


def test_floor_names_each_term():
    """DECL-12: a budget below the bs1 floor is refused, naming each term and its bytes."""
    plan = _plan()
    floor = check_bs1_floor(plan, 8 * GiB, 8192, 64)
    names = [t.name for t in floor.terms]
    assert names[:3] == ["request table", "scratch", "request rows"]
    assert any("window1024" in n for n in names) and any("state slots" in n for n in names)
    assert any("sink" in n for n in names)
    with pytest.raises(BudgetError) as err:
        size_plan(plan, floor.total - 1, context_len=8192, max_running_requests=64)
    message = str(err.value)
    for term in floor.terms:
        assert term.name in message or not term.checked
    assert "full rows" not in message.split(";")[0]  # DECL-13: the full-attention pages are not refused
    size_plan(plan, floor.total, context_len=8192, max_running_requests=64)


def test_whole_request_fit_is_not_a_sizing_refusal():
    """DECL-13: a budget that passes the floor is sized even if a full context does not fit."""
    plan = _plan(window=False, state=False)
    floor = check_bs1_floor(plan, 10**12, 131072, 1)
    s = size_plan(plan, floor.total + 10 * plan.owner.page_bytes, context_len=131072, max_running_requests=1)
    assert s.concurrency == 0 and s.full_tokens > 0


@pytest.mark.parametrize("kwargs", [
    {"context_len": 0}, {"max_running_requests": 0}, {"state_share": 1.5},
    {"state_slots": 4, "state_share": 0.5}, {"state_slots": -1},
])
def test_nonsense_sizes_are_refused(kwargs):
    with pytest.raises(InputError):
        size_plan(_plan(), GiB, **kwargs)


def test_sizing_fits_the_arena_layout():
    plan = _plan()
    s = size_plan(plan, 3 * GiB, context_len=4096)
    layout = arena_layout(plan, s.arena_bytes)
    assert layout.arena_bytes == s.arena_bytes and layout.sink_bytes == s.sink_bytes
    assert sum(t.bytes for t in s.targets) <= layout.chain_bytes


#: presets of every chain shape: full attention alone, with a window, with state, with a window and
#: state, MLA
FLOOR_PRESETS = ("llama-3.1-8b", "gpt-oss-20b", "qwen3-next-80b", "hymba-1.5b", "deepseek-v3", "gemma-3-27b")
_FLOOR_PLANS = {}


def _floor_plan(name: str, page_size: int):
    key = (name, page_size)
    if key not in _FLOOR_PLANS:
        _FLOOR_PLANS[key] = plan_kv_storage(model_from_preset(name).decls, page_size=page_size)
    return _FLOOR_PLANS[key]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(FLOOR_PRESETS), page_size=st.sampled_from([1, 16, 64]),
       context=st.integers(1, 65536), rows=st.integers(1, 64), extra=st.integers(0, 2**26),
       checked_only=st.booleans())
def test_a_budget_above_the_floor_plans_at_least_one_request(name, page_size, context, rows, extra, checked_only):
    """DECL-12/13: any budget from the floor's checked terms up is sized without a refusal, and any
    budget from the whole floor (one request's full-attention pages included) up plans a
    concurrency of at least 1 (the gaps between sub-pools and the sink's alignment are in it)."""
    plan = _floor_plan(name, page_size)
    floor = check_bs1_floor(plan, 2**60, context, rows)
    budget = (floor.total if checked_only else floor.one_request) + extra
    sizing = size_plan(plan, budget, context_len=context, max_running_requests=rows)
    assert sizing.used_bytes <= budget
    if not checked_only:
        assert sizing.concurrency >= 1, (sizing.limited_by, floor.explain())


@pytest.mark.parametrize("name", FLOOR_PRESETS)
def test_the_floor_is_tight_within_its_alignment_terms(name):
    """The floor is no loose bound: a budget below it by more than the gap and sink terms fails to
    plan one request."""
    plan = _floor_plan(name, 64)
    floor = check_bs1_floor(plan, 2**60, 8192, 8)
    slack = sum(t.bytes for t in floor.terms if t.key in ("sub_pool_gaps", "sink_pages"))
    budget = floor.one_request - slack - 1
    try:
        sizing = size_plan(plan, budget, context_len=8192, max_running_requests=8)
    except BudgetError:
        return
    assert sizing.concurrency == 0
