"""Declarations refuse meaningless values as one `DeclarationError` (an `InputError`) naming the
field: no float, bool or string dimension, no non-bool `chunked`, no part of the wrong type."""

from __future__ import annotations

import numpy as np
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
from kvchain.errors import DeclarationError, InputError, KVChainError

PART = KVPart(MHA(2, 64), FullLifetime())


@pytest.mark.parametrize(("make", "names"), [
    (lambda: MHA(2.0, 64), "kv_heads"),
    (lambda: MHA(2, True), "head_dim"),
    (lambda: MHA(2, 64, v_head_dim=64.5), "v_head_dim"),
    (lambda: MHA("2", 64), "kv_heads"),
    (lambda: MLA(512, 64.0), "rope_dim"),
    (lambda: MLA(512, True), "rope_dim"),
    (lambda: MLA(512, "64"), "rope_dim"),
    (lambda: MLA(512.0, 64), "kv_lora_rank"),
    (lambda: MLA(512, 64, index_head_dim=128.0), "index_head_dim"),
    (lambda: MLA(512, 64, index_head_dim=True), "index_head_dim"),
    (lambda: WindowLifetime(128.0), "window"),
    (lambda: WindowLifetime(True), "window"),
    (lambda: StateLifetime(checkpoint_interval=64.0), "checkpoint_interval"),
    (lambda: StateLifetime(speculative_slots=2.5), "speculative_slots"),
    (lambda: StateLifetime(speculative_slots=True), "speculative_slots"),
    (lambda: KVLayerDecl(1.5, ()), "layer_id"),
    (lambda: KVLayerDecl(True, ()), "layer_id"),
])
def test_a_dimension_that_is_not_an_integer_is_refused(make, names):
    with pytest.raises(DeclarationError, match=names) as e:
        make()
    assert isinstance(e.value, InputError) and isinstance(e.value, KVChainError)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("shape", [(2.7, 3), (True, 3), (3, np.bool_(True)), ("3",), 5, None])
def test_a_state_tensor_shape_of_non_integers_is_refused(shape):
    with pytest.raises(DeclarationError, match="shape"):
        StateTensor("a", shape)


def test_numpy_integers_are_dimensions_and_stored_as_ints():
    mha = MHA(np.int64(2), np.int32(64))
    assert mha == MHA(2, 64) and type(mha.kv_heads) is int and mha.unit_bytes() == MHA(2, 64).unit_bytes()
    assert MLA(np.int64(512), np.int64(64), index_head_dim=np.int64(128)) == MLA(512, 64, index_head_dim=128)
    tensor = StateTensor("a", (np.int64(2), 3))
    assert tensor.shape == (2, 3) and all(type(s) is int for s in tensor.shape)
    assert WindowLifetime(np.int64(128)) == WindowLifetime(128)
    assert KVLayerDecl(np.int64(3), (PART,)).layer_id == 3


@pytest.mark.parametrize("chunked", ["no", 1, 0, None])
def test_chunked_must_be_a_bool(chunked):
    with pytest.raises(DeclarationError, match="chunked"):
        WindowLifetime(128, chunked=chunked)
    assert WindowLifetime(128, chunked=np.bool_(True)).chunked is True


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: KVPart("mha", FullLifetime()), "geometry"),
    (lambda: KVPart(MHA(2, 64), None), "lifetime"),
    (lambda: KVPart(MHA(2, 64), "full"), "lifetime"),
    (lambda: KVPart(FullLifetime(), FullLifetime()), "geometry"),
])
def test_a_part_of_the_wrong_types_is_refused(make, needle):
    with pytest.raises(DeclarationError, match=needle):
        make()


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: StateTensor(5, (3,)), "name"),
    (lambda: StateTensor(None, (3,)), "name"),
    (lambda: State([1]), "tensors"),
    (lambda: State(None), "tensors"),
    (lambda: State(5), "tensors"),
    (lambda: kv_layer_decls([5]), "layer 0"),
    (lambda: kv_layer_decls([PART, "mha"]), "layer 1's entry .* got 'mha'"),
    (lambda: kv_layer_decls(None), "layers"),
    (lambda: KVLayerDecl(0, (MHA(2, 64),)), "parts"),
    (lambda: KVLayerDecl(0, 5), "parts"),
])
def test_what_raised_a_plain_error_is_an_input_error(make, needle):
    with pytest.raises(DeclarationError, match=needle) as e:
        make()
    assert "\n" not in str(e.value)


def test_valid_declarations_are_unchanged():
    assert MLA(512, 0).unit_bytes() == 1024
    assert WindowLifetime(128, chunked=True).chunked is True
    assert StateLifetime(speculative_slots=0) == StateLifetime()
    assert KVLayerDecl(0, ()).parts == ()
    assert [d.layer_id for d in kv_layer_decls([PART, None, [PART]])] == [0, 2]
    assert State([StateTensor("a", [2, 3])]).unit_bytes() == 12
