"""The `RowsAndTakes` contract of `KVStorage`: what each call mutates, what its result stays valid
for, and what it raises, with nothing changed on every error."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.errors import CapacityError, InputError, InvariantError
from kvchain.storage_roles import RowsAndTakes
from support.chains import Payloads, allocator_state, same_state, small_storage
from support.contracts import assert_unchanged, compaction_always_pressed  # noqa: F401 (an autouse fixture)
from support.modeled import modeled_storage, request


def test_the_storage_plays_the_role():
    assert isinstance(small_storage(), RowsAndTakes)


def test_a_new_row_is_empty_and_marked_for_reset():
    storage = small_storage()
    storage.reset_new_rows()
    row = storage.alloc_row()
    t = storage.table
    assert t.active[row] and storage.seq_len(row) == 0 and t.state_slot[row] == -1
    assert not t.page_table[row].any()
    assert storage.reset_new_rows().tolist() == [row]


def test_no_free_row_raises_capacity_and_changes_nothing():
    storage = small_storage(rows=2)
    rows = [storage.alloc_row(), storage.alloc_row()]
    free_before = storage.table.free_rows
    assert_unchanged(storage, storage.alloc_row, CapacityError, r"all 2 rows in use")
    assert storage.table.free_rows == free_before == 0 and len(rows) == 2


def test_extend_returns_virtual_token_ids_in_row_order():
    storage = small_storage(page_size=2)
    a, b = storage.alloc_row(), storage.alloc_row()
    vtok = storage.alloc_extend(np.array([a, b]), np.array([3, 2]))
    t = storage.table
    want_a = t.page_table[a, [0, 0, 1]] * 2 + np.array([0, 1, 0])
    want_b = t.page_table[b, [0, 0]] * 2 + np.array([0, 1])
    assert vtok.tolist() == [*want_a.tolist(), *want_b.tolist()]
    assert storage.seq_len(a) == 3 and storage.seq_len(b) == 2
    assert t.state_slot[a] >= 0 and t.state_slot[b] >= 0 and t.state_slot[a] != t.state_slot[b]
    grown = storage.alloc_extend(np.array([a]), np.array([5]))
    assert grown.tolist() == (t.page_table[a, [1, 2]] * 2 + np.array([1, 0])).tolist()


def test_virtual_ids_survive_a_move_physical_ids_do_not():
    storage = small_storage(page_size=2, chain_kib=24)
    payloads = Payloads(storage)
    rows = []
    for _ in range(4):
        row, vtok = request(storage, 8)
        payloads.write_tokens(np.array([row]), vtok)
        payloads.write_slots(np.array([row]))
        rows.append(row)
    frontier = rows[-1]  # the owner grows down: the last row lies at its frontier
    pages = storage.table.pages_of(frontier)
    physical = storage.physical_pages("full", pages)
    epoch = storage.move_epoch
    storage.free_rows(np.array(rows[1:3]))
    assert storage.flush_opportunistic() > 0
    assert storage.move_epoch != epoch
    assert np.array_equal(storage.table.pages_of(frontier), pages)
    assert not np.array_equal(storage.physical_pages("full", pages), physical)
    payloads.check()


@pytest.mark.parametrize("rows, lens, match", [
    ([1], [4, 5], "1 rows but 2 lengths"),
    ([2], [4], "distinct rows that are in use"),
    ([1], [10_000], "must lie in"),
    ([99], [4], "outside the table"),
])
def test_extend_rejects_bad_input_and_changes_nothing(rows, lens, match):
    storage = small_storage()
    request(storage, 4)
    assert_unchanged(storage, lambda: storage.alloc_extend(np.array(rows), np.array(lens)), InputError, match)


def test_extend_never_shrinks_a_row():
    storage = small_storage()
    row, _ = request(storage, 6)
    assert_unchanged(storage, lambda: storage.alloc_extend(np.array([row]), np.array([4])), InputError, "current length")


def test_extend_past_the_arena_raises_capacity_and_changes_nothing():
    storage = small_storage(chain_kib=8, context=4096)
    row = storage.alloc_row()
    assert_unchanged(storage, lambda: storage.alloc_extend(np.array([row]), np.array([4000])), CapacityError)
    assert storage.seq_len(row) == 0


def test_decode_adds_one_token_per_row():
    storage = small_storage(page_size=2)
    a, _ = request(storage, 1)
    b, _ = request(storage, 2)
    vtok = storage.alloc_decode(np.array([a, b]))
    t = storage.table
    assert vtok.tolist() == [t.page_table[a, 0] * 2 + 1, t.page_table[b, 1] * 2]
    assert storage.seq_len(a) == 2 and storage.seq_len(b) == 3


def test_decode_rejects_full_or_unused_rows():
    storage = small_storage(context=8)
    row, _ = request(storage, 8)
    assert_unchanged(storage, lambda: storage.alloc_decode(np.array([row])), InputError, "context length 8")
    assert_unchanged(storage, lambda: storage.alloc_decode(np.array([row + 1])), InputError, "in use")
    assert_unchanged(storage, lambda: storage.alloc_decode(np.array([50])), InputError, "outside the table")


def test_advance_frees_window_pages_only():
    storage = small_storage(page_size=2, windows=(4,))
    row, _ = request(storage, 16)
    owner_pages = storage.table.pages_of(row).copy()
    live = dict(storage.stats().live_pages)
    freed = storage.advance(np.array([row]))
    after = storage.stats().live_pages
    assert freed > 0 and after["window4"] == live["window4"] - freed
    assert after["full"] == live["full"] and after["state"] == live["state"]
    assert storage.seq_len(row) == 16 and np.array_equal(storage.table.pages_of(row), owner_pages)
    assert storage.advance(np.array([row])) == 0  # nothing more left the window


def test_free_rows_returns_rows_pages_and_slots():
    storage = small_storage()
    rows = [request(storage, n)[0] for n in (3, 9)]
    storage.free_rows(np.array(rows))
    assert not storage.table.active[rows].any() and storage.table.free_rows == storage.table.rows - 1
    assert set(storage.stats().live_pages.values()) == {0}
    assert len(storage.allocator.virtual_free) == storage.allocator.n_virtual - 1
    storage.check_idle()
    before = allocator_state(storage)
    storage.free_rows(np.array([], dtype=np.int64))  # a no-op
    assert same_state(before, allocator_state(storage))


def test_free_of_a_row_not_in_use_raises_and_changes_nothing():
    storage = small_storage()
    row, _ = request(storage, 4)
    assert_unchanged(storage, lambda: storage.free_rows(np.array([row, row + 1])), InvariantError, r"requests\.row_state")
    assert_unchanged(storage, lambda: storage.free_rows(np.array([77])), InputError, "outside the table")


def test_state_slots_need_a_state_sub_pool():
    storage = small_storage(state=False)
    for call in (lambda: storage.alloc_state_slots(1), lambda: storage.free_state_slots(np.array([0])),
                 lambda: storage.copy_state(np.array([0]), np.array([1]))):
        assert_unchanged(storage, call, InputError, "no state sub-pool")
    storage.free_state_slots(np.array([], dtype=np.int64))  # nothing to free: no error


def test_state_slots_are_taken_whole_or_not_at_all():
    storage = small_storage(rows=4)
    slots = storage.alloc_state_slots(3)
    assert len(set(slots.tolist())) == 3 and storage.stats().live_pages["state"] == 3
    free = len(storage.allocator.slot_free)
    assert_unchanged(storage, lambda: storage.alloc_state_slots(free + 1), CapacityError, f"{free} free slot ids")
    assert_unchanged(storage, lambda: storage.alloc_state_slots(-1), InputError, "-1 slots")
    storage.free_state_slots(slots)
    assert storage.stats().live_pages["state"] == 0
    storage.check_idle()


def test_copy_state_copies_slot_bytes_on_the_schedule_stream():
    storage = small_storage()
    src, dst = storage.alloc_state_slots(2)
    view = storage.view("state").pages
    phys = storage.physical_pages("state", np.array([src, dst]))
    view[phys[0]] = 7
    storage.copy_state(np.array([src]), np.array([dst]))
    assert (view[phys[1]] == 7).all()


def test_copy_state_of_an_unbound_slot_raises_and_queues_nothing():
    storage, device = modeled_storage()
    src, dst = storage.alloc_state_slots(2)
    storage.free_state_slots(np.array([src]))
    launches, waits = device.counters.launches, device.counters.stream_waits
    assert_unchanged(storage, lambda: storage.copy_state(np.array([src]), np.array([dst])), InvariantError,
                     r"band\.free_of_bound_page")
    assert (device.counters.launches, device.counters.stream_waits) == (launches, waits)
    assert_unchanged(storage, lambda: storage.copy_state(np.array([dst]), np.array([dst, dst])), InputError, "onto 2")


def test_no_take_or_free_between_a_launch_and_its_record():
    storage, device = modeled_storage()
    row, _ = request(storage, 4)
    other = storage.alloc_row()
    record = storage.forward_launched()
    for call in (lambda: storage.alloc_extend(np.array([other]), np.array([4])),
                 lambda: storage.alloc_decode(np.array([row])),
                 lambda: storage.free_rows(np.array([row]))):
        assert_unchanged(storage, call, InvariantError, "between the launch")
    storage.record_forward(record, device.record(device.forward_stream, "done"), None)

