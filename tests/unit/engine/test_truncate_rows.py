"""`truncate_rows` (a rejected draft's tokens given back) refuses what it cannot do before anything
changes: rows named twice, not in use or outside the table, lengths that are not integers within a
row's own tokens, and a call between a launch and its record (LIFE-31)."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain import (
    InputError,
    InvariantError,
    truncate_rows,
)
from support.chains import boundary_storage

A = np.array


@pytest.fixture
def s():
    return boundary_storage()


def test_truncate_frees_the_pages_past_the_new_length(s):
    row = s.alloc_row()
    s.alloc_extend(A([row]), A([100]))
    assert truncate_rows(s, A([row]), A([20])) == 5  # 7 pages kept to 2
    assert s.seq_len(row) == 20 and len(s.table.pages_of(row)) == 2
    s.free_rows(A([row]))
    s.check_idle()


@pytest.mark.parametrize(("rows", "lens", "error", "needle"), [
    ("twice", [40, 40], InputError, "named more than once"),
    ("minus", [0], InputError, "outside"),
    ("free", [0], InputError, "not in use"),
    ("one", [10.5], InputError, "must be integers"),
    ("one", [200], InputError, "only within a row's own tokens"),
    ("one", [20, 30], InputError, "rows and lengths"),
])
def test_a_refused_truncate_changes_nothing(s, rows, lens, error, needle):
    row = s.alloc_row()
    s.alloc_extend(A([row]), A([100]))
    free = s.alloc_row()
    s.free_rows(A([free]))
    named = {"twice": [row, row], "minus": [-1], "free": [free], "one": [row]}[rows]
    pages = s.table.pages_of(row).copy()
    with pytest.raises(error, match=needle):
        truncate_rows(s, A(named), A(lens))
    assert s.seq_len(row) == 100 and (s.table.pages_of(row) == pages).all()
    s.free_rows(A([row]))
    s.check_idle()


def test_a_truncate_between_a_launch_and_its_record_changes_nothing_life31(s):
    row = s.alloc_row()
    s.alloc_extend(A([row]), A([100]))
    record = s.forward_launched()
    with pytest.raises(InvariantError, match="truncate_rows between the launch"):
        truncate_rows(s, A([row]), A([20]))
    assert s.seq_len(row) == 100
    s.record_forward(record, s.device.record(s.device.forward_stream), None)
    s.forward_processed(record)
    s.free_rows(A([row]))
    s.check_idle()
