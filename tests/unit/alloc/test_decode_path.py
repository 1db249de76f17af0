"""`KVStorage.alloc_decode`, the decode hot path, does exactly what `alloc_extend` by one token does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchain.errors import InputError
from support.chains import allocator_state, same_state, small_storage


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=6), steps=st.integers(1, 12),
       state=st.booleans())
def test_decode_equals_extend_by_one(lens, steps, state):
    a, b = (small_storage(chain_kib=48, state=state, context=128) for _ in range(2))
    rows = []
    for n in lens:
        ra, rb = a.alloc_row(), b.alloc_row()
        assert ra == rb
        rows.append(ra)
        if n:
            a.alloc_extend(np.array([ra]), np.array([n]))
            b.alloc_extend(np.array([rb]), np.array([n]))
    rows = np.array(rows)
    for _ in range(steps):
        ta = a.alloc_decode(rows)
        tb = b.alloc_extend(rows, b.table.seq_lens[rows] + 1)
        assert np.array_equal(ta, tb)
        assert same_state(allocator_state(a), allocator_state(b))


def test_decode_refuses_bad_rows():
    storage = small_storage(context=16)
    row = storage.alloc_row()
    with pytest.raises(InputError):
        storage.alloc_decode(np.array([row + 1]))  # not in use
    storage.alloc_extend(np.array([row]), np.array([16]))
    before = allocator_state(storage)
    with pytest.raises(InputError):
        storage.alloc_decode(np.array([row]))  # at the context length
    assert same_state(before, allocator_state(storage))
