"""Capacity decisions versus estimates (`alloc/decisions.py`): decision paths are marked, and an
estimate read inside one is flagged."""

from __future__ import annotations

import logging

import pytest

from kvchain import capacity
from kvchain.alloc import chain as chain_module
from kvchain.alloc.decisions import capacity_decision
from kvchain.alloc.demand import KVDemand
from kvchain.errors import InvariantError
from support.chains import small_storage
from support.tree import patched


def test_observe_only_read(monkeypatch, caplog):
    """CAP-13, CHK-13: an estimate read inside a capacity decision raises at 2, logs once at 1,
    and is free outside decisions."""
    storage = small_storage()
    chain = storage.allocator
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    chain.available_size()  # outside a decision: fine
    decide = capacity_decision(lambda: chain.usage())
    with pytest.raises(InvariantError, match=r"capacity\.observe_only_read"):
        decide()
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "1")
    with caplog.at_level(logging.WARNING, logger="kvchain.invariants"):
        decide()
        decide()
    assert caplog.text.count("'usage'") == 1
    # the real decision paths read no estimate
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    assert chain.units_fit([1] * len(chain.bands))
    assert chain.ensure_capacity([1] * len(chain.bands))


def test_capacity_decision_paths_are_marked():
    """CAP-15: every capacity decision (`units_fit`, `admits`, `fits_after_frees`,
    `ensure_capacity`, the memory clip, and `evict_until_fits` through them) prices inside a
    `capacity_decision` mark, so an estimate read there is flagged (CHK-13)."""
    storage = small_storage(page_size=2, chain_kib=8)
    chain = storage.allocator
    marks = []

    def spy(original):
        def feasible(snapshot, demand):
            marks.append(capacity.in_capacity_decision())
            return original(snapshot, demand)
        return feasible

    d = [0] * len(chain.bands)
    d[chain.owner.index] = 3
    with patched(chain_module, "feasible", spy):
        chain.units_fit(d)
        chain.admits(KVDemand(tuple(d), 3, 0))
        chain.fits_after_frees(d, [1] * len(d))
        chain.ensure_capacity([x + 10**5 for x in d])
        chain.max_new_tokens_for_memory(8, 32)
        capacity.evict_until_fits(storage, None, d)
    assert len(marks) >= 6 and all(marks)
    assert not capacity.in_capacity_decision()
