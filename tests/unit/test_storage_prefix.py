"""The `PrefixSharing` contract of `KVStorage`, driven as the prefix tree drives it: pages the tree
owns outlive their rows, change binding without a copy, and are freed all bands at once or one
window alone."""

from __future__ import annotations

import numpy as np

from kvchain.errors import InputError, InvariantError
from kvchain.storage_roles import PrefixSharing
from support.contracts import assert_unchanged
from support.modeled import modeled_storage


def _storage():
    storage, device = modeled_storage(windows=(16, 8), state=False, chain_kib=48, page_size=2)
    return storage, device


def _cached(storage, length=8):
    """A finished row whose pages the tree took: returns them and the row's window starts."""
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([length]))
    n = length // storage.page_size
    vpages = storage.table.page_table[row, :n].copy()
    window_lo = storage.table.window_lo[row].copy()
    storage.release_to_tree(row, n)
    storage.free_rows(np.array([row]))
    return vpages, window_lo


def _held(storage, vpages):
    chain = storage.allocator
    return {b.name: int((b.ids.v2p[vpages] >= 0).sum()) for b in chain.bands}


def test_the_storage_plays_the_role():
    assert isinstance(_storage()[0], PrefixSharing)


def test_released_pages_outlive_their_row_and_a_prefix_row_never_frees_them():
    storage, device = _storage()
    vpages, window_lo = _cached(storage)
    storage.check_idle(_held(storage, vpages))  # the tree holds every band's rows
    row = storage.alloc_row()
    epoch, launches = storage.move_epoch, device.counters.launches
    storage.assign_prefix(row, vpages, 8, window_lo)
    assert storage.seq_len(row) == 8 and np.array_equal(storage.table.pages_of(row), vpages)
    assert (storage.move_epoch, device.counters.launches) == (epoch, launches)
    storage.alloc_extend(np.array([row]), np.array([11]))
    storage.free_rows(np.array([row]))
    storage.check_idle(_held(storage, vpages))
    storage.free_virtual_pages(vpages)
    storage.check_idle()
    assert len(storage.allocator.virtual_free) == storage.allocator.n_virtual - 1


def test_a_prefix_needs_a_fresh_row_and_whole_pages():
    storage, _ = _storage()
    vpages, window_lo = _cached(storage)
    row = storage.alloc_row()
    assert_unchanged(storage, lambda: storage.assign_prefix(row, vpages, 7, window_lo), InputError, "whole pages: 7 tokens")
    storage.alloc_extend(np.array([row]), np.array([2]))
    assert_unchanged(storage, lambda: storage.assign_prefix(row, vpages, 8, window_lo), InvariantError,
                     r"requests\.row_state")
    assert_unchanged(storage, lambda: storage.assign_prefix(row + 1, vpages, 8, window_lo), InvariantError,
                     r"requests\.row_state")


def test_release_to_tree_never_shrinks_what_the_tree_holds():
    storage, _ = _storage()
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([8]))
    storage.release_to_tree(row, 3)
    storage.release_to_tree(row, 1)
    assert storage.table.shared_pages[row] == 3


def test_free_window_rows_frees_one_window_alone():
    storage, _ = _storage()
    vpages, _ = _cached(storage)
    before = _held(storage, vpages)
    storage.free_window_rows("window8", vpages)
    after = _held(storage, vpages)
    assert after["window8"] == 0 and {k: v for k, v in after.items() if k != "window8"} == {
        k: v for k, v in before.items() if k != "window8"}
    storage.check_idle(after)
    assert_unchanged(storage, lambda: storage.free_window_rows("window99", vpages), InputError, "window99")


def test_rehome_moves_a_window_binding_without_a_take_or_copy():
    storage, device = _storage()
    src, _ = _cached(storage)
    dst, _ = _cached(storage)
    storage.free_window_rows("window8", dst)
    band = storage.allocator.bands[storage.plan.by_name("window8").index]
    physical = band.ids.v2p[src].copy()
    live, epoch, launches = storage.stats().live_pages, storage.move_epoch, device.counters.launches
    storage.rehome_window("window8", src, dst)
    assert np.array_equal(band.ids.v2p[dst], physical) and (band.ids.v2p[src] < 0).all()
    assert storage.stats().live_pages == live
    assert (storage.move_epoch, device.counters.launches) == (epoch, launches)
    assert_unchanged(storage, lambda: storage.rehome_window("window8", src, dst), InvariantError,
                     r"chain\.window_segment_bound")
    assert_unchanged(storage, lambda: storage.rehome_window("window16", src, dst), InvariantError,
                     r"chain\.window_segment_bound")  # window16 binds both: the targets are taken
    assert_unchanged(storage, lambda: storage.rehome_window("nope", dst, src), InputError, "nope")


def test_bind_window_names_loaded_pages_by_owner_ids():
    storage, _ = _storage()
    vpages, _ = _cached(storage)
    storage.free_window_rows("window8", vpages)
    pages, reservation = storage.alloc_load("window8", len(vpages))
    storage.bind_window("window8", vpages, pages)
    assert np.array_equal(storage.physical_pages("window8", vpages), pages)
    storage.end_load_reservations("window8", reservation)
    storage.check_idle(_held(storage, vpages))
    assert_unchanged(storage, lambda: storage.bind_window("nope", vpages, pages), InputError, "nope")
