"""Declarations: geometry bytes computed exactly, lifetimes checked (DECL-1, DECL-2)."""

from __future__ import annotations

import pytest

from kvchain.decl import (
    MHA,
    MLA,
    FullLifetime,
    KVLayerDecl,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from kvchain.errors import DeclarationError, InputError


def test_mha_bytes_per_token():
    # 8 kv heads x (64 K + 64 V) x 2 bytes = 2048
    assert MHA(8, 64).unit_bytes() == 2048
    # distinct V head dim and fp8: 4 x (192 + 128) x 1 = 1280
    assert MHA(4, 192, v_head_dim=128, dtype="fp8").unit_bytes() == 1280
    # float32: 1 x (128 + 128) x 4
    assert MHA(1, 128, dtype="float32").unit_bytes() == 1024


def test_mla_bytes_per_token():
    # DeepSeek-V3: (512 latent + 64 rope) x 2 bytes = 1152
    assert MLA(512, 64).unit_bytes() == 1152
    assert MLA(512, 64, dtype="float8_e4m3fn").unit_bytes() == 576
    # DeepSeek-V3.2's indexer key beside it: 128 fp8 values + one float32 scale = 132
    assert MLA(512, 64, index_head_dim=128).unit_bytes() == 1152 + 132
    assert MLA(512, 64, index_head_dim=256).unit_bytes() == 1152 + 256 + 8
    with pytest.raises(DeclarationError):
        MLA(512, 64, index_head_dim=100)


def test_state_bytes_per_slot():
    # conv (8192, 3) bf16 = 49152; ssm (64, 64, 128) fp32 = 2097152
    s = State((StateTensor("conv", (8192, 3)), StateTensor("ssm", (64, 64, 128), "float32")))
    assert s.unit_bytes() == 8192 * 3 * 2 + 64 * 64 * 128 * 4


def test_a_layer_may_hold_attention_and_state():
    """DECL-1/DECL-2: a layer is an attention part, a state part, or one of each."""
    state = State((StateTensor("ssm", (4,)),))
    decl = KVLayerDecl(0, (KVPart(MHA(1, 8), FullLifetime()), KVPart(state, StateLifetime(64))))
    assert len(decl.parts) == 2
    with pytest.raises(DeclarationError, match="at most one of each"):
        KVLayerDecl(1, (KVPart(MHA(1, 8), FullLifetime()), KVPart(MHA(1, 8), WindowLifetime(4))))


@pytest.mark.parametrize(
    "make",
    [
        lambda: MHA(0, 64),
        lambda: MHA(8, -1),
        lambda: MLA(0, 64),
        lambda: WindowLifetime(0),
        lambda: StateLifetime(0),
        lambda: StateTensor("conv", ()),
        lambda: StateTensor("bad name", (4,)),
        lambda: State(()),
        lambda: State((StateTensor("a", (1,)), StateTensor("a", (2,)))),
        lambda: KVPart(MHA(1, 8), StateLifetime()),
        lambda: KVPart(State((StateTensor("a", (1,)),)), FullLifetime()),
        lambda: MHA(1, 8, dtype="int4"),
    ],
)
def test_bad_declarations_are_refused(make):
    with pytest.raises(InputError):
        make()


def test_kv_layer_decls_numbers_layers_and_skips_empty_ones():
    decls = kv_layer_decls([KVPart(MHA(1, 8), FullLifetime()), None, [KVPart(MHA(1, 8), WindowLifetime(16))]])
    assert [d.layer_id for d in decls] == [0, 2]
    with pytest.raises(DeclarationError):
        kv_layer_decls([None, None])
