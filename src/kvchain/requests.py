"""`RequestTable`: request rows that hold virtual ids only, and `RowResets`.

Because rows hold virtual page ids, a page can move without rewriting any row (IDS-7). Row 0 is
the padding row: its pages are the null page, which reads the sink in every band."""

from __future__ import annotations

import numpy as np

from .alloc.id_space import IdStack
from .alloc.npfast import count_true
from .errors import CapacityError, InputError, InvariantError
from .sizing import pages_for

NO_SLOT = -1


def expand_runs(rows: np.ndarray, first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (row, position) of per-row runs: positions `first[i]` to `first[i] + counts[i] - 1` of
    `rows[i]`, in order, in one vectorised pass; runs of at most one skip the expansion. `counts`
    must be non-negative. One run (a prefill's) is a range. Array methods, not the `np.` functions:
    on arrays this short their dispatch costs more than the work."""
    if len(counts) == 1:
        k = int(counts[0])
        start = int(first[0])
        return rows.repeat(k), np.arange(start, start + k, dtype=np.int64)
    if counts.max(initial=0) <= 1:
        kept = counts > 0
        return rows[kept], first[kept]
    starts = counts.cumsum() - counts
    offsets = np.arange(int(counts.sum())) - starts.repeat(counts)
    return rows.repeat(counts), first.repeat(counts) + offsets


class RowResets:
    """Rows handed out since the last forward. Request-scoped device state is not reset when a row
    is handed out (that would race the previous owner's last forward); the next forward resets the
    marked rows on its own stream before its kernels (LIFE-16..18)."""

    def __init__(self, rows: int) -> None:
        self._marked = np.zeros(rows, dtype=bool)

    def mark(self, rows: np.ndarray | int) -> None:
        self._marked[rows] = True

    def unmark(self, rows: np.ndarray | int) -> None:
        """A row restored whole from a retraction backup is not reset (LIFE-20)."""
        self._marked[rows] = False

    def take(self) -> np.ndarray:
        rows = np.flatnonzero(self._marked)
        self._marked[rows] = False
        return rows


class RequestTable:
    """Per-row page tables of owner virtual page ids, lengths, and state slot ids."""

    def __init__(self, rows: int, context_len: int, page_size: int, n_windows: int = 0) -> None:
        if rows < 2:
            raise InputError(f"a request table needs at least one row besides the padding row, got {rows} rows")
        self.rows = rows
        self.context_len = context_len
        self.page_size = page_size
        self.max_pages = pages_for(context_len, page_size)
        self.page_table = np.zeros((rows, self.max_pages), dtype=np.int64)
        self.seq_lens = np.zeros(rows, dtype=np.int64)
        self.state_slot = np.full(rows, NO_SLOT, dtype=np.int64)
        self.active = np.zeros(rows, dtype=bool)
        #: per window band, the first page each row still binds there (earlier pages are retired)
        self.window_lo = np.zeros((rows, n_windows), dtype=np.int64)
        #: leading pages of each row the prefix tree owns: the row reads them but never frees them
        self.shared_pages = np.zeros(rows, dtype=np.int64)
        self._free = IdStack(rows, np.arange(rows - 1, 0, -1, dtype=np.int64))
        self.resets = RowResets(rows)
        #: moves whenever a row leaves use: rows found in use stay in use until it moves, so a
        #: caller may remember that answer (the boundary's `KVStorage._rows`)
        self.row_frees = 0

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def alloc_row(self) -> int:
        if not len(self._free):
            raise CapacityError(f"no free request row (all {self.rows - 1} rows in use)")
        row = int(self._free.pop(1)[0])
        self.active[row] = True
        self.resets.mark(row)
        return row

    def free_row(self, row: int) -> None:
        if not self.active[row]:
            raise InvariantError("requests.row_state", f"row {row} freed while not in use")
        self.page_table[row, : pages_for(int(self.seq_lens[row]), self.page_size)] = 0
        self._clear(row)
        self._free.push(np.array([row], dtype=np.int64))

    def release_rows(self, rows: np.ndarray, checked: bool = True) -> None:
        """Give rows back (vectorised `free_row`). `checked=False` skips the in-use check, for a
        caller that has just made it."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 1:  # an admission refused, a preemption, one finish: scalar writes
            idx = rows.item()
            if checked and not self.active.item(idx):
                raise InvariantError("requests.row_state", f"rows freed while not in use: [{idx}]")
        else:
            idx = rows
            if checked and count_true(self.active[rows]) != len(rows):
                raise InvariantError("requests.row_state",
                                     f"rows freed while not in use: {rows[~self.active[rows]].tolist()}")
        self.page_table[idx] = 0
        self._clear(idx)
        self._free.push(rows)

    def _clear(self, idx) -> None:
        """A freed row's fields back to a free row's (`idx` one row or an array of rows)."""
        self.active[idx] = False
        self.row_frees += 1
        self.seq_lens[idx] = 0
        self.state_slot[idx] = NO_SLOT
        self.window_lo[idx] = 0
        self.shared_pages[idx] = 0

    def own_pages(self, rows: np.ndarray) -> np.ndarray:
        """The virtual pages the rows own (past their tree-shared prefix), concatenated row by row,
        each row's in column order. One row (a finish's) is a slice; more, a mask over their
        columns (on a few rows that beats `expand_runs`' repeats)."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = (self.seq_lens[rows] + self.page_size - 1) // self.page_size
        if len(rows) == 1:
            return self.page_table[rows.item(), self.shared_pages.item(rows.item()):counts.item()].copy()
        cols = np.arange(self.max_pages)[None, :]
        mask = (cols < counts[:, None]) & (cols >= self.shared_pages[rows][:, None])
        return self.page_table[rows][mask]

    def pages_of(self, row: int) -> np.ndarray:
        return self.page_table[row, : pages_for(int(self.seq_lens[row]), self.page_size)].copy()

    def req_to_token(self, rows: np.ndarray, max_len: int | None = None) -> np.ndarray:
        """Virtual token ids `[len(rows), max_len]`: page * page_size + offset."""
        rows = np.asarray(rows, dtype=np.int64)
        if max_len is None:
            max_len = int(self.seq_lens[rows].max()) if len(rows) else 0
        pos = np.arange(max_len)
        return self.page_table[rows][:, pos // self.page_size] * self.page_size + pos % self.page_size

    def check_lengths(self) -> list[str]:
        """Request-length bounds of the active rows (CHK-18): each length within the context, the
        tree-shared prefix and every window's first bound page within the pages the length spans."""
        rows = np.flatnonzero(self.active)
        lens = self.seq_lens[rows]
        pages = (lens + self.page_size - 1) // self.page_size
        problems = []
        if ((lens < 0) | (lens > self.context_len)).any():
            problems.append(f"request rows {rows[(lens < 0) | (lens > self.context_len)].tolist()} have lengths "
                            f"outside 0..{self.context_len}")
        if (self.shared_pages[rows] > pages).any():
            problems.append("a request row shares more pages with the tree than its length spans")
        if (self.window_lo[rows] > pages[:, None]).any():
            problems.append("a request row's window starts past its length")
        return problems

    def check_rows(self) -> list[str]:
        """Row-state problems (idle check): inactive rows hold nothing, active rows stay in bounds."""
        problems = []
        inactive = ~self.active
        inactive[0] = False
        if ((self.seq_lens[inactive] != 0).any() or (self.state_slot[inactive] != NO_SLOT).any()
                or self.window_lo[inactive].any() or self.shared_pages[inactive].any()):
            problems.append("an inactive request row still holds a length or a state slot")
        if self.page_table[inactive].any():
            problems.append("an inactive request row still holds pages")
        if self.page_table[0].any() or self.seq_lens[0]:
            problems.append("the padding row holds pages")
        if (self.seq_lens > self.context_len).any():
            problems.append("a request row is longer than the context length")
        if len(self._free) + int(self.active[1:].sum()) != self.rows - 1:
            problems.append("free rows and active rows do not add up")
        return problems
