"""A full pool's refusal: a take the chain's bytes cannot hold is refused before any snapshot is
built or any layout priced, and it refuses exactly what `units_fit` refuses (CAP-11, ALLOC-7)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from kvchain.errors import CapacityError
from support.chains import allocator_state, same_state, small_storage


def _full_storage():
    """A small pool filled with prompts until an admission is refused."""
    storage = small_storage(page_size=2, chain_kib=12, windows=(16,), state=True, context=96, rows=8)
    for _ in range(7):
        row = storage.alloc_row()
        try:
            storage.alloc_extend(np.array([row]), np.array([40]))
        except CapacityError:
            storage.free_rows(np.array([row]))
            break
    return storage


def test_cap11_every_take_near_a_full_chain_succeeds_exactly_when_units_fit_says_so():
    """CAP-11: with the byte bound in front of pricing, a take still succeeds exactly when
    `units_fit` says yes, and a refused one changes nothing (ALLOC-7)."""
    storage = _full_storage()
    chain = storage.allocator
    refused = 0
    for demand in itertools.product(range(0, 13, 4), repeat=len(chain.bands)):
        fits = chain.units_fit(demand)
        clone = copy.deepcopy(storage)
        before = allocator_state(clone)
        try:
            clone.allocator.take(demand)
            took = True
        except CapacityError:
            took = False
            refused += 1
            assert same_state(before, allocator_state(clone)), f"a refused take of {demand} changed state"
        assert fits == took, f"units_fit said {fits} but the take {'succeeded' if took else 'failed'} for {demand}"
    assert refused, "no demand was refused: the pool is not full enough to test the bound"


def test_cap11_a_take_past_the_chain_s_bytes_is_refused_without_pricing(monkeypatch):
    """CAP-11: a demand whose pages outweigh the chain's bytes is refused, saying what fell short,
    before a snapshot is built or a layout priced."""
    storage = _full_storage()
    chain = storage.allocator
    huge = tuple(b.grid.n_grid for b in chain.bands)

    def no_pricing(*_args, **_kwargs):
        raise AssertionError("a take past the chain's bytes built a pricing snapshot")

    monkeypatch.setattr(chain, "pricing_snapshot", no_pricing)
    monkeypatch.setattr(type(chain.bands[0]), "snapshot", no_pricing)
    before = allocator_state(storage)
    with pytest.raises(CapacityError, match="no layout of the arena serves"):
        chain.take(huge)
    assert same_state(before, allocator_state(storage))
