"""Plans: sub-pools, chain order, ends and floats, fused drafts, tree slots."""

from __future__ import annotations

import sys

import pytest

from kvchain.decl import (
    MHA,
    MLA,
    FullLifetime,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from kvchain.errors import InputError, PlanError
from kvchain.models.small import small_hybrid
from kvchain.plan import Placement, PoolKind, plan_kv_storage

MHA8 = MHA(8, 64)
SSM = State((StateTensor("conv", (16, 3)), StateTensor("ssm", (2, 8, 4), "float32")))


def _hybrid():
    # 0: full + state, 1: window 4096, 2: window 128, 3: full, 4: window 128, 5: state only
    return kv_layer_decls([
        [KVPart(MHA8, FullLifetime()), KVPart(SSM, StateLifetime(256))],
        KVPart(MHA8, WindowLifetime(4096)),
        KVPart(MHA8, WindowLifetime(128)),
        KVPart(MHA8, FullLifetime()),
        KVPart(MHA8, WindowLifetime(128)),
        KVPart(SSM, StateLifetime(256)),
    ])


def test_parts_sharing_lifetime_and_unit_share_a_sub_pool():
    """DECL-3: same lifetime and allocation unit, same sub-pool."""
    plan = plan_kv_storage(_hybrid(), page_size=16)
    by_name = {p.name: p for p in plan.sub_pools}
    assert by_name["full"].layer_ids == (0, 3)
    assert by_name["window128"].layer_ids == (2, 4)
    assert by_name["window4096"].layer_ids == (1,)
    assert by_name["state"].layer_ids == (0, 5)
    # unit bytes: 2 layers x 8 heads x (64 + 64) x 2 bytes
    assert by_name["full"].unit_bytes == 2 * 2048
    assert by_name["state"].unit_bytes == 2 * (16 * 3 * 2 + 2 * 8 * 4 * 4)


def test_chain_order_and_placement():
    """DECL-6, DECL-7: state, windows longest first, full last; first is the up end, last the
    down end, the rest float."""
    plan = plan_kv_storage(_hybrid(), page_size=16)
    assert [p.name for p in plan.sub_pools] == ["state", "window4096", "window128", "full"]
    assert [p.placement for p in plan.sub_pools] == [
        Placement.UP_END, Placement.FLOAT, Placement.FLOAT, Placement.DOWN_END]
    assert plan.up_end.name == "state" and plan.down_end.name == "full" and plan.owner.kind is PoolKind.FULL
    assert [p.name for p in plan.floats] == ["window4096", "window128"]


def test_single_full_pool_is_the_down_end():
    plan = plan_kv_storage(small_hybrid(MLA(512, 64), blocks=3), page_size=1)
    assert plan.up_end is None and plan.floats == ()
    assert plan.down_end.placement is Placement.DOWN_END


def test_refuses_a_plan_without_full_attention_owner(monkeypatch):
    """DECL-4, PP-4: with the token-id owner not added, a plan of windows and state has no owner."""
    monkeypatch.setattr(sys.modules[plan_kv_storage.__module__], "_add_token_owner", lambda groups: None)
    with pytest.raises(PlanError, match="full-attention owner"):
        plan_kv_storage(kv_layer_decls([KVPart(MHA8, WindowLifetime(64)), KVPart(SSM, StateLifetime())]))


def test_refuses_two_geometries_in_one_sub_pool():
    """DECL-5."""
    with pytest.raises(PlanError, match="two geometries"):
        plan_kv_storage(kv_layer_decls([KVPart(MHA8, FullLifetime()), KVPart(MHA(4, 64), FullLifetime())]))


def test_fused_draft_window_the_target_lacks_gets_its_own_band():
    """DECL-8, WIN-3: the draft's window becomes its own band; the target's primary window keeps
    the first window tree slot even though the draft's window is longer."""
    target = small_hybrid(MHA8, (128,))
    draft = kv_layer_decls([KVPart(MHA8, WindowLifetime(1024))])
    plan = plan_kv_storage(target, page_size=16, draft=draft)
    assert [p.name for p in plan.sub_pools] == ["draft_window1024", "window128", "full"]
    assert plan.sub_pools[0].draft_layer_ids == (2,)
    assert [plan.sub_pools[i].name for i in plan.tree_slots] == ["full", "window128", "draft_window1024"]


def test_fused_draft_window_of_a_shared_lifetime_joins_the_target_band():
    target = small_hybrid(MHA8, (128,))
    draft = kv_layer_decls([KVPart(MHA8, WindowLifetime(128))])
    plan = plan_kv_storage(target, page_size=16, draft=draft)
    assert plan.by_name("window128").layer_ids == (1, 2)


def test_recurrent_draft_needs_the_target_state_band_with_checkpoints():
    """DECL-9."""
    draft = kv_layer_decls([KVPart(SSM, StateLifetime())])
    no_state = small_hybrid(MHA8)
    with pytest.raises(PlanError, match="no state band"):
        plan_kv_storage(no_state, draft=draft)
    no_checkpoint = small_hybrid(MHA8, state=SSM)
    with pytest.raises(PlanError, match="no checkpoint interval"):
        plan_kv_storage(no_checkpoint, draft=draft)
    ok = small_hybrid(MHA8, state=SSM, checkpoint_interval=128)
    plan = plan_kv_storage(ok, draft=draft)
    assert plan.state.layer_ids == (0, 1) and plan.state.draft_layer_ids == (1,)


def test_tree_slots_order():
    """WIN-2: full, the primary window, other windows longest first, state."""
    plan = plan_kv_storage(_hybrid(), page_size=16)
    assert [plan.sub_pools[i].name for i in plan.tree_slots] == ["full", "window4096", "window128", "state"]


def test_page_envelope_holds_every_layer():
    plan = plan_kv_storage(_hybrid(), page_size=16)
    full = plan.by_name("full")
    # 16 tokens x 2 layers x (K + V) x 8 heads x 64 x 2 bytes, no padding needed
    assert full.page_bytes == 16 * 2 * 2 * 8 * 64 * 2
    assert {(c.layer_id, c.name) for c in full.envelope.components} == {(0, "k"), (0, "v"), (3, "k"), (3, "v")}
    state = plan.state
    assert state.page_bytes >= state.unit_bytes and state.page_bytes % 16 == 0


def test_bad_page_size():
    with pytest.raises(InputError, match="page size"):
        plan_kv_storage(_hybrid(), page_size=0)


def test_by_name_finds_a_sub_pool_and_names_the_ones_it_has_when_it_does_not():
    plan = plan_kv_storage(_hybrid(), page_size=64)
    assert plan.by_name("window128").name == "window128"
    with pytest.raises(InputError, match=r"no sub-pool 'window64'.*'state', 'window4096', 'window128', 'full'"):
        plan.by_name("window64")
