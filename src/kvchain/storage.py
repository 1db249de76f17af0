"""`KVStorage`: the one pool a scheduler, the prefix tree, the host tier and PD use.

It is a facade over the roles in `storage_roles`, whose docstrings are the contracts: rows and takes,
prefix sharing, the overlap scheduler's forward hooks, the host tier, PD transfers, translation and
inspection. It checks public inputs, keeps the `RequestTable`, and hands every page operation to the
`ChainAllocator` as one allocator operation; it reaches nothing inside the allocator."""

from __future__ import annotations

import logging

import numpy as np

from . import env
from .advance import retire_window_rows
from .alloc import invariants
from .alloc.chain import ChainAllocator
from .alloc.forward_steps import LaunchRecord
from .alloc.iteration_ids import IterationIds
from .alloc.page_usage import PageUse
from .alloc.runner_ids import RunnerIds
from .alloc.signals import HostTransfer, NetworkTransfer, ReceiveHold
from .device.base import Device, Event
from .errors import InputError, InvariantError
from .layout.views import SubPoolView
from .memory.arena import KVArena
from .plan import KVStoragePlan, PoolKind, SubPool
from .requests import NO_SLOT, RequestTable, expand_runs
from .routed_cache import RoutedKVCache
from .sizing import PlanSizing, pages_for
from .storage_roles import (
    ForwardHooks,
    HostTier,
    Inspection,
    PDTransfers,
    PrefixSharing,
    RowsAndTakes,
    StorageStats,
    Translation,
    boundary,
)
from .storage_roles.boundary import INT64, count_true

log = logging.getLogger("kvchain.storage")

#: row arrays up to this long are checked with Python's list operations, not a bincount over the table
_FEW_ROWS = 8
#: the shape of one admission's or one finish's row array
_ONE = (1,)


def _operation(fn):
    """Run a KVStorage method as one allocator operation."""

    def wrapper(self, *args, **kwargs):
        pinned = invariants.begin_operation()  # `allocator_operation`, inlined: this wraps the hot path
        try:
            return fn(self, *args, **kwargs)
        finally:
            invariants.end_operation(pinned)

    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = fn.__qualname__  # so `inspect.getdoc` finds the role's contract
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


def _unknown_rows(table: RequestTable, rows: np.ndarray) -> InputError:
    return InputError(f"request rows {rows[(rows < 0) | (rows >= table.rows)][:8].tolist()} "
                      f"outside the table's 0..{table.rows - 1}")


