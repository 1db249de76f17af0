"""`KVStorage`: the one interface a scheduler (and the prefix tree, host tier and PD) uses.

It allocates for extends and decodes, frees requests, hands out and copies state slots, translates
ids once per iteration, gives kernels their views, and reports stats. Every allocation goes through
the `ChainAllocator` as one chain take, priced exactly."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from . import env, faults
from .alloc import invariants
from .alloc.chain import ChainAllocator
from .alloc.forward_steps import LaunchRecord
from .alloc.id_space import UNBOUND
from .alloc.invariants import check_windows_released
from .alloc.iteration_ids import IterationIds
from .alloc.page_usage import Hazard, PageUse
from .alloc.runner_ids import RunnerIds
from .alloc.signals import HostTransfer, NetworkTransfer, ReceiveHold
from .device.base import Device, Event, PageAccess
from .errors import CapacityError, InputError, InvariantError
from .layout.views import SubPoolView
from .memory.arena import KVArena
from .plan import KVStoragePlan, PoolKind
from .requests import NO_SLOT, RequestTable, expand_runs
from .routed_cache import RoutedKVCache
from .sizing import PlanSizing, pages_for


@dataclass(frozen=True)
class StorageStats:
    live_pages: dict[str, int]
    hole_pages: dict[str, int]
    pending_pages: dict[str, int]
    span_pages: dict[str, int]
    live_bytes: int
    chain_bytes: int
    active_rows: int
    moves: int

    @property
    def utilisation(self) -> float:
        return self.live_bytes / max(1, self.chain_bytes)


log = logging.getLogger("kvchain.storage")

def _operation(fn):
    """Run a KVStorage method as one allocator operation."""

    def wrapper(self, *args, **kwargs):
        pinned = invariants.begin_operation()  # `allocator_operation`, inlined: this wraps the hot path
        try:
            return fn(self, *args, **kwargs)
        finally:
            invariants.end_operation(pinned)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


class KVStorage:
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

    @property
    def device(self) -> Device:
        return self.allocator.device

    @property
    def move_epoch(self) -> int:
        """Moves since start: a reader of physical ids re-reads them when this changed (PD-17)."""
        return self.allocator.move_epoch

    def view(self, name: str) -> SubPoolView:
        return self.views[name]

    # -- rows -----------------------------------------------------------------------------------

    def alloc_row(self) -> int:
        return self.table.alloc_row()

    def seq_len(self, row: int) -> int:
        return int(self.table.seq_lens[row])

    # -- allocation ----------------------------------------------------------------------------------

    @_operation
    def alloc_extend(self, rows: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
        """Grow each row to its new length in one chain take; returns the virtual token ids written
        (row by row, positions in order). Rows without a state slot get one in the same take.
        Raises CapacityError with nothing changed when the arena cannot serve it."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        new_lens = np.asarray(new_lens, dtype=np.int64).reshape(-1)
        table = self.table
        if len(rows) != len(new_lens):
            raise InputError(f"{len(rows)} rows but {len(new_lens)} lengths")
        if not table.active[rows].all() or (
            invariants.level() and len(rows) > 1 and np.bincount(rows).max() > 1
        ):
            raise InputError("alloc_extend needs distinct rows that are in use")
        old_lens = table.seq_lens[rows]
        if new_lens.min(initial=0) < 0 or (new_lens - old_lens).min(initial=0) < 0 or (
            new_lens.max(initial=0) > table.context_len
        ):
            raise InputError(f"new lengths must lie in [current length, {table.context_len}]")
        ps = self.page_size
        old_pages = (old_lens + ps - 1) // ps
        counts = (new_lens + ps - 1) // ps - old_pages
        n = int(counts.sum())
        need_slot = rows[table.state_slot[rows] == NO_SLOT] if self.allocator.state_band is not None else rows[:0]
        if n or len(need_slot):
            row_idx, col = expand_runs(rows, old_pages, counts)
            self._take_rows_pages(row_idx, col, need_slot)
        table.seq_lens[rows] = new_lens
        return self._written_tokens(rows, old_lens, new_lens)

    def _take_rows_pages(self, row_idx: np.ndarray, col: np.ndarray, need_slot: np.ndarray) -> None:
        """One chain take: a page for each (row, page column) pair and a state slot for each row in
        `need_slot`, bound and entered in the request table. Raises CapacityError with nothing
        changed."""
        table = self.table
        chain = self.allocator
        state = chain.state_band
        n = len(row_idx)
        if n > len(chain.virtual_free):
            raise CapacityError(f"owner has {len(chain.virtual_free)} free virtual pages, {n} needed")
        if len(need_slot) > len(chain.slot_free):
            raise CapacityError(f"state sub-pool has {len(chain.slot_free)} free slot ids, {len(need_slot)} needed")
        demand = [n] * len(chain.bands)
        if state is not None:
            demand[state.index] = len(need_slot)
        physical = chain.take(demand)
        if n:
            vpages = chain.virtual_free.pop(n)
            for band in chain.token_bands:
                band.bind(vpages, physical[band.index])
            table.page_table[row_idx, col] = vpages
        if len(need_slot):
            slots = chain.slot_free.pop(len(need_slot))
            state.bind(slots, physical[state.index])
            table.state_slot[need_slot] = slots

    def _written_tokens(self, rows: np.ndarray, old_lens: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
        counts = new_lens - old_lens
        ps = self.page_size
        if (counts == 1).all():  # decode
            return self.table.page_table[rows, old_lens // ps] * ps + old_lens % ps
        row_idx, pos = expand_runs(rows, old_lens, counts)
        return self.table.page_table[row_idx, pos // ps] * ps + pos % ps

    @_operation
    def alloc_decode(self, rows: np.ndarray) -> np.ndarray:
        """One more token for each row: `alloc_extend` by one, with the checks a one-token step
        needs and no more (the hot path of every decode step)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        table = self.table
        old_lens = table.seq_lens[rows]
        if not table.active[rows].all() or (invariants.level() and len(rows) > 1 and np.bincount(rows).max() > 1):
            raise InputError("alloc_decode needs distinct rows that are in use")
        if len(rows) and old_lens.max() >= table.context_len:
            raise InputError(f"a row is at the context length {table.context_len}")
        ps = self.page_size
        col = old_lens // ps
        offset = old_lens - col * ps
        grown = offset == 0  # the next token starts a page
        need_slot = rows[table.state_slot[rows] == NO_SLOT] if self.allocator.state_band is not None else rows[:0]
        if len(need_slot) or grown.any():
            self._take_rows_pages(rows[grown], col[grown], need_slot)
        table.seq_lens[rows] = old_lens + 1
        written = table.page_table[rows, col]
        written *= ps
        written += offset
        return written

    @_operation
    def advance(self, rows: np.ndarray, checkpoints: np.ndarray | None = None) -> int:
        """After a forward: retire the window rows that fell out of each window (WIN-1), never past
        the window behind each row's latest checkpoint when `checkpoints` are given (WIN-11)."""
        from .advance import retire_window_rows

        return retire_window_rows(self, rows, checkpoints)

    @_operation
    @_operation
    def assign_prefix(self, row: int, vpages: np.ndarray, length: int, window_lo: np.ndarray) -> None:
        """Start a row on a prefix the tree owns: `vpages` hold its first `length` tokens (whole
        pages); `window_lo` per window band is the first of them the window still binds."""
        table = self.table
        if table.seq_lens[row] or not table.active[row]:
            raise InvariantError("requests.row_state", f"row {row} must be fresh to take a prefix")
        n = len(vpages)
        if length != n * self.page_size:
            raise InputError(f"a shared prefix is whole pages: {length} tokens in {n} pages")
        table.page_table[row, :n] = vpages
        table.seq_lens[row] = length
        table.shared_pages[row] = n
        table.window_lo[row] = window_lo

    def release_to_tree(self, row: int, n_pages: int) -> None:
        """The tree took ownership of the row's first `n_pages` pages (an insert): the row no longer
        frees them."""
        table = self.table
        table.shared_pages[row] = max(int(table.shared_pages[row]), n_pages)

    @_operation
    def rehome_window(self, sub_pool: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Move window rows bound to virtual pages `src` onto virtual pages `dst` (unbound there),
        without allocating or copying: the physical pages stay, their owner ids change (WIN-7)."""
        band = self.allocator.bands[self.plan.by_name(sub_pool).index]
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        physical = band.ids.v2p[src]
        if (physical < 0).any() or (band.ids.v2p[dst] >= 0).any():
            raise InvariantError("chain.window_segment_bound", f"{sub_pool}: rehome needs bound sources and free targets")
        band.ids.unbind_physical(physical)
        band.ids.bind(dst, physical)

    @_operation
    def bind_window(self, sub_pool: str, vpages: np.ndarray, physical: np.ndarray) -> None:
        """Bind live window pages (a host-tier load's, say) to owner virtual pages (WIN-7)."""
        band = self.allocator.bands[self.plan.by_name(sub_pool).index]
        band.bind(np.asarray(vpages, dtype=np.int64), np.asarray(physical, dtype=np.int64))

    @_operation
    def free_rows(self, rows: np.ndarray) -> None:
        """End requests: windows release their rows first, then the owner, then state slots."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if not len(rows):
            return
        table = self.table
        if not table.active[rows].all():
            raise InvariantError("requests.row_state", f"free of rows not in use {rows[~table.active[rows]].tolist()}")
        self._free_virtual_pages(table.own_pages(rows))  # a tree-shared prefix stays with the tree
        slots = table.state_slot[rows]
        self._free_state_slots(slots[slots != NO_SLOT])
        table.release_rows(rows)

    @_operation
    def free_virtual_pages(self, vpages: np.ndarray) -> None:
        """Release virtual pages: each window frees what it still binds, then the owner frees all."""
        self._free_virtual_pages(np.asarray(vpages, dtype=np.int64))

    def _free_virtual_pages(self, vpages: np.ndarray) -> None:
        chain = self.allocator
        if not len(vpages):
            return
        for band in chain.window_bands:
            bound = vpages[band.ids.v2p[vpages] != UNBOUND]
            chain.free_virtual(band, bound)
        check_windows_released(chain, vpages)
        chain.free_virtual(chain.owner, vpages)
        chain.virtual_free.push(vpages)

    @_operation
    def free_window_rows(self, sub_pool: str, vpages: np.ndarray) -> None:
        """Free one window's rows of owner pages the caller keeps (the prefix tree evicting a
        node's window rows alone, WIN-5); the owner pages stay bound."""
        band = self.allocator.bands[self.plan.by_name(sub_pool).index]
        self.allocator.free_virtual(band, np.asarray(vpages, dtype=np.int64))

    # -- state slots ---------------------------------------------------------------------------------

    @_operation
    def alloc_state_slots(self, n: int) -> np.ndarray:
        """`n` state slots (virtual slot ids), e.g. checkpoint tracking slots."""
        chain = self.allocator
        if chain.state_band is None:
            raise InputError("this plan has no state sub-pool")
        if n > len(chain.slot_free):
            raise CapacityError(f"state sub-pool has {len(chain.slot_free)} free slot ids, {n} needed")
        demand = [0] * len(chain.bands)
        demand[chain.state_band.index] = n
        physical = chain.take(demand)[chain.state_band.index]
        slots = chain.slot_free.pop(n)
        chain.state_band.bind(slots, physical)
        return slots

    @_operation
    def free_state_slots(self, slots: np.ndarray) -> None:
        self._free_state_slots(np.asarray(slots, dtype=np.int64))

    def _free_state_slots(self, slots: np.ndarray) -> None:
        chain = self.allocator
        if not len(slots):
            return
        chain.free_virtual(chain.state_band, slots)
        chain.slot_free.push(slots)

    @_operation
    def copy_state(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Copy state slots on the schedule stream (a checkpoint, a fork). Like a move, the copy
        first waits every unfinished writer of its sources (a forward in flight, a host load, a
        network receive) and clears what the ledger records on its destinations (LEDG-14..17)."""
        band = self.allocator.state_band
        src = band.ids.v2p[np.asarray(src_slots, dtype=np.int64)]
        dst = band.ids.v2p[np.asarray(dst_slots, dtype=np.int64)]
        if (src < 0).any() or (dst < 0).any():
            raise InvariantError("band.free_of_bound_page", "state copy names an unbound slot")
        self.allocator.copy_state(src, dst)

    # -- translation -----------------------------------------------------------------------------------

    def iteration_ids(self, virtual_tokens: np.ndarray, rows: np.ndarray | None = None) -> IterationIds:
        slots = None if rows is None else self.table.state_slot[np.asarray(rows, dtype=np.int64)]
        return IterationIds.translate(self.allocator, virtual_tokens, slots)

    def runner_ids(self, rows: np.ndarray) -> RunnerIds:
        return RunnerIds.translate(self.allocator, self.table, rows)

    def page_access(self, sub_pool: str, physical: np.ndarray) -> PageAccess:
        return PageAccess(self.plan.by_name(sub_pool).index, physical)

    # -- the overlap scheduler's hooks ------------------------------------------------------------------

    def forward_launched(self, has_forward: bool = True) -> LaunchRecord:
        """`Scheduler._on_step_launch` (LIFE-21). A step without a forward of its own records no
        event and advances nothing (LIFE-35)."""
        return self.allocator.forward_steps.forward_launched(has_forward)

    def order_forward_after_schedule(self) -> None:
        """The forward stream waits the schedule stream, so the next forward follows every zeroing,
        move and state copy queued before it (CLEARANCE: FORWARD needs no wait of its own)."""
        device = self.device
        device.stream_wait(device.forward_stream, device.record(device.schedule_stream, "schedule"))

    @_operation
    def record_forward(
        self,
        record: LaunchRecord,
        done: Event,
        writes: IterationIds | None,
        shared_read_done: Event | None = None,
    ) -> None:
        """`Scheduler._record_unified_forward` (LIFE-22): the forward's `done` event and the ids it
        writes (`writes=None` for a speculative step: unknown, LIFE-36), then `forward_recorded`.
        `shared_read_done` fires once the forward's shared reads (metadata, KV pages) are over: the
        write-after-read barrier waits it."""
        chain = self.allocator
        if env.get("KVCHAIN_CHECK_KV_PAGE_INVARIANTS"):  # CHK-18: request lengths, every busy iteration
            problems = self.table.check_lengths()
            if problems:
                raise InvariantError("requests.length_bounds", "; ".join(problems))
        chain.forward_steps.forward_recorded(record, done, writes_known=writes is not None)
        record.shared_read_done = shared_read_done
        ps = self.page_size
        for band in chain.bands:
            if writes is None:
                band.set_inflight_forward(record.step, done, None)
            elif band.pool.kind is PoolKind.STATE:
                if writes.state_slots is not None:
                    band.set_inflight_forward(record.step, done, writes.state_slots[writes.state_slots >= 0])
            else:
                band.set_inflight_forward(record.step, done, writes.locs[band.name] // ps)

    def apply_war_barrier(self) -> None:
        """`Scheduler._apply_war_barrier` (LIFE-4/5/6): after each launch and before the previous
        result is processed, the schedule stream waits the running forward's shared-read end, or
        the whole forward stream when it declared none."""
        if faults.ACTIVE and faults.active(faults.SKIP_WAR_BARRIER):
            return
        device = self.device
        running = self.allocator.forward_steps.newest_unprocessed()
        event = getattr(running, "shared_read_done", None) if running is not None else None
        if event is None:
            event = device.record(device.forward_stream, "war barrier")
        device.stream_wait(device.schedule_stream, event)

    @_operation
    def forward_processed(self, record: LaunchRecord) -> None:
        """`Scheduler._on_step_processed` (LIFE-23), after the result processor synchronized a
        completion that covers the forward (LIFE-28)."""
        self.allocator.forward_processed(record)

    def reset_new_rows(self) -> np.ndarray:
        """Rows handed out since the last forward: the next forward resets their request state on
        its own stream before its kernels (LIFE-18)."""
        return self.table.resets.take()

    # -- host tier and PD: the allocator side -------------------------------------------------------------

    def physical_pages(self, sub_pool: str, virtual: np.ndarray) -> np.ndarray:
        """Translate virtual page ids (slot ids for state) at submission time (HIC-7)."""
        band = self.allocator.bands[self.plan.by_name(sub_pool).index]
        physical = band.ids.v2p[np.asarray(virtual, dtype=np.int64)]
        if (physical < 0).any():
            raise InvariantError("band.free_of_bound_page", f"{sub_pool}: translation of unbound ids")
        return physical

    @_operation
    def alloc_load(self, sub_pool: str, n: int) -> tuple[np.ndarray, PageUse]:
        """Physical pages for a host-tier load into `sub_pool`, fixed under a load reservation
        (HIC-4/5). Returns the pages and the reservation to end."""
        band = self.allocator.bands[self.plan.by_name(sub_pool).index]
        return self.allocator.take_for_load(band, n)

    @_operation
    def end_load_reservations(self, sub_pool: str, reservation: PageUse) -> None:
        """End a load reservation: the pages may move again (HIC-6, HIC-8)."""
        self.allocator.bands[self.plan.by_name(sub_pool).index].unfix(reservation)

    @_operation
    def record_host_transfer(self, name: str, writes: bool, pages: dict[str, np.ndarray], done: Event) -> HostTransfer:
        """A host-tier copy of physical `pages` per sub-pool: a backup reads them (COPY_READ), a
        load writes them (COPY_WRITE). It ends at `end_host_transfer`; until then the next writer of
        its pages waits `done` on its stream (LEDG-3, HIC-2)."""
        transfer = HostTransfer(name, writes, done)
        hazard = Hazard.COPY_WRITE if writes else Hazard.COPY_READ
        for pool_name, ids in pages.items():
            band = self.allocator.bands[self.plan.by_name(pool_name).index]
            band.usage.record(PageUse(hazard, np.asarray(ids, dtype=np.int64), writes, event=done,
                                      transfer=transfer, label=f"{hazard.value} {name}"))
        return transfer

    @_operation
    def end_host_transfer(self, transfer: HostTransfer) -> None:
        self.allocator.end_transfer(transfer)

    @_operation
    def record_network_transfer(self, transfer: NetworkTransfer, pages: dict[str, np.ndarray]) -> None:
        """A PD send (reads `pages`) or receive (writes them): one NETWORK use per band (PD-1)."""
        for pool_name, ids in pages.items():
            band = self.allocator.bands[self.plan.by_name(pool_name).index]
            band.usage.record(PageUse(Hazard.NETWORK, np.asarray(ids, dtype=np.int64), writes=not transfer.sends,
                                      event=transfer.done, transfer=transfer, label=repr(transfer)))
            band.epoch.bump()

    @_operation
    def end_network_transfer(self, transfer: NetworkTransfer) -> None:
        """The transfer released its pages (LEDG-4): vacated pages it alone held return to use."""
        self.allocator.end_transfer(transfer)

    @_operation
    def hold_receive_rows(self, name: str, pages: dict[str, np.ndarray]) -> ReceiveHold:
        """Hold a request's receive rows until their physical ids are published (PD-8)."""
        hold = ReceiveHold(name, {})
        for pool_name, ids in pages.items():
            band = self.allocator.bands[self.plan.by_name(pool_name).index]
            ids = np.asarray(ids, dtype=np.int64)
            band.held[ids] += 1
            band.n_held += len(ids)
            hold.pages[band.index] = ids
        return hold

    def published(self, hold: ReceiveHold) -> None:
        """The held rows' ids reached the peer: compaction may move them again."""
        if hold.published:
            return
        hold.published = True
        for index, ids in hold.pages.items():
            band = self.allocator.bands[index]
            band.held[ids] -= 1
            band.n_held -= len(ids)

    # -- maintenance and stats -------------------------------------------------------------------------

    @_operation
    @_operation
    def flush_opportunistic(self, max_moves: int | None = None) -> int:
        """Close holes lazily, between steps (see `ChainAllocator.flush_opportunistic`)."""
        return self.allocator.flush_opportunistic(max_moves)

    def stats(self) -> StorageStats:
        bands = self.allocator.bands
        return StorageStats(
            live_pages={b.name: b.n_live for b in bands},
            hole_pages={b.name: b.n_holes for b in bands},
            pending_pages={b.name: b.n_pending for b in bands},
            span_pages={b.name: b.span for b in bands},
            live_bytes=sum(b.n_live * b.page_bytes for b in bands),
            chain_bytes=self.allocator.layout.chain_bytes,
            active_rows=int(self.table.active.sum()),
            moves=sum(b.stats["moves"] for b in bands),
        )

    def expected_live_pages(self) -> dict[str, int]:
        """Live pages per band that the active rows account for."""
        table = self.table
        rows = np.flatnonzero(table.active)
        vpages = table.own_pages(rows)
        out = {}
        for band in self.allocator.bands:
            if band.pool.kind is PoolKind.STATE:
                out[band.name] = int((table.state_slot[rows] != NO_SLOT).sum())
            elif band is self.allocator.owner:
                out[band.name] = len(vpages)
            else:
                out[band.name] = int(np.count_nonzero(band.ids.v2p[vpages] != UNBOUND))
        return out

    def check_idle(self, held: dict[str, int] | None = None) -> None:
        """Idle checks (CHK-15): no page pending without a forward, no leaked page per sub-pool beyond
        what rows and `held` (e.g. the prefix tree) account for, row states, byte conservation."""
        chain = self.allocator
        chain.check_idle()
        expected = self.expected_live_pages()
        problems = []
        for band in chain.bands:
            want = expected[band.name] + (held or {}).get(band.name, 0)
            if band.n_live != want:
                problems.append(f"{band.name}: {band.n_live} live pages, rows and holders account for {want}")
        problems += self.table.check_rows()
        if problems:
            if env.get("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"):
                raise InvariantError("storage.idle_leak", "; ".join(problems))
            log.warning("storage.idle_leak: %s", "; ".join(problems))  # CHK-17: warn when not strict
        chain.verify_byte_accounting()


def pages_needed(lens: np.ndarray, page_size: int) -> np.ndarray:
    return (np.asarray(lens) + page_size - 1) // page_size


__all__ = ["KVStorage", "StorageStats", "pages_for", "pages_needed"]
