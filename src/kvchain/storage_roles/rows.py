"""`RowsAndTakes`: request rows, and the chain takes that grow them.

A request holds a row of the `RequestTable`: owner virtual page ids, a length, a state slot. Rows
hold virtual ids only, so no move ever rewrites a row (IDS-7). Every take is one chain take over
every band, priced exactly: it succeeds whole or raises `CapacityError` with nothing changed. A free
is logical (LIFE-2): it unbinds at once and never waits; under a forward in flight the pages pend
until that forward is processed."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class RowsAndTakes(Protocol):
    """Rows, their tokens and their state slots. Between `forward_launched` and `record_forward`
    every take and free here, and every call that changes a row (`alloc_extend`, `alloc_decode`,
    `advance`, `free_rows`, even one that takes no page), raises `InvariantError` (LIFE-31),
    leaving the pool unchanged: the launched forward's metadata was built from the rows as they
    stood."""

    @abstractmethod
    def alloc_row(self) -> int:
        """A free request row, now in use: length 0, no pages, no state slot, and marked so the
        next forward resets its request state (LIFE-18). The id stays the request's until
        `free_rows`. Raises `CapacityError`, changing nothing, when every row is in use."""

    @abstractmethod
    def seq_len(self, row: int) -> int:
        """The row's length in tokens. Reads only."""

    @abstractmethod
    def alloc_extend(self, rows: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
        """Grow each of `rows` to its new length in one chain take: a page in every token band for
        each new page column, and a state slot for a row that has none. Returns the virtual token
        ids written, row by row with positions in order; they stay valid while the row holds them
        (a move changes physical ids only, never these).

        The take may compact or relocate bands: physical ids translated before it are stale once
        `move_epoch` changed. Raises `InputError` (nothing changed) when `rows` and `new_lens`
        differ in length or hold anything but integers, a row is not in use, named twice or outside
        the table, or a length lies outside [its current length, the context length]; `CapacityError` (nothing
        changed) when owner virtual ids, state slot ids or arena bytes run short."""

    @abstractmethod
    def alloc_decode(self, rows: np.ndarray) -> np.ndarray:
        """`alloc_extend` by one token per row (the hot path of a decode step): returns each row's
        new virtual token id. Raises `InputError` when a row is not in use, named twice, outside the
        table or already at the context length, and `CapacityError`, changing nothing, when the
        take cannot be served."""

    @abstractmethod
    def advance(self, rows: np.ndarray, checkpoints: np.ndarray | None = None) -> int:
        """After a forward: free, in every window band, the pages of `rows` wholly before the window
        (WIN-1), never past the window behind each row's checkpoint (token positions) when
        `checkpoints` are given (WIN-11), never the page of the last token, never a tree-shared
        prefix page. Returns the pages freed. Owner pages and lengths do not change; a row not in
        use retires nothing. Raises `InputError`, changing nothing, when a row is named twice (it
        would retire twice, freeing its pages twice) or lies outside the table, or `checkpoints`
        are not one integer in [0, context length] per row."""

    @abstractmethod
    def free_rows(self, rows: np.ndarray) -> None:
        """End requests: each window releases the rows' pages it still binds, then the owner, then
        the state slots; the rows return to the free list, cleared. Pages of a tree-shared prefix
        stay with the tree. Raises `InvariantError` (`requests.row_state`), changing nothing, when a
        row is not in use, and `InputError` when one is named twice or lies outside the table; an
        empty `rows` is a no-op. A row's own pages are always still bound here: no public free
        takes a page a row in use owns."""

    @abstractmethod
    def alloc_state_slots(self, n: int) -> np.ndarray:
        """`n` state slots not tied to a row (checkpoints, tracking slots), as virtual slot ids
        valid until `free_state_slots`. Raises `InputError` when the plan has no state sub-pool and
        `CapacityError`, changing nothing, when slot ids or bytes run short."""

    @abstractmethod
    def free_state_slots(self, slots: np.ndarray) -> None:
        """Free state slots from `alloc_state_slots` (logically, like every free). Raises
        `InputError`, changing nothing, when the plan has no state sub-pool and `slots` is not empty,
        or a slot is named twice, not allocated (never, or freed already) or held by a request row
        (`free_rows` frees it)."""

    @abstractmethod
    def copy_state(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Copy state slots on the schedule stream (a checkpoint, a fork). The copy first waits
        every unfinished writer of its sources (a forward in flight, a host load, a network
        receive) and clears what the ledger records on its destinations (LEDG-14..17); the host
        never waits. Raises `InputError` when the plan has no state sub-pool and `InvariantError`
        (`band.free_of_bound_page`), with nothing queued, when a slot is not bound."""
