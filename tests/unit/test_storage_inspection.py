"""The `Inspection` contract of `KVStorage`: stats read counters only, and the idle checks prove
that rows and holders account for every live page, raising or logging as configured."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvchain.errors import InvariantError
from kvchain.storage import StorageStats
from kvchain.storage_roles import Inspection
from support.chains import allocator_state, same_state, small_storage
from support.modeled import request


def test_the_storage_plays_the_role():
    assert isinstance(small_storage(), Inspection)


def test_stats_count_pages_and_bytes_without_changing_anything():
    storage = small_storage(page_size=2)
    request(storage, 5)
    before = allocator_state(storage)
    stats = storage.stats()
    assert same_state(before, allocator_state(storage))
    assert isinstance(stats, StorageStats) and stats.active_rows == 1
    assert stats.live_pages == {"state": 1, "window32": 3, "window8": 3, "full": 3}
    bands = storage.allocator.bands
    assert stats.live_bytes == sum(stats.live_pages[b.name] * b.page_bytes for b in bands)
    assert stats.chain_bytes == storage.arena.layout.chain_bytes
    assert 0 < stats.utilisation == stats.live_bytes / stats.chain_bytes < 1
    assert stats.span_pages["full"] >= 3 and stats.moves == 0


def test_expected_live_pages_follow_the_rows():
    storage = small_storage(page_size=2, windows=(4,))
    row, _ = request(storage, 12)
    storage.advance(np.array([row]))
    shared, _ = request(storage, 4)
    storage.release_to_tree(shared, 1)  # the tree's page is not the row's
    expected = storage.expected_live_pages()
    assert expected["full"] == 6 + 1 and expected["state"] == 2
    assert expected["window4"] == 6 - int(storage.table.window_lo[row, 0]) + 1
    live = storage.stats().live_pages
    assert live["window4"] == expected["window4"] + 1 and live["full"] == expected["full"] + 1


def test_check_idle_raises_on_a_leak_unless_told_to_log(monkeypatch, caplog):
    storage = small_storage()
    storage.allocator.take_virtual(1, 0)  # pages no row or holder accounts for
    with pytest.raises(InvariantError, match=r"storage\.idle_leak: .*full: 1 live pages, rows and holders account for 0"):
        storage.check_idle()
    storage.check_idle({"full": 1, "window32": 1, "window8": 1})  # a holder that accounts for them
    monkeypatch.setenv("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "0")
    with caplog.at_level(logging.WARNING, logger="kvchain.storage"):
        storage.check_idle()
    assert "storage.idle_leak" in caplog.text


def test_check_idle_always_raises_on_lost_bytes(monkeypatch):
    monkeypatch.setenv("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "0")
    storage = small_storage()
    request(storage, 4)
    storage.allocator.owner.n_live += 1  # a count that no page state backs
    with pytest.raises(InvariantError, match=r"chain\.byte_accounting"):
        storage.check_idle({"full": 1})