class KVStorage(RowsAndTakes, PrefixSharing, ForwardHooks, HostTier, PDTransfers, Translation, Inspection):
    """Every role over one arena, one `ChainAllocator` and one `RequestTable` (built by
    `build_kv_storage`). The methods' contracts are their roles' docstrings."""

    #: the boundary's checks run; only `bench.boundary_cost` clears it, on one instance, to price them
    _checked: bool = True
    #: what the checks remember between calls (set in `__init__`): `bench.boundary_cost` restores
    #: them to repeat a check on the same inputs and state
    _CHECK_MEMO = ("_rows_once", "_once_in_use", "_rows_inside", "_tokens_written")

    def __init__(
        self,
        plan: KVStoragePlan,
        sizing: PlanSizing,
        arena: KVArena,
        allocator: ChainAllocator,
        table: RequestTable,
        views: dict[str, SubPoolView],
    ) -> None:
        self.plan = plan
        self.sizing = sizing
        self.arena = arena
        self.allocator = allocator
        self.table = table
        self.views = views
        self.page_size = plan.page_size
        self.routed = RoutedKVCache(plan, views)
        self._has_state = plan.state is not None
        grids = arena.layout.grids
        self._n_slots = grids[plan.state.index].n_grid if self._has_state else 0
        self._n_virtual = allocator.n_virtual
        self._owner = plan.owner.name
        #: per length 0..context_len, whether a token still fits: a gather checks lengths, no ufunc
        self._below_context = np.arange(table.context_len + 1) < table.context_len
        #: one entry per length a token still fits after (0..context_len - 1): indexing it with a
        #: row's length raises at the context length, so the decode check is one gather, no count
        self._context_probe = np.zeros(table.context_len, dtype=np.int8)
        # The bytes of the last row array found inside the table and free of repeats, of the last one
        # found inside it, and of the last token ids the pool wrote: a step names the same rows to
        # every call and hands back the ids it was given, and what an array's bytes passed once
        # (a range, no repeats) they pass again, whatever the pool did since. Comparing bytes copies
        # them once and runs no ufunc. Whether rows are in use is pool state: the answer for
        # `_rows_once` holds while no row has left use (`_once_in_use`, the table's `row_frees`
        # when they were found in use; -1 when they were not).
        self._rows_once = b""
        self._once_in_use = -1
        self._rows_inside = b""
        self._tokens_written = b""
        #: per owner virtual page, the row and page column that took it last: with the rows' table
        #: they tell a page a row in use owns in a few gathers (`_held_by_rows`)
        self._taken_row = np.zeros(self._n_virtual, dtype=np.int64)
        self._taken_col = np.zeros(self._n_virtual, dtype=np.int64)

    # -- the boundary: ids checked on the host before anything changes ------------------------------

    def _passed_last(self, rows) -> bool:
        """Whether `rows` is an id array with the bytes `_rows` passed last: inside the table and
        named once (what `_any_rows` tests first). A step names the same rows to every call."""
        return (type(rows) is np.ndarray and rows.dtype is INT64 and rows.ndim == 1
                and rows.tobytes() == self._rows_once)

    def _rows(self, rows, what: str, in_use: bool = True) -> np.ndarray:
        """Request rows as int64, each inside the table, named once and (`in_use`) in use. Unless
        their bytes passed before: the gather of their in-use marks refuses a row past the table,
        the bincount of them a negative row, and its count of rows named is the repeats (a few
        rows: their list's min, max and set)."""
        if type(rows) is not np.ndarray or rows.dtype is not INT64 or rows.ndim != 1:  # `boundary.is_ids`, inlined
            rows = boundary.id_array(rows, f"{what} rows")
        table = self.table
        n = len(rows)
        if n == 1:  # an admission's or a finish's one row: two scalar reads, nothing remembered
            row = rows.item()
            if not 0 <= row < table.rows:
                raise _unknown_rows(table, rows)
            if in_use and not table.active.item(row):
                raise InputError(f"{what} needs distinct rows that are in use: rows [{row}] are not")
            return rows
        key = rows.tobytes()
        if key != self._rows_once:
            if n <= _FEW_ROWS:  # an admission's or a finish's rows: a list's min, max and set beat a bincount
                listed = rows.tolist()
                if n and (min(listed) < 0 or max(listed) >= table.rows):
                    raise _unknown_rows(table, rows)
                named = np.bincount(rows, minlength=table.rows) if len(set(listed)) != n else None
                # inside the table (just checked), so a gather of the in-use marks reads each row's own
                # mark; one gather and a count cost less as a step runs them than a generator of reads
                all_in_use = count_true(table.active[rows]) == n
            else:
                try:
                    active = table.active[rows]
                    named = np.bincount(rows, minlength=table.rows)
                except (IndexError, ValueError):
                    raise _unknown_rows(table, rows) from None
                if count_true(named) == n:
                    named = None
                all_in_use = count_true(active) == n
            if named is not None:
                raise InputError(f"{what} names each row once: rows {np.flatnonzero(named > 1)[:8].tolist()} "
                                 "are named twice")
            self._rows_once = key
            self._once_in_use = table.row_frees if all_in_use else -1
        if in_use and self._once_in_use != table.row_frees and not self._in_use(rows):
            active = table.active[rows]
            raise InputError(f"{what} needs distinct rows that are in use: rows {rows[~active][:8].tolist()} are not")
        return rows

    def _in_use(self, rows: np.ndarray) -> bool:
        """Whether every row of `rows`, the bytes `_rows` passed last (or one row), is in use: the
        remembered answer while no row has left use since, else a gather of their in-use marks."""
        table = self.table
        if len(rows) == 1:
            return table.active.item(rows.item())
        if self._once_in_use != table.row_frees:
            self._once_in_use = table.row_frees if count_true(table.active[rows]) == len(rows) else -1
        return self._once_in_use == table.row_frees

    def _row(self, row, what: str) -> int:
        row = boundary.index(row, f"{what} row")
        if not 0 <= row < self.table.rows:
            raise _unknown_rows(self.table, np.array([row]))
        return row

    def _vpages(self, vpages, what: str) -> np.ndarray:
        """Owner virtual pages (never the null page 0), each named once."""
        vpages = boundary.id_array(vpages, what)
        boundary.in_range(vpages, 1, self._n_virtual, what)
        boundary.distinct(vpages, what)
        return vpages

    def _slots(self, slots, what: str, once: bool = True) -> np.ndarray:
        slots = boundary.id_array(slots, what)
        boundary.in_range(slots, 0, self._n_slots, what)
        if once:
            boundary.distinct(slots, what)
        return slots

    def _bound(self, sub_pool: str, ids: np.ndarray, what: str) -> None:
        """Every id is allocated (bound) in the sub-pool, so a free or a copy names live pages only."""
        if not self._checked:
            return
        try:
            self.allocator.physical_pages(sub_pool, ids)
        except InvariantError:
            raise InputError(f"{what}: {sub_pool} does not hold every one of them (never allocated, "
                             f"or freed already)") from None

    def _held_by_rows(self, vpages: np.ndarray) -> np.ndarray:
        """Which of `vpages` (owner ids in range) a request row in use owns: taken by the row, still
        in its table, past its tree-shared prefix and within its length. A gather per array, no set."""
        table = self.table
        row, col = self._taken_row[vpages], self._taken_col[vpages]
        held = table.page_table[row, col] == vpages
        held &= table.active[row]
        held &= col >= table.shared_pages[row]
        held &= col * self.page_size < table.seq_lens[row]
        return held

    def _not_rows_own(self, vpages: np.ndarray, what: str) -> None:
        """A free that names a page a row in use owns would leave the row reading a freed page."""
        held = self._held_by_rows(vpages)
        if count_true(held):
            raise InputError(f"{what}: pages {vpages[held][:8].tolist()} belong to request rows in use "
                             "(free_rows frees them; an insert's duplicates go with release_to_tree)")

    def _window(self, sub_pool) -> SubPool:
        pool = self.plan.by_name(boundary.name(sub_pool))
        if pool.kind is not PoolKind.WINDOW:
            raise InputError(f"{sub_pool!r} is not a window sub-pool")
        return pool

    def _physical(self, pages) -> dict[str, np.ndarray]:
        """Physical page ids per sub-pool name (a transfer's), each inside its band's grid."""
        if not isinstance(pages, dict):
            raise InputError(f"pages must be a dict of sub-pool name to page ids, got {type(pages).__name__}")
        grids = self.arena.layout.grids
        out = {}
        for key, ids in pages.items():
            pool = self.plan.by_name(boundary.name(key))
            ids = boundary.id_array(ids, f"{key} pages")
            boundary.in_range(ids, 0, grids[pool.index].n_grid, f"{key} pages")
            out[key] = ids
        return out

    # -- rows and takes ---------------------------------------------------------------------------

    def alloc_row(self) -> int:
        return self.table.alloc_row()

    def seq_len(self, row: int) -> int:
        return int(self.table.seq_lens[self._row(row, "seq_len")])

    def _check_extend(self, rows, new_lens) -> tuple[np.ndarray, np.ndarray]:
        """`alloc_extend`'s inputs: rows in use, named once, one length each in [current, context]."""
        if not self._checked:
            return rows, new_lens
        table = self.table
        if (type(rows) is np.ndarray and type(new_lens) is np.ndarray and rows.dtype is INT64
                and new_lens.dtype is INT64 and rows.shape == _ONE and new_lens.shape == _ONE):
            # an admission: one row inside the table and in use, one length in [current, context];
            # anything else (or any of these failing) takes the general path, which names it
            row = rows.item()
            if (0 <= row < table.rows and table.active.item(row)
                    and table.seq_lens.item(row) <= new_lens.item() <= table.context_len):
                return rows, new_lens
        rows = self._rows(rows, "alloc_extend")
        new_lens = boundary.id_array(new_lens, "alloc_extend lengths")
        if len(rows) != len(new_lens):
            raise InputError(f"{len(rows)} rows but {len(new_lens)} lengths")
        # a row's length is never negative, so new >= old is new >= 0 too; past the context, the
        # gather of `_below_context` fails
        try:
            if len(rows) == 1:  # an admission's length: two scalars
                if not table.seq_lens.item(rows.item()) <= new_lens.item() <= table.context_len:
                    raise IndexError
            elif len(rows) <= _FEW_ROWS:  # a few lengths: compared as lists
                old_lens = table.seq_lens[rows]
                if not all(old <= new <= table.context_len for old, new in zip(old_lens.tolist(), new_lens.tolist())):
                    raise IndexError
            else:
                if count_true(new_lens < table.seq_lens[rows]):
                    raise IndexError
                self._below_context.take(new_lens)  # mode 'raise': a length past it fails
        except IndexError:
            raise InputError(f"new lengths must lie in [current length, {table.context_len}]") from None
        return rows, new_lens

    @_operation
    def alloc_extend(self, rows: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
        self.allocator.assert_between_steps("alloc_extend")
        rows, new_lens = self._check_extend(rows, new_lens)
        table = self.table
        old_lens = table.seq_lens[rows]
        ps = self.page_size
        old_pages = (old_lens + ps - 1) // ps
        counts = (new_lens + ps - 1) // ps - old_pages
        n = int(counts.sum())
        need_slot = rows[table.state_slot[rows] == NO_SLOT] if self._has_state else rows[:0]
        if n or len(need_slot):
            row_idx, col = expand_runs(rows, old_pages, counts)
            self._take_rows_pages(row_idx, col, need_slot)
        table.seq_lens[rows] = new_lens
        return self._written_tokens(rows, old_lens, new_lens)

    def _take_rows_pages(self, row_idx: np.ndarray, col: np.ndarray, need_slot: np.ndarray) -> None:
        """One chain take: a page for each (row, page column) pair and a state slot for each row in
        `need_slot`, entered in the request table. Raises CapacityError with nothing changed."""
        vpages, slots = self.allocator.take_virtual(len(row_idx), len(need_slot))
        if len(vpages):
            self.table.page_table[row_idx, col] = vpages
            self._taken_row[vpages] = row_idx
            self._taken_col[vpages] = col
        if len(slots):
            self.table.state_slot[need_slot] = slots

    def _written_tokens(self, rows: np.ndarray, old_lens: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
        counts = new_lens - old_lens
        ps = self.page_size
        if (counts == 1).all():  # decode
            return self.table.page_table[rows, old_lens // ps] * ps + old_lens % ps
        if len(rows) == 1:  # an admission's prefill: its pages' token ids laid out, then sliced
            old, new = old_lens.item(), new_lens.item()
            first = old // ps
            pages = self.table.page_table[rows.item(), first : -(-new // ps)]
            tokens = (pages[:, None] * ps + np.arange(ps)).ravel()
            return tokens[old - first * ps : new - first * ps]
        row_idx, pos = expand_runs(rows, old_lens, counts)
        return self.table.page_table[row_idx, pos // ps] * ps + pos % ps

    def _check_decode(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """`alloc_decode`'s rows (in use, named once, each below the context length) and their
        lengths, which the check reads and the step needs. The checks a one-token step needs and
        no more: this is every decode step's path."""
        table = self.table
        if not self._checked:
            return rows, table.seq_lens[rows]
        # `_rows`' remembered answer, read here: the bytes it found inside the table, named once and
        # in use, while no row has left use since (its `in_use` test, in the same order)
        if not (self._once_in_use == table.row_frees and self._passed_last(rows)):
            rows = self._rows(rows, "alloc_decode")
        lens = table.seq_lens[rows]
        try:  # a length is never negative, so only one at the context length falls outside the probe
            self._context_probe[lens]
        except IndexError:
            raise InputError(f"a row is at the context length {table.context_len}") from None
        return rows, lens

    @_operation
    def alloc_decode(self, rows: np.ndarray) -> np.ndarray:
        self.allocator.assert_between_steps("alloc_decode")
        rows, old_lens = self._check_decode(rows)
        table = self.table
        ps = self.page_size
        col, offset = np.divmod(old_lens, ps)
        grown = offset == 0  # the next token starts a page
        need_slot = rows[:0]
        if self._has_state:
            slotless = table.state_slot[rows] == NO_SLOT
            if count_true(slotless):
                need_slot = rows[slotless]
        if len(need_slot) or count_true(grown):
            self._take_rows_pages(rows[grown], col[grown], need_slot)
        table.seq_lens[rows] = old_lens + 1
        written = table.page_table[rows, col]
        written *= ps
        written += offset
        self._check_written(written)
        return written

    def _check_written(self, written: np.ndarray) -> None:
        """Remember the token ids the pool wrote last: they lie in its id space, so the step that
        hands them back to `iteration_ids` is not range-checked again (a boundary check's cost,
        so it is clocked as one)."""
        if self._checked:
            self._tokens_written = written.tobytes()

    def _check_advance(self, rows, checkpoints) -> tuple[np.ndarray, np.ndarray | None]:
        """`advance`'s rows named once, inside the table (a row named twice would retire twice,
        freeing its window pages twice; a row not in use holds no length, so it retires nothing),
        and one checkpoint per row in [0, context]."""
        if not self._checked:
            return rows, checkpoints
        if not self._passed_last(rows):
            rows = self._rows(rows, "advance", in_use=False)
        if checkpoints is not None:
            checkpoints = boundary.id_array(checkpoints, "advance checkpoints")
            boundary.same_count(rows, checkpoints, "advance rows and checkpoints")
            boundary.in_range(checkpoints, 0, self.table.context_len + 1, "advance checkpoints")
        return rows, checkpoints

    @_operation
    def advance(self, rows: np.ndarray, checkpoints: np.ndarray | None = None) -> int:
        self.allocator.assert_between_steps("advance")
        rows, checkpoints = self._check_advance(rows, checkpoints)
        return retire_window_rows(self.table, self.allocator, self.page_size, rows, checkpoints)

    def _check_free_rows(self, rows) -> np.ndarray:
        """`free_rows`'s rows named once, inside the table and (`InvariantError`) in use."""
        if not self._checked:
            return rows
        if type(rows) is np.ndarray and rows.dtype is INT64 and rows.shape == _ONE:
            row = rows.item()  # a finish's one row: inside the table and in use, else the general path
            table = self.table
            if 0 <= row < table.rows and table.active.item(row):
                return rows
        rows = self._rows(rows, "free_rows", in_use=False)
        if len(rows) and not self._in_use(rows):
            active = self.table.active[rows]
            raise InvariantError("requests.row_state", f"free of rows not in use {rows[~active].tolist()}")
        return rows

    @_operation
    def free_rows(self, rows: np.ndarray) -> None:
        self.allocator.assert_between_steps("free_rows")
        rows = self._check_free_rows(rows)
        if not len(rows):
            return
        table = self.table
        chain = self.allocator
        # A tree-shared prefix stays with the tree. The rest is bound: no public free reaches a page
        # a row in use owns (`_not_rows_own`), so the pages are not checked again here.
        own = table.own_pages(rows)
        chain.free_virtual_pages(own)
        slots = table.state_slot[rows]
        chain.free_state_slots(slots[slots != NO_SLOT])
        table.release_rows(rows, checked=False)  # checked above, before anything changed

    @_operation
    def alloc_state_slots(self, n: int) -> np.ndarray:
        self._require_state("alloc_state_slots")
        if boundary.index(n, "alloc_state_slots count") < 0:
            raise InputError(f"alloc_state_slots of {n} slots")
        return self.allocator.take_virtual(0, int(n))[1]

    @_operation
    def free_state_slots(self, slots: np.ndarray) -> None:
        slots = boundary.id_array(slots, "free_state_slots")
        if not len(slots):
            return
        self._require_state("free_state_slots")
        slots = self._slots(slots, "free_state_slots")
        self._bound(self.plan.state.name, slots, "free_state_slots")
        table = self.table
        held = np.isin(slots, table.state_slot[table.active])
        if held.any():
            raise InputError(f"free_state_slots: slots {slots[held][:8].tolist()} belong to request rows "
                             "(free_rows frees them)")
        self.allocator.free_state_slots(slots)

    @_operation
    def copy_state(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        self._require_state("copy_state")
        src = self._slots(src_slots, "copy_state sources", once=False)
        dst = self._slots(dst_slots, "copy_state destinations", once=False)
        if src.shape != dst.shape:
            raise InputError(f"state copy of {src.size} slots onto {dst.size}")
        boundary.distinct(dst, "copy_state destinations")
        self.allocator.copy_state_slots(src, dst)

    def _require_state(self, what: str) -> None:
        if not self._has_state:
            raise InputError(f"{what}: this plan has no state sub-pool")

    # -- prefix sharing ---------------------------------------------------------------------------

    @_operation
    def assign_prefix(self, row: int, vpages: np.ndarray, length: int, window_lo: np.ndarray) -> None:
        table = self.table
        row = self._row(row, "assign_prefix")
        if table.seq_lens[row] or not table.active[row]:
            raise InvariantError("requests.row_state", f"row {row} must be fresh to take a prefix")
        vpages = self._vpages(vpages, "assign_prefix pages")
        length = boundary.index(length, "assign_prefix length")
        n = len(vpages)
        if length != n * self.page_size:
            raise InputError(f"a shared prefix is whole pages: {length} tokens in {n} pages")
        if length > table.context_len:
            raise InputError(f"a shared prefix of {length} tokens is past the context length {table.context_len}")
        window_lo = boundary.id_array(window_lo, "assign_prefix window_lo")
        boundary.same_count(window_lo, table.window_lo[row], "assign_prefix window_lo and the window sub-pools")
        boundary.in_range(window_lo, 0, n + 1, "assign_prefix window_lo")
        self._bound(self._owner, vpages, "assign_prefix pages")
        if self._checked:  # a row in use frees its own pages: another row reading them would read freed pages
            self._not_rows_own(vpages, "assign_prefix pages")
        table.page_table[row, :n] = vpages
        table.seq_lens[row] = length
        table.shared_pages[row] = n
        table.window_lo[row] = window_lo

    @_operation
    def release_to_tree(self, row: int, n_pages: int, duplicates: np.ndarray | None = None) -> None:
        table = self.table
        row = self._row(row, "release_to_tree")
        n_pages = boundary.count(n_pages, "release_to_tree pages")
        if not table.active[row]:
            raise InputError(f"release_to_tree: row {row} is not in use")
        if n_pages > pages_for(int(table.seq_lens[row]), self.page_size):
            raise InputError(f"release_to_tree: row {row} holds fewer than {n_pages} pages")
        cols = None
        if duplicates is not None:
            duplicates = self._vpages(duplicates, "release_to_tree duplicates")
            at_row, cols = self._taken_row[duplicates], self._taken_col[duplicates]
            mine = self._held_by_rows(duplicates) & (at_row == row) & (cols < n_pages)
            if count_true(mine) != len(duplicates):
                raise InputError(f"release_to_tree duplicates {duplicates[~mine][:8].tolist()} are not row "
                                 f"{row}'s own pages among its first {n_pages}")
        if cols is not None and len(cols):
            self.allocator.free_virtual_pages(duplicates)
            table.page_table[row, cols] = 0  # the null page, never a freed id another row may take
        table.shared_pages[row] = max(int(table.shared_pages[row]), n_pages)

    @_operation
    def free_virtual_pages(self, vpages: np.ndarray) -> None:
        vpages = self._vpages(vpages, "free_virtual_pages")
        if not len(vpages):
            return
        self._bound(self._owner, vpages, "free_virtual_pages")
        if self._checked:
            self._not_rows_own(vpages, "free_virtual_pages")
        self.allocator.free_virtual_pages(vpages)

    @_operation
    def free_window_rows(self, sub_pool: str, vpages: np.ndarray) -> None:
        pool = self._window(sub_pool)
        vpages = self._vpages(vpages, "free_window_rows")
        self._bound(pool.name, vpages, "free_window_rows")
        if self._checked:
            self._not_rows_own(vpages, "free_window_rows")  # `advance` retires a row's window pages
        self.allocator.free_window_rows(pool.name, vpages)

    @_operation
    def rehome_window(self, sub_pool: str, src: np.ndarray, dst: np.ndarray) -> None:
        pool = self._window(sub_pool)
        src = self._vpages(src, "rehome_window sources")
        dst = self._vpages(dst, "rehome_window targets")
        boundary.same_count(src, dst, "rehome_window sources and targets")
        # the targets are pages the owner binds and no row in use owns: rows the window binds under
        # any other id would never be freed
        self._bound(self._owner, dst, "rehome_window targets")
        if self._checked:
            self._not_rows_own(dst, "rehome_window targets")
        self.allocator.rehome_window(pool.name, src, dst)

    @_operation
    def bind_window(self, sub_pool: str, vpages: np.ndarray, physical: np.ndarray) -> None:
        pool = self._window(sub_pool)
        vpages = self._vpages(vpages, "bind_window pages")
        physical = boundary.id_array(physical, "bind_window physical pages")
        boundary.same_count(vpages, physical, "bind_window pages and physical pages")
        boundary.in_range(physical, 0, self.arena.layout.grids[pool.index].n_grid, "bind_window physical pages")
        boundary.distinct(physical, "bind_window physical pages")
        self._bound(self._owner, vpages, "bind_window pages")
        self.allocator.bind_window(pool.name, vpages, physical)

    # -- the overlap scheduler's hooks ------------------------------------------------------------

    def forward_launched(self, has_forward: bool = True) -> LaunchRecord:
        boundary.of_type(has_forward, (bool, np.bool_), "has_forward")
        return self.allocator.forward_launched(has_forward)

    def order_forward_after_schedule(self) -> None:
        self.allocator.order_forward_after_schedule()

    @_operation
    def record_forward(
        self,
        record: LaunchRecord,
        done: Event,
        writes: IterationIds | None,
        shared_read_done: Event | None = None,
    ) -> None:
        boundary.of_type(record, LaunchRecord, "record_forward record")
        boundary.of_type(done, Event, "record_forward done")
        if writes is not None:
            boundary.of_type(writes, IterationIds, "record_forward writes")
            if set(writes.locs) != {p.name for p in self.plan.sub_pools if p.kind is not PoolKind.STATE}:
                raise InputError(f"record_forward writes name sub-pools {sorted(writes.locs)}, not this pool's")
        if shared_read_done is not None:
            boundary.of_type(shared_read_done, Event, "record_forward shared_read_done")
        if env.get("KVCHAIN_CHECK_KV_PAGE_INVARIANTS"):  # CHK-18: request lengths, every busy iteration
            problems = self.table.check_lengths()
            if problems:
                raise InvariantError("requests.length_bounds", "; ".join(problems))
        written = None
        if writes is not None:  # the pages each band's forward writes, in chain order
            ps = self.page_size
            slots = writes.state_slots
            written = [(None if slots is None else slots[slots >= 0]) if pool.kind is PoolKind.STATE
                       else writes.locs[pool.name] // ps for pool in self.plan.sub_pools]
        self.allocator.record_forward(record, done, written, shared_read_done)

    def apply_war_barrier(self) -> None:
        self.allocator.apply_war_barrier()

    @_operation
    def forward_processed(self, record: LaunchRecord) -> None:
        boundary.of_type(record, LaunchRecord, "forward_processed record")
        self.allocator.forward_processed(record)

    def reset_new_rows(self) -> np.ndarray:
        return self.table.resets.take()

    def _check_flush(self, max_moves) -> int | None:
        if max_moves is None or not self._checked:
            return max_moves
        return boundary.count(max_moves, "flush_opportunistic max_moves")

    @_operation
    def flush_opportunistic(self, max_moves: int | None = None) -> int:
        # `None` (no limit) is the only value with nothing to check: the check runs on every other
        return self.allocator.flush_opportunistic(None if max_moves is None else self._check_flush(max_moves))

    # -- host tier --------------------------------------------------------------------------------

    @_operation
    def alloc_load(self, sub_pool: str, n: int) -> tuple[np.ndarray, PageUse]:
        self.plan.by_name(boundary.name(sub_pool))
        if boundary.index(n, f"{sub_pool}: a load's page count") < 0:
            raise InputError(f"{sub_pool}: a load of {n} pages")
        return self.allocator.alloc_load(sub_pool, int(n))

    @_operation
    def end_load_reservations(self, sub_pool: str, reservation: PageUse) -> None:
        self.plan.by_name(boundary.name(sub_pool))
        boundary.of_type(reservation, PageUse, "end_load_reservations reservation")
        self.allocator.end_load_reservation(sub_pool, reservation)

    @_operation
    def bind_loaded(self, sub_pool: str, physical: np.ndarray) -> np.ndarray:
        pool = self.plan.by_name(boundary.name(sub_pool))
        if pool.kind is PoolKind.WINDOW:
            raise InputError(f"{pool.name}: a load's window rows are named by owner ids (bind_window), not bound fresh")
        physical = boundary.id_array(physical, f"{pool.name} loaded pages")
        boundary.in_range(physical, 0, self.arena.layout.grids[pool.index].n_grid, f"{pool.name} loaded pages")
        boundary.distinct(physical, f"{pool.name} loaded pages")
        return self.allocator.bind_loaded(pool.name, physical)

    @_operation
    def record_host_transfer(self, name: str, writes: bool, pages: dict[str, np.ndarray], done: Event) -> HostTransfer:
        pages = self._physical(pages)
        transfer = HostTransfer(boundary.name(name, "record_host_transfer name"), bool(boundary.of_type(writes, (bool, np.bool_), "writes")),
                                boundary.of_type(done, Event, "record_host_transfer done"))
        self.allocator.record_host_transfer(transfer, pages)
        return transfer

    @_operation
    def end_host_transfer(self, transfer: HostTransfer) -> None:
        boundary.of_type(transfer, HostTransfer, "end_host_transfer transfer")
        self.allocator.end_transfer(transfer)

    # -- PD transfers -----------------------------------------------------------------------------

    @_operation
    def record_network_transfer(self, transfer: NetworkTransfer, pages: dict[str, np.ndarray]) -> None:
        boundary.of_type(transfer, NetworkTransfer, "record_network_transfer transfer")
        self.allocator.record_network_transfer(transfer, self._physical(pages))

    @_operation
    def end_network_transfer(self, transfer: NetworkTransfer) -> None:
        boundary.of_type(transfer, NetworkTransfer, "end_network_transfer transfer")
        self.allocator.end_transfer(transfer)

    @_operation
    def hold_receive_rows(self, name: str, pages: dict[str, np.ndarray]) -> ReceiveHold:
        name = boundary.name(name, "hold_receive_rows name")
        pages = self._physical(pages)
        for key, ids in pages.items():
            boundary.distinct(ids, f"hold_receive_rows {key} pages")
        return ReceiveHold(name, self.allocator.hold_rows(pages))

    def published(self, hold: ReceiveHold) -> None:
        boundary.of_type(hold, ReceiveHold, "published hold")
        if hold.published:
            return
        hold.published = True
        self.allocator.release_rows(hold.pages)

    # -- translation ------------------------------------------------------------------------------

    @property
    def device(self) -> Device:
        return self.allocator.device

    @property
    def move_epoch(self) -> int:
        return self.allocator.move_epoch

    def view(self, name: str) -> SubPoolView:
        boundary.name(name)
        try:
            return self.views[name]
        except KeyError:
            raise InputError(f"no sub-pool {name!r} in this plan (sub-pools {list(self.views)})") from None

    def _check_iteration_ids(self, virtual_tokens, rows) -> tuple[np.ndarray, np.ndarray | None]:
        """Token ids inside the id space (or the ids the pool wrote last) and rows to read."""
        if not self._checked:
            return virtual_tokens, rows
        if not (type(virtual_tokens) is np.ndarray and virtual_tokens.dtype is INT64 and virtual_tokens.ndim == 1):
            virtual_tokens = boundary.id_array(virtual_tokens, "iteration_ids tokens")
        if virtual_tokens.tobytes() != self._tokens_written:
            boundary.in_range(virtual_tokens, 0, self._n_virtual * self.page_size, "iteration_ids tokens")
        if rows is None:
            return virtual_tokens, None
        if self._passed_last(rows):
            return virtual_tokens, rows
        return virtual_tokens, self._any_rows(rows, "iteration_ids")

    def iteration_ids(self, virtual_tokens: np.ndarray, rows: np.ndarray | None = None) -> IterationIds:
        virtual_tokens, rows = self._check_iteration_ids(virtual_tokens, rows)
        slots = None if rows is None else self.table.state_slot[rows]
        return IterationIds.translate(self.allocator, virtual_tokens, slots)

    def _check_runner_ids(self, rows) -> np.ndarray:
        if not self._checked or self._passed_last(rows):
            return rows
        return self._any_rows(rows, "runner_ids")

    def runner_ids(self, rows: np.ndarray) -> RunnerIds:
        return RunnerIds.translate(self.allocator, self.table, self._check_runner_ids(rows))

    def _any_rows(self, rows, what: str) -> np.ndarray:
        """Rows to read, inside the table, repeats allowed (or bytes that passed before)."""
        if type(rows) is not np.ndarray or rows.dtype is not INT64 or rows.ndim != 1:  # `boundary.is_ids`, inlined
            rows = boundary.id_array(rows, f"{what} rows")
        key = rows.tobytes()
        if key != self._rows_once and key != self._rows_inside:
            if boundary.outside(rows, self.table.rows):
                raise _unknown_rows(self.table, rows)
            self._rows_inside = key
        return rows

    def physical_pages(self, sub_pool: str, virtual: np.ndarray) -> np.ndarray:
        pool = self.plan.by_name(boundary.name(sub_pool))
        virtual = boundary.id_array(virtual, f"{sub_pool} ids")
        boundary.in_range(virtual, 0, self._n_slots if pool.kind is PoolKind.STATE else self._n_virtual,
                          f"{sub_pool} ids")
        return self.allocator.physical_pages(sub_pool, virtual)

    # -- inspection -------------------------------------------------------------------------------

    def stats(self) -> StorageStats:
        counts = self.allocator.band_counts()
        return StorageStats(
            live_pages={name: c["live"] for name, c in counts.items()},
            hole_pages={name: c["holes"] for name, c in counts.items()},
            pending_pages={name: c["pending"] for name, c in counts.items()},
            span_pages={name: c["span"] for name, c in counts.items()},
            live_bytes=sum(c["live"] * c["page_bytes"] for c in counts.values()),
            chain_bytes=self.arena.layout.chain_bytes,
            active_rows=int(self.table.active.sum()),
            moves=sum(c["moves"] for c in counts.values()),
            relocations=self.allocator.relocations,
        )

    def expected_live_pages(self) -> dict[str, int]:
        table = self.table
        rows = np.flatnonzero(table.active)
        return self.allocator.pages_accounted_for(table.own_pages(rows), int((table.state_slot[rows] != NO_SLOT).sum()))

    def check_idle(self, held: dict[str, int] | None = None) -> None:
        if held is not None:
            if not isinstance(held, dict):
                raise InputError(f"check_idle held must be a dict of sub-pool name to pages, got {type(held).__name__}")
            for key, n in held.items():
                self.plan.by_name(boundary.name(key))
                boundary.count(n, f"check_idle held {key} pages")
        chain = self.allocator
        chain.check_idle()
        expected = self.expected_live_pages()
        problems = []
        for name, counts in chain.band_counts().items():
            want = expected[name] + (held or {}).get(name, 0)
            if counts["live"] != want:
                problems.append(f"{name}: {counts['live']} live pages, rows and holders account for {want}")
        problems += self.table.check_rows()
        if problems:
            if env.get("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"):
                raise InvariantError("storage.idle_leak", "; ".join(problems))
            log.warning("storage.idle_leak: %s", "; ".join(problems))  # CHK-17: warn when not strict
        chain.verify_byte_accounting()


__all__ = ["KVStorage", "StorageStats", "pages_for"]
