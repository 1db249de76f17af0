"""Set-up the storage role contract tests (`tests/unit/test_storage_*.py`) share: the check that a
refused call changed nothing, and the compaction pressure the contracts that move pages run under."""

from __future__ import annotations

import pytest

from support.chains import allocator_state, same_state


def assert_unchanged(storage, call, error, match=None) -> None:
    """`call()` raises `error` (its message matching `match`) and leaves everything the allocator
    decides with as it was."""
    before = allocator_state(storage)
    with pytest.raises(error, match=match):
        call()
    assert same_state(before, allocator_state(storage))


@pytest.fixture(autouse=True)
def compaction_always_pressed(monkeypatch):
    """Every band counts as short of room, so `flush_opportunistic` closes the holes it can. A test
    module that imports it runs every test under it."""
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_GAP_FRACTION", "1.0")
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL", "64")
