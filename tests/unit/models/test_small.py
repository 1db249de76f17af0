"""The hand-made hybrids (`models/small.py`) the harness, the overlap driver, traces, benches and
tests build their chains from: layer order, parts per layer, geometries and lifetimes."""

from __future__ import annotations

import pytest

from kvchain.decl import MHA, MLA, FullLifetime, State, StateLifetime, StateTensor, WindowLifetime
from kvchain.errors import DeclarationError
from kvchain.models.small import small_hybrid
from kvchain.plan import PoolKind, plan_kv_storage

SSM = State((StateTensor("ssm", (8,), "float32"),))


def _shape(decls):
    """Per layer, its parts as (kind, geometry, lifetime)."""
    out = []
    for d in decls:
        out.append(tuple((type(p.lifetime).__name__, p.geometry, p.lifetime) for p in d.parts))
    return out


def test_one_block_puts_the_state_on_the_full_attention_layer_then_one_layer_per_window():
    full, w1, w2 = MHA(2, 8), MHA(1, 4), MHA(2, 4)
    decls = small_hybrid(full, (32, 8), window_geometry=[w1, w2], state=SSM, checkpoint_interval=16)
    assert [d.layer_id for d in decls] == [0, 1, 2]
    assert _shape(decls) == [
        (("FullLifetime", full, FullLifetime()), ("StateLifetime", SSM, StateLifetime(16))),
        (("WindowLifetime", w1, WindowLifetime(32)),),
        (("WindowLifetime", w2, WindowLifetime(8)),),
    ]


def test_windows_default_to_the_full_layer_s_geometry_and_may_be_chunked():
    full = MHA(1, 4, dtype="float32")
    decls = small_hybrid(full, (16, 4), chunked=True)
    assert [p.geometry for d in decls for p in d.parts] == [full, full, full]
    assert [d.parts[0].lifetime for d in decls[1:]] == [WindowLifetime(16, chunked=True), WindowLifetime(4, chunked=True)]
    assert len(decls[0].parts) == 1  # no state asked for
    one = MHA(2, 4)
    assert [d.parts[0].geometry for d in small_hybrid(full, (16, 4), window_geometry=one)] == [full, one, one]


def test_state_layers_interleave_a_state_layer_after_every_attention_layer_in_every_block():
    """The Mamba-hybrid pattern: full, state, window, state, repeated `blocks` times."""
    full = MHA(8, 128)
    decls = small_hybrid(full, (1024,), state=SSM, state_layers=True, blocks=3)
    kinds = [type(d.parts[0].lifetime).__name__ for d in decls]
    assert kinds == ["FullLifetime", "StateLifetime", "WindowLifetime", "StateLifetime"] * 3
    assert all(len(d.parts) == 1 for d in decls) and [d.layer_id for d in decls] == list(range(12))
    plan = plan_kv_storage(decls, page_size=4)
    by_kind = {p.kind: len(p.layer_ids) for p in plan.sub_pools}
    assert by_kind == {PoolKind.FULL: 3, PoolKind.WINDOW: 3, PoolKind.STATE: 6}


def test_blocks_repeat_a_dense_model():
    decls = small_hybrid(MLA(16, 8), blocks=5)
    assert len(decls) == 5 and all(d.parts[0].lifetime == FullLifetime() for d in decls)


def test_a_geometry_count_that_does_not_match_the_windows_and_no_blocks_are_refused():
    with pytest.raises(DeclarationError, match="1 window geometries for 2 windows"):
        small_hybrid(MHA(1, 4), (8, 4), window_geometry=[MHA(1, 4)])
    with pytest.raises(DeclarationError, match="1 to 100,000, got 0"):
        small_hybrid(MHA(1, 4), blocks=0)
    # a float or a huge count reached `block * blocks` (a TypeError, an OverflowError), a bare
    # window length its len() (a TypeError)
    for blocks in (1.5, 10**30, "2", None):
        with pytest.raises(DeclarationError, match="whole number of blocks"):
            small_hybrid(MHA(1, 4), blocks=blocks)
    with pytest.raises(DeclarationError, match="windows is a sequence of window lengths, not int"):
        small_hybrid(MHA(1, 4), 1024)
