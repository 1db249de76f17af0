"""Every error the layouts, the per-layer routes and the environment raise on a public path is a
`KVChainError` of its kind, and its message names the numbers involved."""

from __future__ import annotations

import pytest
import torch

from kvchain import env
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
from kvchain.errors import DeclarationError, EnvVarError, InputError, KVChainError, LayoutError
from kvchain.layout.entry import page_envelope
from kvchain.layout.host import host_layout
from kvchain.layout.views import SubPoolView
from kvchain.memory.arena import KVArena
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.routed_cache import RoutedKVCache


def _plan():
    """Layer 0 recurrent state only, layer 1 a sliding window, layer 2 full attention."""
    return plan_kv_storage(kv_layer_decls([
        KVPart(State((StateTensor("conv", (6, 3)), StateTensor("ssm", (2, 4), "float32"))), StateLifetime()),
        KVPart(MHA(1, 8), WindowLifetime(16)),
        KVPart(MHA(2, 8), FullLifetime()),
    ]), page_size=4)


def _views(plan):
    arena = KVArena(plan, 64 * 1024)
    return {pool.name: SubPoolView(pool, arena.page_bytes_view(pool.index)) for pool in plan.sub_pools}


def test_every_new_kind_is_a_kvchain_error_and_keeps_its_builtin_family():
    assert issubclass(LayoutError, KVChainError) and issubclass(LayoutError, LookupError)
    assert issubclass(EnvVarError, InputError) and issubclass(EnvVarError, ValueError)


def test_a_page_view_of_the_wrong_shape_names_both_shapes():
    pool = _plan().owner
    with pytest.raises(InputError, match=rf"'full' needs a \[n, {pool.page_bytes}\] uint8 page view, got \(3, 5\)"):
        SubPoolView(pool, torch.zeros((3, 5), dtype=torch.uint8))


def test_a_component_a_view_does_not_hold_names_the_layer_and_what_it_holds():
    plan = _plan()
    view = _views(plan)[plan.owner.name]
    with pytest.raises(LayoutError, match=r"no 'k' for layer 1 \(layers \[2\], components \['k', 'v'\]\)"):
        view.tensor(1, "k")


def test_state_from_an_attention_view_names_its_kind():
    plan = _plan()
    window = next(p for p in plan.sub_pools if p.kind is PoolKind.WINDOW)
    with pytest.raises(LayoutError, match=r"holds window pages, no recurrent state \(asked for 'ssm' of layer 1\)"):
        _views(plan)[window.name].state(1, "ssm")


def test_an_envelope_component_it_does_not_hold_names_the_layers():
    envelope = page_envelope(MHA(2, 8), [3, 5], page_size=4)
    with pytest.raises(LayoutError, match=r"no component 'kv' for layer 5 .*\(layers \[3, 5\], components \['k', 'v'\]\)"):
        envelope.component(5, "kv")


def test_an_unknown_geometry_is_a_declaration_error():
    with pytest.raises(DeclarationError, match="unknown geometry int 7"):
        page_envelope(7, [0], page_size=4)  # type: ignore[arg-type]


def test_a_negative_host_pool_names_the_count():
    with pytest.raises(InputError, match=r"host pages for sub-pool 'full' must be >= 0, got -2"):
        host_layout(_plan().owner, -2)


def test_routes_name_the_layer_and_where_its_other_part_lives():
    plan = _plan()
    routed = RoutedKVCache(plan, _views(plan))
    state_pool = next(p.name for p in plan.sub_pools if p.kind is PoolKind.STATE)
    with pytest.raises(LayoutError, match=rf"layer 0 has no attention part \(its state is in '{state_pool}'\)"):
        routed.attention(0)
    with pytest.raises(LayoutError, match=r"layer 2 has no state part \(its attention is in 'full'\)"):
        routed.state(2)
    with pytest.raises(LayoutError, match=r"layer 9 is in no sub-pool of the plan \(layers 0\.\.2\)"):
        routed.attention(9)
    assert routed.attention(2)[0] == "full" and routed.state(0)[0] == state_pool


@pytest.mark.parametrize("raw", ["7", "strict", "-1"])
def test_a_bad_check_level_names_the_value(monkeypatch, raw):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", raw)
    with pytest.raises(EnvVarError, match=rf"KVCHAIN_INVARIANT_CHECK must be 0, 1 or 2, not '{raw}'"):
        env.invariant_level()
    with pytest.raises(EnvVarError):
        env.get("KVCHAIN_INVARIANT_CHECK")


def test_a_variable_that_does_not_parse_names_it_its_value_and_its_default(monkeypatch):
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL", "many")
    with pytest.raises(EnvVarError, match=r"KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL='many' does not parse as int \(default '64'\)"):
        env.get("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL")
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL", "8")
    assert env.get("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL") == 8


def test_an_undeclared_variable_is_refused():
    with pytest.raises(EnvVarError, match=rf"KVCHAIN_NO_SUCH is not a declared variable \({len(env.VARIABLES)} are"):
        env.get("KVCHAIN_NO_SUCH")
