"""`RequestTable` and `RowResets`: rows that hold virtual ids only, handed out and given back whole,
and the rows the next forward resets."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.errors import CapacityError, InputError, InvariantError
from kvchain.requests import NO_SLOT, RequestTable, RowResets, expand_runs


def test_a_table_needs_a_row_besides_the_padding_row():
    with pytest.raises(InputError, match="got 1 rows"):
        RequestTable(1, 16, 4)
    assert RequestTable(2, 16, 4).free_rows == 1


def test_rows_are_handed_out_until_none_is_left():
    table = RequestTable(3, 16, 4)
    rows = [table.alloc_row(), table.alloc_row()]
    assert 0 not in rows and table.active[rows].all()
    with pytest.raises(CapacityError, match="all 2 rows in use"):
        table.alloc_row()


def test_a_freed_row_is_cleared_and_freed_once():
    table = RequestTable(4, 16, 4, n_windows=1)
    row = table.alloc_row()
    table.page_table[row, :2] = [5, 6]
    table.seq_lens[row] = 7
    table.state_slot[row] = 3
    table.window_lo[row] = 1
    table.shared_pages[row] = 1
    table.free_row(row)
    assert not table.active[row] and not table.page_table[row].any() and table.seq_lens[row] == 0
    assert table.state_slot[row] == NO_SLOT and not table.window_lo[row].any() and table.shared_pages[row] == 0
    assert table.check_rows() == []
    with pytest.raises(InvariantError, match=r"requests\.row_state"):
        table.free_row(row)
    with pytest.raises(InvariantError, match=r"requests\.row_state"):
        table.release_rows(np.array([row]))


def test_own_pages_skip_the_tree_shared_prefix():
    table = RequestTable(3, 32, 4)
    a, b = table.alloc_row(), table.alloc_row()
    table.page_table[a, :3] = [1, 2, 3]
    table.seq_lens[a] = 10
    table.page_table[b, :2] = [4, 5]
    table.seq_lens[b] = 8
    table.shared_pages[a] = 1
    assert table.own_pages(np.array([a, b])).tolist() == [2, 3, 4, 5]
    assert table.req_to_token(np.array([b]), 5).tolist() == [[16, 17, 18, 19, 20]]


def test_length_and_row_checks_report_what_is_wrong():
    table = RequestTable(3, 8, 4)
    row = table.alloc_row()
    table.seq_lens[row] = 9
    assert any("outside 0..8" in p for p in table.check_lengths())
    assert any("longer than the context length" in p for p in table.check_rows())


def test_resets_are_taken_once_and_unmarked_rows_are_not_reset():
    resets = RowResets(6)
    resets.mark(np.array([1, 4]))
    resets.mark(2)
    resets.unmark(4)
    assert resets.take().tolist() == [1, 2]
    assert resets.take().tolist() == []


def test_expand_runs_lists_every_position_of_each_run_in_order():
    rows, pos = expand_runs(np.array([7, 8, 9]), np.array([2, 0, 5]), np.array([3, 0, 1]))
    assert rows.tolist() == [7, 7, 7, 9] and pos.tolist() == [2, 3, 4, 5]
    rows, pos = expand_runs(np.array([7, 8]), np.array([2, 0]), np.array([1, 0]))  # runs of at most one
    assert rows.tolist() == [7] and pos.tolist() == [2]
