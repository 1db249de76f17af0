"""Calls that rebind pages or change a row's length refuse what would corrupt the pool, before
anything changes: a page a row in use owns handed to another row, a window row bound under an id
that is never freed, a page that is not a load's handed to a window, a row grown between a launch
and the recording of its event (LIFE-31), and handles of another sub-pool or another pool."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain import (
    MHA,
    InputError,
    InvariantError,
    build_kv_storage,
    plan_kv_storage,
    size_plan,
    small_hybrid,
)
from support.chains import boundary_storage

A = np.array
WINDOW = "window128"


@pytest.fixture
def s():
    return boundary_storage()


def _row(s, tokens: int = 64) -> tuple[int, np.ndarray]:
    row = s.alloc_row()
    s.alloc_extend(A([row]), A([tokens]))
    return row, s.table.pages_of(row).copy()


def _idle(s, *rows: int) -> None:
    s.free_rows(A(list(rows)))
    s.check_idle()


def test_assign_prefix_refuses_pages_a_row_in_use_owns(s):
    """Row b would read a's pages after a frees them and c takes them."""
    a, pages = _row(s)
    b = s.alloc_row()
    with pytest.raises(InputError, match="belong to request rows in use"):
        s.assign_prefix(b, pages, 64, A([0]))
    assert s.seq_len(b) == 0 and not s.table.pages_of(b).size
    _idle(s, a, b)


def test_assign_prefix_takes_pages_the_tree_owns(s):
    """The control: once the row handed its pages to the tree, another row may start on them."""
    a, pages = _row(s)
    s.release_to_tree(a, len(pages))
    b = s.alloc_row()
    s.assign_prefix(b, pages, 64, A([0]))
    assert s.seq_len(b) == 64
    s.free_rows(A([a, b]))
    s.free_virtual_pages(pages)
    s.check_idle()


def test_bind_window_refuses_a_live_page_and_a_free_one(s):
    a, pages = _row(s)
    live = s.physical_pages(WINDOW, pages)[:1]
    spare = s.alloc_row()  # an owner id the window does not bind: the tree's, its window rows freed
    s.alloc_extend(A([spare]), A([16]))
    tree_page = s.table.pages_of(spare).copy()
    s.release_to_tree(spare, 1)
    s.free_rows(A([spare]))
    s.free_window_rows(WINDOW, tree_page)
    for physical in (live, A([7])):  # a row's live page, a page nothing holds
        with pytest.raises(InputError, match="not a load's reserved, unbound pages"):
            s.bind_window(WINDOW, tree_page, physical)
    with pytest.raises(InputError, match="does not hold every one of them"):  # an id the owner lacks
        s.bind_window(WINDOW, A([100]), live)
    loaded, reservation = s.alloc_load(WINDOW, 1)
    s.bind_window(WINDOW, tree_page, loaded)  # the control: a load's reserved page
    s.end_load_reservations(WINDOW, reservation)
    s.free_virtual_pages(tree_page)
    _idle(s, a)


def test_rehome_window_refuses_targets_the_owner_lacks_or_a_row_owns(s):
    a, pages = _row(s)
    b, other = _row(s)
    with pytest.raises(InputError, match="does not hold every one of them"):
        s.rehome_window(WINDOW, pages[:1], A([100]))
    with pytest.raises(InputError, match="belong to request rows in use"):
        s.rehome_window(WINDOW, pages[:1], other[:1])
    _idle(s, a, b)


@pytest.mark.parametrize("call", ["alloc_extend", "alloc_decode", "advance", "free_rows"])
def test_a_row_changes_only_outside_a_launch_and_its_record_life31(s, call):
    """Growing a row within its last page takes no page, yet the launched forward's metadata was
    built from the row as it stood: refused like a take, the row unchanged."""
    row, _pages = _row(s, 40)  # the next tokens fit the last page
    record = s.forward_launched()
    run = {"alloc_extend": lambda: s.alloc_extend(A([row]), A([42])), "alloc_decode": lambda: s.alloc_decode(A([row])),
           "advance": lambda: s.advance(A([row])), "free_rows": lambda: s.free_rows(A([row]))}[call]
    with pytest.raises(InvariantError, match=f"{call} between the launch of step"):
        run()
    assert s.seq_len(row) == 40 and s.table.active[row]
    s.record_forward(record, s.device.record(s.device.forward_stream), None)
    s.forward_processed(record)
    _idle(s, row)


def test_end_load_reservations_refuses_another_sub_pools_and_an_ended_one(s):
    _pages, reservation = s.alloc_load("full", 2)
    with pytest.raises(InputError, match="no such load reservation"):
        s.end_load_reservations(WINDOW, reservation)
    s.end_load_reservations("full", reservation)
    with pytest.raises(InputError, match="no such load reservation"):
        s.end_load_reservations("full", reservation)


def test_check_idle_refuses_a_held_count_it_cannot_read(s):
    for held, needle in (([1], "must be a dict"), ({"full": "x"}, "must be an integer"),
                         ({"nope": 3}, "no sub-pool 'nope'"), ({"full": -1}, "of -1")):
        with pytest.raises(InputError, match=needle):
            s.check_idle(held)
    s.check_idle({"full": 0})


def test_record_forward_refuses_writes_of_another_pool(s):
    other_plan = plan_kv_storage(small_hybrid(MHA(2, 64), (64,)), page_size=16)
    other = build_kv_storage(other_plan, size_plan(other_plan, 64 * 2**20, context_len=1024,
                                                   max_running_requests=8), "meta")
    r = other.alloc_row()
    writes = other.iteration_ids(other.alloc_extend(A([r]), A([16])), A([r]))
    row, _pages = _row(s, 16)
    record = s.forward_launched()
    with pytest.raises(InputError, match="not this pool's"):
        s.record_forward(record, s.device.record(s.device.forward_stream), writes)
    s.record_forward(record, s.device.record(s.device.forward_stream), None)
    s.forward_processed(record)
    _idle(s, row)


def test_transfer_handles_name_bound_pages_once(s):
    row, pages = _row(s, 16)
    full = s.physical_pages("full", pages)
    with pytest.raises(InputError, match="named more than once"):
        s.hold_receive_rows("h", {"full": A([full[0], full[0]])})
    with pytest.raises(InputError, match="not bound"):
        s.hold_receive_rows("h", {"full": A([8000])})
    with pytest.raises(InputError, match="name must be a string"):
        s.record_host_transfer(None, True, {"full": full}, s.device.record(s.device.schedule_stream))
    s.published(s.hold_receive_rows("h", {"full": full}))  # the control
    _idle(s, row)
