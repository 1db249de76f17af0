"""Each runtime check fires on a constructed violation, at the level the spec gives it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvchain.alloc import band as band_module
from kvchain.alloc import invariants
from kvchain.alloc.band import HOLE
from kvchain.alloc.band_state import BandState, SnapshotMode
from kvchain.env import InvariantCheckLevel, invariant_level
from kvchain.errors import InvariantError
from support.chains import small_storage


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")


@pytest.fixture
def warn(monkeypatch):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "1")


def _one_request(storage, length=12):
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([length]))
    return row


def test_levels(monkeypatch):
    """CHK-1, CHK-2: 0 is off, 1 warns, 2 is strict; unset is off, or strict under the older
    assert switch."""
    monkeypatch.delenv("KVCHAIN_INVARIANT_CHECK", raising=False)
    monkeypatch.delenv("KVCHAIN_ENABLE_ASYNC_ASSERT", raising=False)
    assert invariant_level() is InvariantCheckLevel.OFF
    monkeypatch.setenv("KVCHAIN_ENABLE_ASYNC_ASSERT", "1")
    assert invariant_level() is InvariantCheckLevel.STRICT
    for raw, level in (("0", InvariantCheckLevel.OFF), ("1", InvariantCheckLevel.WARN),
                       ("2", InvariantCheckLevel.STRICT)):  # a set level wins over the older switch
        monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", raw)
        assert invariant_level() is level, raw
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "7")
    with pytest.raises(ValueError):
        invariant_level()


@pytest.mark.parametrize("level", ["1", "2"])
def test_double_free_is_fatal_at_both_levels(monkeypatch, level):
    """CHK-3, CHK-4, CHK-5: from level 1 on the pool runs its checks, and `band.free_of_bound_page`
    fails a double free at level 1 and 2."""
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", level)
    storage = small_storage()
    _one_request(storage)
    owner = storage.allocator.owner
    page = owner.live_pages()[:1]
    storage.allocator.free(owner, page)
    with pytest.raises(InvariantError) as err:
        storage.allocator.free(owner, page)
    assert err.value.check == "band.free_of_bound_page"


def test_free_of_a_page_never_allocated(strict):
    storage = small_storage()
    owner = storage.allocator.owner
    with pytest.raises(InvariantError, match=r"band\.free_of_bound_page"):
        storage.allocator.free(owner, np.array([owner.grid.n_grid - 1]))
    with pytest.raises(InvariantError, match=r"band\.free_of_bound_page"):
        storage.allocator.free(owner, np.array([10**9]))


def test_checks_are_off_at_level_0(monkeypatch):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "0")
    storage = small_storage()
    owner = storage.allocator.owner
    band_module.check_freed_pages(owner, np.array([owner.grid.n_grid - 1]))  # no raise


def test_free_outside_reservation(strict):
    """CHK-6: an owner free never names a page reserved for a host-tier load."""
    storage = small_storage()
    _one_request(storage)
    owner = storage.allocator.owner
    page = owner.live_pages()[:1]
    owner.fixed_mask[page] = True
    owner.n_fixed = 1
    with pytest.raises(InvariantError) as err:
        storage.allocator.free(owner, page)
    assert err.value.check == "band.free_outside_reservation"


def test_window_segment_bound(strict):
    """CHK-7: a window free names rows still bound to the window."""
    storage = small_storage()
    row = _one_request(storage)
    window = storage.allocator.window_bands[0]
    vpage = storage.table.pages_of(row)[:1]
    storage.allocator.free_virtual(window, vpage)
    with pytest.raises(InvariantError) as err:
        storage.allocator.free_virtual(window, vpage)
    assert err.value.check == "chain.window_segment_bound"


def test_window_segment_released(strict):
    """CHK-8: a full-attention free names only rows every window already released."""
    storage = small_storage()
    row = _one_request(storage)
    vpages = storage.table.pages_of(row)
    with pytest.raises(InvariantError) as err:
        invariants.check_windows_released(storage.allocator, vpages)
    assert err.value.check == "chain.window_segment_released"
    for band in storage.allocator.window_bands:
        storage.allocator.free_virtual(band, vpages)
    invariants.check_windows_released(storage.allocator, vpages)


def test_geometry_ready_warns_at_1_and_raises_at_2(monkeypatch, caplog):
    """CHK-4, CHK-11: `band.geometry_ready` is non-fatal: logged at 1, raised at 2."""
    storage = small_storage()
    owner = storage.allocator.owner
    owner.n_pending = 1  # a constructed violation: a pending page under a layout change
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "1")
    with caplog.at_level(logging.WARNING, logger="kvchain.invariants"):
        band_module.geometry_ready(owner)
    assert "band.geometry_ready" in caplog.text
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    with pytest.raises(InvariantError, match=r"band\.geometry_ready"):
        band_module.geometry_ready(owner)


def test_idle_leak_check(strict):
    """CHK-15: a page no row accounts for is a leak at idle."""
    storage = small_storage()
    row = _one_request(storage)
    storage.check_idle()
    owner = storage.allocator.owner
    leaked = storage.table.pages_of(row)
    storage.table.seq_lens[row] = 0  # the row forgets its pages
    storage.table.page_table[row, : len(leaked)] = 0
    with pytest.raises(InvariantError, match="idle_leak"):
        storage.check_idle()
    assert owner.n_live == len(leaked)


def test_row_state_check(strict):
    storage = small_storage()
    row = _one_request(storage)
    storage.free_rows(np.array([row]))
    storage.table.seq_lens[row] = 5  # an inactive row that still holds a length
    with pytest.raises(InvariantError, match="inactive request row"):
        storage.check_idle()


def test_byte_accounting_catches_a_miscounted_hole(strict):
    storage = small_storage()
    row = _one_request(storage, 20)
    storage.free_rows(np.array([row]))
    owner = storage.allocator.owner
    assert owner.n_holes
    owner.state[owner.holes.view()[0]] = 0  # a hole that silently left the band
    with pytest.raises(InvariantError, match="byte_accounting"):
        storage.allocator.verify_byte_accounting()


def test_byte_accounting_catches_a_stale_snapshot(strict):
    """CAP-7, CHK-15: a change that does not move the capacity epoch leaves a stale memo."""
    storage = small_storage()
    chain = storage.allocator
    _one_request(storage)
    chain.pricing_snapshot()
    chain.verify_byte_accounting()
    owner = chain.owner
    # rebind a capacity field behind the descriptor's back: the epoch does not move
    owner.__dict__["n_holes"] += 1
    owner.state[owner.lo - 1] = HOLE
    with pytest.raises(InvariantError, match="stale pricing snapshot"):
        chain.verify_byte_accounting()


def test_byte_accounting_catches_a_snapshot_that_counts_a_page_twice(strict, monkeypatch):
    """CAP-9, CHK-15: pricing's counts cover each band's span once. A load's reserved pages are
    live pages held in place; a snapshot that counted them as live and as fixed priced a fuller
    band than there was, and the accounting says so."""
    storage = small_storage()
    chain = storage.allocator
    pages, _reservation = storage.alloc_load(chain.owner.name, 3)
    storage.bind_loaded(chain.owner.name, pages)  # bound, and fixed until the reservation ends
    assert chain.owner.n_fixed == 3
    chain.verify_byte_accounting()
    real = BandState.snapshot

    def twice(band, mode=SnapshotMode.TAKE):
        snap = real(band, mode)
        return snap._replace(live=snap.live + band.n_fixed)

    monkeypatch.setattr(BandState, "snapshot", twice)
    with pytest.raises(InvariantError, match="its pricing snapshot counts"):
        chain.verify_byte_accounting()
