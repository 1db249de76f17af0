"""A fused draft on the plan, worked by hand: its KV is priced wherever the target's is.

Target: one full-attention layer and one 16-token window layer; draft: one full-attention layer and
one 64-token window layer (a lifetime the target lacks). MHA 2x16 fp32 is 2 * (16 + 16) * 4 = 256
bytes per token per layer, so a 16-token page of one layer is 4096 bytes."""

from __future__ import annotations

import pytest

from kvchain.alloc.demand import KVDemand
from kvchain.build import build_kv_storage
from kvchain.decl import (
    MHA,
    FullLifetime,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from kvchain.engine.speculative import plan_with_draft
from kvchain.errors import PlanError
from kvchain.plan import plan_kv_storage
from kvchain.prefill_budget import ChainPrefillBudget, Decision
from kvchain.sizing import check_bs1_floor, size_plan

GEO = MHA(2, 16, dtype="float32")
TARGET = kv_layer_decls([KVPart(GEO, FullLifetime()), KVPart(GEO, WindowLifetime(16))])
DRAFT = kv_layer_decls([KVPart(GEO, FullLifetime()), KVPart(GEO, WindowLifetime(64))])
PAGE = 16


def test_the_draft_window_is_a_band_and_its_layers_double_the_full_page():
    plan = plan_with_draft(TARGET, DRAFT, page_size=PAGE, checkpoint_interval=None)
    assert [p.name for p in plan.sub_pools] == ["draft_window64", "window16", "full"]
    full = plan.by_name("full")
    assert full.layer_ids == (0, 2) and full.draft_layer_ids == (2,)
    assert full.page_bytes == 2 * 16 * 256 == 8192  # target and draft layer in one page
    assert plan.by_name("draft_window64").page_bytes == 16 * 256


def test_the_floor_includes_the_draft_window_rows():
    fused = plan_with_draft(TARGET, DRAFT, page_size=PAGE, checkpoint_interval=None)
    alone = plan_kv_storage(TARGET, page_size=PAGE)
    terms = {t.name: t.bytes for t in check_bs1_floor(fused, 2**30, 256, 4).terms}
    # a 64-token window spans at most 64/16 + 1 = 5 pages of 4096 bytes
    assert terms["draft_window64 rows (5 pages)"] == 5 * 4096
    # the full-attention rows of one 256-token request: 16 pages of 8192 bytes (4096 without the draft)
    assert terms["full rows (16 pages, checked at admission)"] == 16 * 8192
    alone_terms = {t.name: t.bytes for t in check_bs1_floor(alone, 2**30, 256, 4).terms}
    assert alone_terms["full rows (16 pages, checked at admission)"] == 16 * 4096
    assert check_bs1_floor(fused, 2**30, 256, 4).total > check_bs1_floor(alone, 2**30, 256, 4).total + 5 * 4096 - 1


def _storage(plan, budget):
    return build_kv_storage(plan, size_plan(plan, budget, context_len=256, max_running_requests=4), "cpu")


def test_the_memory_clip_and_admission_price_the_draft():
    """One budget for both plans. The fused chain holds 147456 bytes: a request's full-attention
    page costs 8192 bytes (target and draft layer), its window rows 2 pages of 4096 (16-token window)
    and 5 of 4096 (the draft's 64-token window), so 14 full pages fit (114688 + 8192 + 20480 =
    143360 bytes) and 15 do not (151552): a 64-token prompt keeps at most 14 * 16 - 64 = 160 output
    tokens. The target alone, at the same budget, holds every output asked for."""
    fused = plan_with_draft(TARGET, DRAFT, page_size=PAGE, checkpoint_interval=None)
    alone = plan_kv_storage(TARGET, page_size=PAGE)
    budget = size_plan(fused, 2**30, context_len=256, max_running_requests=4).fixed.total + 40 * 4096
    a, f = _storage(alone, budget), _storage(fused, budget)
    assert f.allocator.layout.chain_bytes == 147456
    assert f.allocator.max_new_tokens_for_memory(64, 400) == 160
    assert a.allocator.max_new_tokens_for_memory(64, 400) == 400

    def admission(storage, output: int) -> Decision:
        ctx = ChainPrefillBudget(storage, KVDemand.zero(len(storage.plan.sub_pools)), False)
        return ctx.consider(64, output, 0, 64).decision

    assert admission(f, 160) is Decision.ADMIT
    assert admission(f, 161) is not Decision.ADMIT  # a 15th full page: 8192 bytes the chain lacks
    assert admission(a, 161) is Decision.ADMIT


def test_a_recurrent_draft_needs_a_checkpoint_policy_on_the_target_state():
    state = State((StateTensor("conv", (16, 3)), StateTensor("ssm", (2, 8, 4), "float32")))
    target = kv_layer_decls([KVPart(GEO, FullLifetime()), KVPart(state, StateLifetime())])
    draft = kv_layer_decls([KVPart(state, StateLifetime())])
    with pytest.raises(PlanError, match="checkpoint policy"):
        plan_with_draft(target, draft, page_size=PAGE, checkpoint_interval=None)
    plan = plan_with_draft(target, draft, page_size=PAGE, checkpoint_interval=32)
    assert plan.state.layer_ids == (1, 2) and plan.state.draft_layer_ids == (2,)
    assert plan.state.lifetime == StateLifetime(32)


# A state target (one full-attention layer, one recurrent layer whose slot is 2 * 32 * 32 * 4 = 8192
# bytes) with a full-attention draft: a full page holds the target's and the draft's layer, 2 * 16 *
# 256 = 8192 bytes, so every page of the chain costs 8192 bytes. A round of k = 3 proposals takes
# k + 1 = 4 scratch state slots besides the running and tracking slots.
BIG_STATE = State((StateTensor("ssm", (2, 32, 32), "float32"),))
STATE_TARGET = kv_layer_decls([KVPart(GEO, FullLifetime()), KVPart(BIG_STATE, StateLifetime())])
FULL_DRAFT = kv_layer_decls([KVPart(GEO, FullLifetime())])


def _state_plans():
    return {k: plan_with_draft(STATE_TARGET, FULL_DRAFT, page_size=PAGE, checkpoint_interval=32,
                               num_speculative_tokens=k) for k in (0, 3)}


def test_adm3_the_scratch_state_slots_are_priced_in_the_floor():
    """ADM-3: a request's state slots in full include its rounds' k + 1 scratch slots: the floor's
    state term is 2 + 4 = 6 slots of 8192 bytes with k = 3, 2 without."""
    plans = _state_plans()
    assert plans[3].state.lifetime == StateLifetime(32, speculative_slots=4)
    terms = {k: {t.name: t.bytes for t in check_bs1_floor(p, 2**30, 256, 4).terms} for k, p in plans.items()}
    assert terms[3]["state slots (6)"] == 6 * 8192
    assert terms[0]["state slots (2)"] == 2 * 8192


def test_adm3_the_scratch_state_slots_are_priced_in_the_clip_and_admission():
    """ADM-3, ADM-16: one budget, a chain of 188416 bytes = 23 pages of 8192 bytes (12 state slot
    ids). A 64-token prompt priced with 2 state slots keeps 23 - 2 = 21 full pages, 21 * 16 - 64 = 272
    output tokens; with the 4 scratch slots it keeps 23 - 6 = 17, 17 * 16 - 64 = 208. Admission
    prices the same: 208 outputs admit, a 209th needs an 18th page, 6 + 18 = 24 > 23."""
    plans = _state_plans()
    fixed = size_plan(plans[3], 2**30, context_len=256, max_running_requests=4).fixed.total
    demand = {"checkpoint_interval": 32, "shares_prefixes": True, "min_chunk": 32}
    storages = {k: build_kv_storage(p, size_plan(p, fixed + 24 * 8192, context_len=256, max_running_requests=4,
                                                 state_slots=12), "cpu") for k, p in plans.items()}
    assert storages[3].allocator.layout.chain_bytes == 188416 == 23 * 8192
    assert storages[0].allocator.max_new_tokens_for_memory(64, 400, **demand) == 272
    assert storages[3].allocator.max_new_tokens_for_memory(64, 400, **demand) == 208

    def admission(storage, output: int) -> Decision:
        ctx = ChainPrefillBudget(storage, KVDemand.zero(len(storage.plan.sub_pools)), False, 32, True)
        return ctx.consider(64, output, 0, 64).decision

    assert admission(storages[3], 208) is Decision.ADMIT
    assert admission(storages[3], 209) is not Decision.ADMIT
    assert admission(storages[0], 209) is Decision.ADMIT
