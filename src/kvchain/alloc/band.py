"""`Band` (an end of the chain) and `FloatBand` (a band between the ends).

A band holds pages of its own page-byte size on its grid in the arena: a span `[lo, hi)` of grid
ids holding live pages, holes (free pages inside the span), pending pages (freed under a forward
still in flight) and vacated pages (move sources a network transfer still reads). A take
(`_acquire`) uses holes, then settles pending batches, then grows the frontier; `pricing.take_layout`
decides the growth so that pricing and takes agree exactly. A free is logical: it leaves a hole (or a
pending page) at once, with no stream wait, and holes are closed later by compaction.

Every page the band writes (hand-out zeroing, a move's destination) first clears what the band's
ledger (`PageUsage`) and the arena's fences record on it, as `CLEARANCE` says; nothing here ever
waits on the host for a forward."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from ..device.base import Event
from ..errors import CapacityError, InvariantError
from ..memory.arena import BandGrid
from ..plan import Placement, PoolKind, SubPool
from . import invariants
from .forward_steps import PendingPages
from .id_space import IdStack, UnitIds
from .page_usage import Clear, Consumer, Hazard, PageUsage, PageUse
from .pricing import BandSnap, Side, take_layout

if TYPE_CHECKING:
    from .chain import ChainAllocator


class allocator_operation:
    """One allocator operation (a take, a free, a flush, an advance): the invariant level is read
    once at its start, and the rules that hold within one operation (LIFE-41) are checked in it."""

    __slots__ = ("pinned",)

    def __enter__(self) -> None:
        self.pinned = invariants.begin_operation()

    def __exit__(self, *exc) -> None:
        invariants.end_operation(self.pinned)


class PageState(enum.IntEnum):
    OUT = 0  # outside the band's span
    LIVE = 1
    HOLE = 2
    PENDING = 3
    SINK = 4
    VACATED = 5  # a move source (or freed page) a network transfer still reads: out of use until released


OUT, LIVE, HOLE, PENDING, SINK, VACATED = (int(s) for s in PageState)


class SnapshotMode(enum.Enum):
    """How pricing sees pages that network transfers hold."""

    TAKE = "take"  # as a take finds the band: vacated pages are out of use
    HOLD_NETWORK = "hold network"  # relief's first pass: network-held rows stay in place too
    EVERY_BYTE = "every byte"  # after host waits for every transfer: vacated pages are free


class CapacityEpoch:
    """A counter that moves whenever anything a capacity answer depends on changes."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class _CapacityField:
    """A band attribute that pricing reads: every rebind moves the capacity epoch (CAP-7).

    Only `__set__` is defined, so a read finds the value in the instance dict at plain attribute
    speed, while every write still goes through here."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value
        obj.epoch.bump()


class Band:
    """An end of the chain: it grows from its end of the arena toward the other."""

    lo = _CapacityField()
    hi = _CapacityField()
    parked = _CapacityField()
    n_live = _CapacityField()
    n_holes = _CapacityField()
    n_pending = _CapacityField()
    n_fixed = _CapacityField()
    n_vacated = _CapacityField()
    n_held = _CapacityField()

    def __init__(self, pool: SubPool, grid: BandGrid, chain: ChainAllocator, n_virtual: int) -> None:
        self.pool = pool
        self.grid = grid
        self.chain = chain
        self.epoch = chain.epoch
        self.index = pool.index
        self.name = pool.name
        self.placement = pool.placement
        self.page_bytes = grid.page_bytes
        self.zero_on_handout = pool.kind is not PoolKind.STATE
        n = grid.n_grid
        self.state = np.zeros(n, dtype=np.uint8)
        if grid.sink_id is not None:
            self.state[grid.sink_id] = SINK
        self.fixed_mask = np.zeros(n, dtype=bool)
        self.held = np.zeros(n, dtype=np.int32)  # receive holds awaiting publication, per page
        self.holes = IdStack(n)
        self.ids = UnitIds(n_virtual, n, grid.sink_id)
        self.pending = PendingPages()
        self.usage = PageUsage(n)
        self.stats = {"moves": 0, "flushes": 0, "settled_batches": 0, "zeroed_pages": 0, "stream_waits": 0}
        self.n_live = 0
        self.n_holes = 0
        self.n_pending = 0
        self.n_fixed = 0
        self.n_vacated = 0
        self.n_held = 0
        self.parked = False
        if self.placement is Placement.DOWN_END:
            self.lo = self.hi = n
        else:
            self.lo = self.hi = grid.first_id

    # -- views of state ---------------------------------------------------------------------

    def __repr__(self) -> str:
        span = "parked" if self.parked else f"[{self.lo}, {self.hi})"
        return (f"{type(self).__name__}({self.name} {span} live={self.n_live} holes={self.n_holes} "
                f"pending={self.n_pending} fixed={self.n_fixed} vacated={self.n_vacated})")

    @property
    def bottom(self) -> int:
        return self.grid.origin + self.lo * self.page_bytes

    @property
    def top(self) -> int:
        return self.grid.origin + self.hi * self.page_bytes

    @property
    def span(self) -> int:
        return 0 if self.parked else self.hi - self.lo

    def byte_ranges(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start = self.grid.origin + np.asarray(ids, dtype=np.int64) * self.page_bytes
        return start, start + self.page_bytes

    def _network_held(self) -> np.ndarray:
        """Live pages a network transfer uses or a receive hold keeps (grid ids)."""
        if self.parked:
            return np.empty(0, dtype=np.int64)
        pages = [u.pages for u in self.usage.uses if u.hazard is Hazard.NETWORK]
        if self.n_held:
            pages.append(np.flatnonzero(self.held))
        if not pages:
            return np.empty(0, dtype=np.int64)
        ids = np.unique(np.concatenate(pages))
        return ids[self.state[ids] == LIVE]

    def _immovable(self, mode: SnapshotMode) -> np.ndarray:
        """Grid ids that stay where they are under `mode`: fixed pages, vacated pages, and in relief's
        first pass the rows network transfers hold."""
        parts = []
        if self.n_fixed:
            parts.append(np.flatnonzero(self.fixed_mask))
        if self.n_vacated and mode is not SnapshotMode.EVERY_BYTE:
            parts.append(np.flatnonzero(self.state == VACATED))
        if mode is SnapshotMode.HOLD_NETWORK:
            parts.append(self._network_held())
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(parts))

    def snapshot(self, mode: SnapshotMode = SnapshotMode.TAKE) -> BandSnap:
        """Counts and frontiers only, never hole positions (CAP-4). Fixed pages, vacated pages and
        (under HOLD_NETWORK) network-held rows count as immovable; only their farthest position
        from the band's base matters, for how far a compaction can pack it."""
        parked = self.parked
        live, fixed, pending = self.n_live, self.n_fixed, self.n_pending
        fixed_far = 0
        if self.n_vacated:
            if mode is SnapshotMode.EVERY_BYTE:
                pending += self.n_vacated
            else:
                fixed += self.n_vacated
        if mode is SnapshotMode.HOLD_NETWORK and (self.n_held or self.usage.uses):
            held = self._network_held()
            held = held[~self.fixed_mask[held]]
            live -= len(held)
            fixed += len(held)
        if fixed and not parked:
            immovable = self._immovable(mode)
            if len(immovable):
                if self.placement is Placement.DOWN_END:
                    fixed_far = self.hi - int(immovable.min())
                else:
                    fixed_far = int(immovable.max()) - self.lo + 1
        return BandSnap(
            self.index, self.placement, self.page_bytes, self.grid.origin, self.grid.first_id, self.grid.n_grid,
            -1 if parked else self.lo, -1 if parked else self.hi, parked, live, self.n_holes,
            pending, fixed, fixed_far, fixed > 0,
        )

    # -- waits --------------------------------------------------------------------------------

    def _stream_wait(self, event: Event, why: str) -> None:
        """Queue a wait on the schedule stream: the host never blocks (LIFE-29)."""
        invariants.before_wait()
        device = self.chain.device
        device.stream_wait(device.schedule_stream, event)
        self.stats["stream_waits"] += 1
        self.chain.log("stream_wait", self.name, why, event.label)

    def _drain_pending_reuse(self, consumer: Consumer, ids: np.ndarray) -> None:
        """Before pages are written again, make the schedule stream clear every hazard the ledger
        still records on them (a fenced hole's host copy, a vacated source's forward), by the
        CLEARANCE rule (LEDG-9); what the pages need is read only now, after they were chosen
        (LEDG-32)."""
        waited: set[int] = set()
        for wait in self.usage.clearance(consumer, ids):
            self._apply(wait.clear, wait.use, waited, consumer)

    def _apply(self, clear: Clear, use: PageUse, waited: set[int], consumer: Consumer) -> None:
        if clear is Clear.STREAM_WAIT:
            if use.event is not None and use.event.seq not in waited:
                waited.add(use.event.seq)
                self._stream_wait(use.event, f"{consumer.value} clears {use.hazard.value}")
        elif clear is Clear.HOST_WAIT:
            self.chain.wait_transfers([use.transfer])
        elif clear is Clear.AFTER_RETIRE:
            if use.step is not None and use.step > self.chain.forward_steps.processed_through:
                raise InvariantError("page_usage.after_retire",
                                     f"{self.name}: {consumer.value} chose pages an unretired forward uses")
        elif clear is Clear.EXCLUDED:
            raise InvariantError("page_usage.excluded", f"{self.name}: {consumer.value} chose {use}")

    def _wait_fences(self, ids: np.ndarray) -> None:
        """Before writing pages whose bytes another band (or this one) left with unfinished uses,
        clear those fences (COMP-20)."""
        self.chain.wait_fences(self, ids)

    def _wait_writers(self, src: np.ndarray) -> None:
        """Before copying sources, wait every unfinished writer of them: a forward in flight, a
        host load, a network receive (COMP-17)."""
        waited: set[int] = set()
        for use in self.usage.writers_of(src):
            self._apply(Clear.HOST_WAIT if use.hazard is Hazard.NETWORK else Clear.STREAM_WAIT, use, waited,
                        Consumer.SCHEDULE_COPY)

    def clear_for_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Order a schedule-stream copy of live pages `src` onto live pages `dst` (a state copy)
        after everything the ledger says may still touch them (LEDG-14..17)."""
        self._wait_writers(src)
        self._drain_pending_reuse(Consumer.SCHEDULE_COPY, dst)

    # -- taking -----------------------------------------------------------------------------

    def _acquire(self, n: int, after: BandSnap | None = None, consumer: Consumer = Consumer.ZERO) -> np.ndarray:
        """Hand out `n` writable pages: holes, then settled pending batches, then frontier growth.

        `after` is this band's layout after the take when the caller already computed it with
        `take_layout` on the current state (a chain take's in-place plan). Every failure check
        runs before anything settles, so a refused take changes nothing (ALLOC-7)."""
        self.chain.forward_steps.assert_no_open_launch("take", self.name, n)
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        holes, pending = self.n_holes, self.n_pending
        grow = n - holes - pending if n > holes + pending else 0
        if grow and after is None:
            prev_top, next_bottom = self.chain.neighbour_bounds(self.index)
            after = take_layout(self.snapshot(), n, prev_top, next_bottom)
            if after is None:
                raise CapacityError(
                    f"{self.name}: cannot take {n} pages (holes {holes}, pending {pending}, "
                    f"span {self.span}, growth room exhausted)"
                )
        from_pending = min(max(0, n - holes), pending)
        if from_pending:
            # settled pages are taken at once: a float must not park in between
            self.settle_pending(self.pending.oldest_covering(from_pending), park=False)
        from_holes = n - grow
        ids = self._take_holes(from_holes) if from_holes else None
        if grow:
            grown = self._grow_to(after)
            self._wait_fences(grown)
            ids = grown if ids is None else np.concatenate([ids, grown])
        self.state[ids] = LIVE
        self.n_live += n
        if self.usage.uses or self.usage.unknown_writer is not None:
            self._drain_pending_reuse(consumer, ids)
        self._maybe_zero_pages(ids)
        self.chain.log("take", self.name, ids)
        return ids

    def _take_holes(self, k: int) -> np.ndarray:
        """`k` holes, those no consumer must wait for first (LEDG-31): the order reads the ledger's
        logical state only, never whether an event fired."""
        self.n_holes -= k
        if not self.usage.uses:
            return self.holes.pop(k)
        listed = self.holes.view()
        busy = self.usage.busy(listed)
        if not busy[len(listed) - k :].any():
            return self.holes.pop(k)
        order = np.concatenate([np.flatnonzero(busy), np.flatnonzero(~busy)])  # clean last: popped first
        chosen = order[len(order) - k :]
        ids = listed[chosen].copy()
        keep = np.ones(len(listed), dtype=bool)
        keep[chosen] = False
        self.holes.keep(keep)
        return ids

    def _grow_to(self, after: BandSnap) -> np.ndarray:
        """Extend the span to the planned one; the new grid ids become the taken pages."""
        if self.parked:
            ids = np.arange(after.lo, after.hi, dtype=np.int64)
            self.parked = False
            self.lo, self.hi = after.lo, after.hi
            return ids
        parts = []
        if after.lo < self.lo:
            parts.append(np.arange(after.lo, self.lo, dtype=np.int64))
            self.lo = after.lo
        if after.hi > self.hi:
            parts.append(np.arange(self.hi, after.hi, dtype=np.int64))
            self.hi = after.hi
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _maybe_zero_pages(self, ids: np.ndarray) -> None:
        """MHA and MLA pages are zeroed on hand-out (ALLOC-20): kernels load whole pages, and a stale
        NaN or a neighbour's FP32 state bytes read as BF16 would still reach the output."""
        if not self.zero_on_handout or not len(ids):
            return
        self.stats["zeroed_pages"] += len(ids)
        self.chain.copier.zero_pages(self, ids)

    def alloc_physical(self, n: int) -> tuple[np.ndarray, PageUse]:
        """Pages for a host-tier load, fixed under a load reservation until the tree names them
        (HIC-4). Settles first when the band has pending pages and its holes do not cover the load
        (HIC-5, through `_acquire`); a short band relieves through the chain (ALLOC-19)."""
        demand = [0] * len(self.chain.bands)
        demand[self.index] = n
        if not self.chain.units_fit(demand):
            raise CapacityError(f"{self.name}: no layout of the arena serves a load of {n} pages")
        if not self.chain.in_place(demand):
            self.chain.lay_out_for(demand)
        ids = self._acquire(n, consumer=Consumer.HOST_LOAD)
        return ids, self.fix(ids, "load reservation")

    def fix(self, ids: np.ndarray, label: str) -> PageUse:
        """Fix live pages in place (LEDG-6): they never move and are excluded from every consumer."""
        use = self.usage.record(PageUse(Hazard.FIXED, ids, writes=False, label=label))
        self.fixed_mask[ids] = True
        self.n_fixed += len(ids)
        return use

    def unfix(self, use: PageUse) -> None:
        """End a fixing use (LEDG-6); a page another fixing use still covers stays fixed."""
        self.usage.end(use)
        self.fixed_mask[use.pages] = False
        for other in self.usage.uses:
            if other.hazard is Hazard.FIXED:
                self.fixed_mask[other.pages] = True
        self.n_fixed = int(np.count_nonzero(self.fixed_mask))

    # -- freeing ----------------------------------------------------------------------------

    def free(self, ids: np.ndarray) -> None:
        """Logical free (LIFE-2, LIFE-3): the pages are unbound and leave at once, with no stream
        wait. Under a recorded, unprocessed forward they pend on it (LIFE-24); otherwise they become
        holes (LIFE-25). A page a network transfer still reads is vacated until it is released."""
        self.chain.forward_steps.assert_no_open_launch("free", self.name, len(ids))
        if not len(ids):
            return
        invariants.check_freed_pages(self, ids)
        self.ids.unbind_physical(ids)
        self.n_live -= len(ids)
        if self.usage.uses:
            net = self._network_used(ids)
            if net.any():
                self._vacate(ids[net])
                ids = ids[~net]
        key = self.chain.forward_steps.newest_unprocessed()
        if key is not None:
            self.state[ids] = PENDING
            self.pending.add(key.step, key.event, ids)
            self.n_pending += len(ids)
        else:
            self.state[ids] = HOLE
            self.holes.push(ids)
            self.n_holes += len(ids)
        self._after_free()

    def _network_used(self, ids: np.ndarray) -> np.ndarray:
        mask = np.zeros(len(ids), dtype=bool)
        if not self.usage.count[ids].any():
            return mask
        for use in self.usage.uses:
            if use.hazard is Hazard.NETWORK:
                mask |= np.isin(ids, use.pages)
        return mask

    def _vacate(self, ids: np.ndarray) -> None:
        self.state[ids] = VACATED
        self.n_vacated += len(ids)

    def take_ready_vacated(self) -> int:
        """Vacated pages no network transfer reads any more return to use (COMP-18): pending under
        the newest forward in flight, else holes."""
        if not self.n_vacated:
            return 0
        vacated = np.flatnonzero(self.state == VACATED)
        ready = vacated[~self._network_used(vacated)]
        if not len(ready):
            return 0
        self.n_vacated -= len(ready)
        key = self.chain.forward_steps.newest_unprocessed()
        if key is not None:
            self.state[ready] = PENDING
            self.pending.add(key.step, key.event, ready)
            self.n_pending += len(ready)
        else:
            self.state[ready] = HOLE
            self.holes.push(ready)
            self.n_holes += len(ready)
        self._after_free()
        return len(ready)

    def _after_free(self) -> None:
        pass

    def settle_pending(self, n_batches: int | None = None, park: bool = True) -> int:
        """Settle the oldest `n_batches` pending batches (all when None): the schedule stream waits
        their forwards' events; the host never blocks (LIFE-29). The forwards stay unprocessed
        (LIFE-30). Their pages become holes."""
        n = len(self.pending.batches) if n_batches is None else n_batches
        if n <= 0:
            return 0
        batches = self.pending.pop_oldest(n)
        for batch in batches:
            self._stream_wait(batch.event, f"settle pending under step {batch.key}")
        self._pending_to_holes(batches, park)
        self.stats["settled_batches"] += len(batches)
        return sum(b.size for b in batches)

    def read_ahead_for_recovery(self) -> None:
        """Urgent recovery's first half (ALLOC-11): read on the host everything the layout will read
        (free lists, pending pages, in-flight write sets, transfer pages) before any stream wait."""
        invariants.check_host_read(self, "the recovery read-ahead")

    def settle_pending_for_recovery(self) -> int:
        """Urgent recovery's second half (ALLOC-12): settle every pending batch. Recovery parks the
        floats it leaves empty itself."""
        return self.settle_pending(park=False)

    def release_pending_through(self, step: int) -> int:
        """Return every batch keyed at or before a processed forward to the holes (LIFE-27)."""
        batches = self.pending.pop_through(step)
        if batches:
            self._pending_to_holes(batches)
        return sum(b.size for b in batches)

    def _pending_to_holes(self, batches, park: bool = True) -> None:
        ids = np.concatenate([b.pages() for b in batches])
        self.state[ids] = HOLE
        self.holes.push(ids)
        self.n_pending -= len(ids)
        self.n_holes += len(ids)
        if park:
            self._after_free()

    # -- forwards -------------------------------------------------------------------------------

    def set_inflight_forward(self, step: int, event: Event, pages: np.ndarray | None) -> None:
        """Record what a forward writes here until it retires (LEDG-2). `pages` None: unknown
        (a speculative step): compaction then moves nothing in this band until it retires."""
        if pages is None:
            self.usage.unknown_writer = PageUse(Hazard.FORWARD, np.empty(0, dtype=np.int64), writes=True,
                                                event=event, step=step, label=f"unknown writes of step {step}")
        elif len(pages):
            self.usage.record(PageUse(Hazard.FORWARD, np.unique(pages), writes=True, event=event, step=step,
                                      label=f"writes of step {step}"))

    def retire_forwards_through(self, step: int) -> None:
        self.usage.end_forwards_through(step)

    # -- compaction -------------------------------------------------------------------------

    def _frontier_scan(self, wanted: int, match, stop=None) -> np.ndarray:
        """Grid ids where `match(states, ids)` holds, nearest the frontier first, scanning inward in
        chunks until `wanted` are found (or, with `stop`, until the first id where it holds): work
        in proportion to what the caller needs, not to the span."""
        found: list[np.ndarray] = []
        got = 0
        chunk = max(256, 2 * wanted)
        down = self.placement is Placement.DOWN_END
        a, b = self.lo, self.hi
        while got < wanted and a < b:
            if down:
                ids = np.arange(a, min(a + chunk, b))
                a = ids[-1] + 1
            else:
                ids = np.arange(max(b - chunk, a), b)[::-1]
                b = ids[-1]
            st = self.state[ids]
            if stop is not None:
                blocked = np.flatnonzero(stop(st, ids))
                if len(blocked):
                    ids, st = ids[: blocked[0]], st[: blocked[0]]
                    b = a  # stop scanning
            hit = ids[match(st, ids)]
            found.append(hit)
            got += len(hit)
        out = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
        return out[:wanted]

    def _forward_hazard(self, ids: np.ndarray) -> np.ndarray:
        mask = np.zeros(self.grid.n_grid, dtype=bool)
        for use in self.usage.uses:
            if use.hazard is Hazard.FORWARD:
                mask[use.pages] = True
        return mask[ids]

    def _written_in_flight(self) -> np.ndarray:
        mask = np.zeros(self.grid.n_grid, dtype=bool)
        for use in self.usage.uses:
            if use.writes:
                mask[use.pages] = True
        return mask

    def flush(self, max_moves: int | None, urgent: bool = False, hold_network: bool = False) -> int:
        """Move the live pages nearest the frontier into the holes nearest the band's base, then
        absorb the holes left at the frontier. Returns pages moved.

        Opportunistic (COMP-5..14): with pending pages it only absorbs boundary holes; it never waits
        an unretired forward and stops at a source one writes, at a fixed or vacated page; it leaves
        alone a band holding receive rows or written by a speculative forward. Urgent (relief,
        COMP-6/8/11): settled first, uncapped, waits the writers of what it moves, and steps over
        fixed pages, which never move, and over network-held rows when the relief plan kept them
        in place (`hold_network`, ALLOC-14)."""
        if self.parked or self.span == 0 or not self.n_holes:
            return 0
        moved = 0
        can_move = max_moves != 0 and not self.n_pending
        if not urgent and (self.n_held or self.usage.unknown_writer is not None):
            can_move = False
        if can_move:
            holes = self.holes.view()
            down = self.placement is Placement.DOWN_END
            k = len(holes) if max_moves is None else min(max_moves, len(holes))
            if k < len(holes):
                part = np.partition(holes, len(holes) - k if down else k - 1)
                dst = part[len(holes) - k :] if down else part[:k]
            else:
                dst = holes.copy()
            dst = np.sort(dst)[::-1] if down else np.sort(dst)
            if not urgent and self.usage.uses:
                # never wait an unretired forward: skip holes one may still read (COMP-5)
                dst = dst[~self._forward_hazard(dst)]
            fixed = self.fixed_mask
            if urgent and hold_network and (self.n_held or self.usage.uses):
                fixed = fixed.copy()
                fixed[self._network_held()] = True
            if urgent:
                src = self._frontier_scan(k, lambda st, ids: (st == LIVE) & ~fixed[ids])
            else:
                written = self._written_in_flight() if self.usage.uses else None
                blocked = (lambda st, ids: fixed[ids] | (st == VACATED) | written[ids]) if written is not None else \
                    (lambda st, ids: fixed[ids] | (st == VACATED))
                src = self._frontier_scan(k, lambda st, ids: st == LIVE, stop=blocked)
            n = min(len(src), len(dst))
            beyond = dst[:n] > src[:n] if down else dst[:n] < src[:n]
            k = int(np.count_nonzero(beyond))
            if k:
                self._commit_move_batch(src[:k].copy(), dst[:k].copy())
                moved = k
        self._absorb_boundary_holes()
        self.stats["flushes"] += 1
        return moved

    def flush_for_allocation(self, hold_network: bool = False) -> int:
        """Urgent flush for relief: settled first, uncapped, packs every movable page (COMP-8, COMP-13)."""
        invariants.geometry_ready(self)
        if self.n_pending:
            self.settle_pending()
        return self.flush(max_moves=None, urgent=True, hold_network=hold_network)

    def _absorb_boundary_holes(self) -> None:
        """Retreat the frontier over trailing holes; never over a pending, live, fixed or vacated page.
        Holes that leave with unfinished uses on them become fences in the arena (COMP-20)."""
        if self.parked or self.span == 0:
            return
        frontier = self.lo if self.placement is Placement.DOWN_END else self.hi - 1
        if self.state[frontier] != HOLE:
            return
        first_kept = self._frontier_scan(1, lambda st, ids: st != HOLE)
        if self.placement is Placement.DOWN_END:
            new_lo = int(first_kept[0]) if len(first_kept) else self.hi
            if new_lo > self.lo:
                self._drop_holes(np.arange(self.lo, new_lo))
                self.lo = new_lo
        else:
            new_hi = int(first_kept[0]) + 1 if len(first_kept) else self.lo
            if new_hi < self.hi:
                self._drop_holes(np.arange(new_hi, self.hi))
                self.hi = new_hi

    def _drop_holes(self, ids: np.ndarray) -> None:
        """Holes that leave the span: out of the band; their unfinished uses fence their bytes."""
        self.chain.fence_pages(self, ids)
        self.state[ids] = OUT
        self.holes.keep(self.state[self.holes.view()] == HOLE)
        self.n_holes -= len(ids)

    def _commit_move_batch(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy live pages `src` into holes `dst` and rebind their virtual ids (COMP-16). The copy
        first waits every writer of the sources (COMP-17) and clears the destinations. A source a
        forward in flight may still read is left a hole with that forward's hazard, which the next
        writer waits (COMP-18); one a network send reads is vacated until it is released."""
        self._wait_writers(src)
        self._drain_pending_reuse(Consumer.SCHEDULE_COPY, dst)
        self._wait_fences(dst)
        self.chain.copier.move_pages(self, src, dst)
        self.ids.rebind_physical(src, dst)
        self.state[dst] = LIVE
        self.holes.keep(self.state[self.holes.view()] == HOLE)
        self._vacate_sources(src)
        self.stats["moves"] += len(src)
        self.chain.move_epoch += 1
        self.epoch.bump()
        self.chain.log("move", self.name, src, dst)

    def _vacate_sources(self, src: np.ndarray) -> None:
        net = self._network_used(src) if self.usage.uses else np.zeros(len(src), dtype=bool)
        if net.any():
            # the destinations the move filled were counted as holes; a vacated source does not
            # give one back
            self._vacate(src[net])
            self.n_holes -= int(net.sum())
        holes = src[~net]
        self.state[holes] = HOLE
        self.holes.push(holes)
        key = self.chain.forward_steps.newest_unprocessed()
        if key is not None and len(src):
            self.usage.record(PageUse(Hazard.FORWARD, src.copy(), writes=False, event=key.event, step=key.step,
                                      vacated=True, label=f"vacated under step {key.step}"))

    def prewarm_compaction(self) -> None:
        """Run the page-copy path once at startup (COMP-25) so the first serving-time move neither
        compiles kernels nor allocates memory outside the pools: copy the sink (or the base page)
        onto itself."""
        page = self.grid.sink_id if self.grid.sink_id is not None else self.grid.first_id
        if page < self.grid.n_grid:
            ids = np.array([page], dtype=np.int64)
            self.chain.copier.move_pages(self, ids, ids, label="prewarm")

    def relieve(self, n: int) -> np.ndarray:
        """A lone band that falls short (a host-tier load's take) runs the chain's relief through
        `ChainAllocator.lay_out_for`, then takes (ALLOC-19)."""
        demand = [0] * len(self.chain.bands)
        demand[self.index] = n
        if not self.chain.lay_out_for(demand):
            raise CapacityError(f"{self.name}: no layout of the arena serves {n} more pages")
        return self._acquire(n)

    # -- ids ---------------------------------------------------------------------------------

    def bind(self, virtual: np.ndarray, physical: np.ndarray) -> None:
        self.ids.bind(virtual, physical)

    def free_virtual(self, virtual: np.ndarray) -> np.ndarray:
        """Unbind virtual ids and free the pages behind them; returns the physical ids."""
        if not len(virtual):
            return virtual
        if invariants.level():
            invariants.check_virtual_bound(self, virtual)
        physical = self.ids.v2p[virtual]
        self.free(physical)
        return physical

    def translate(self, virtual: np.ndarray) -> np.ndarray:
        """Physical page ids for virtual ones; an unbound id reads as the sink (IDS-4)."""
        return np.take(self.ids.read_map, virtual)

    # -- accounting --------------------------------------------------------------------------

    def live_pages(self) -> np.ndarray:
        if self.parked:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.state[self.lo : self.hi] == LIVE) + self.lo


class FloatBand(Band):
    """A band between the ends. It never compacts (its holes are reused where they are), moves only
    when a planned layout relocates it, and is parked (transparent to its neighbours) when it holds
    no live, fixed, pending or vacated page."""

    def __init__(self, pool: SubPool, grid: BandGrid, chain: ChainAllocator, n_virtual: int) -> None:
        super().__init__(pool, grid, chain, n_virtual)
        self.lo = self.hi = -1
        self.parked = True

    def _after_free(self) -> None:
        if not self.parked and self.n_live + self.n_pending + self.n_fixed + self.n_vacated == 0:
            self.park()

    def park(self) -> None:
        """Give the whole span back: an empty float is transparent (COMP-24)."""
        if self.n_live + self.n_pending + self.n_fixed + self.n_vacated:
            raise InvariantError("band.park_nonempty", f"{self.name} cannot park with pages in it")
        if self.parked:
            return
        self._drop_holes(np.arange(self.lo, self.hi))
        self.lo = self.hi = -1
        self.parked = True

    def flush(self, max_moves: int | None, urgent: bool = False, hold_network: bool = False) -> int:
        """Floats never compact: a flush only hands back boundary holes (COMP-21, COMP-22)."""
        self._absorb_span_boundary_holes()
        return 0

    def flush_for_allocation(self, hold_network: bool = False) -> int:
        return self.flush(None)

    def _absorb_span_boundary_holes(self) -> None:
        if self.parked or not self.n_holes:
            return
        if self.state[self.lo] != HOLE and self.state[self.hi - 1] != HOLE:
            return
        span = self.state[self.lo : self.hi]
        keep = np.flatnonzero(span != HOLE)
        if not len(keep):
            self.park()
            return
        new_lo, new_hi = self.lo + int(keep[0]), self.lo + int(keep[-1]) + 1
        absorbed = np.concatenate([np.arange(self.lo, new_lo), np.arange(new_hi, self.hi)])
        if len(absorbed):
            self._drop_holes(absorbed)
            self.lo, self.hi = new_lo, new_hi

    def relocate_into(self, lo: int, size: int) -> None:
        """Copy every live page, in order, to `[lo, lo + live)` and make the span `[lo, lo + size)`,
        the rest holes (COMP-23). Pending pages must have settled (`band.geometry_ready`); the old
        block's pages that leave the span keep their unfinished uses as fences in the arena."""
        invariants.geometry_ready(self)
        if self.n_pending:
            self.settle_pending(park=False)
        if self.n_fixed or self.n_vacated:
            raise InvariantError("band.relocate_fixed", f"{self.name} holds fixed or vacated pages and cannot move")
        live = self.live_pages()
        if size < len(live) or lo < self.grid.first_id or lo + size > self.grid.n_grid:
            raise CapacityError(f"{self.name}: block [{lo}, {lo + size}) cannot hold {len(live)} live pages")
        dst = np.arange(lo, lo + len(live), dtype=np.int64)
        old = np.arange(self.lo, self.hi, dtype=np.int64) if not self.parked else np.empty(0, dtype=np.int64)
        self._wait_fences(np.setdiff1d(np.arange(lo, lo + size), old))
        self._drain_pending_reuse(Consumer.SCHEDULE_COPY, np.intersect1d(dst, old))
        key = self.chain.forward_steps.newest_unprocessed()
        if key is not None and len(np.intersect1d(dst, live)):
            # the new block overlaps live pages a forward in flight may still read: wait it first
            self._stream_wait(key.event, f"relocation over pages step {key.step} may read")
        if len(live):
            self._wait_writers(live)
            self._relocate_pages(live, dst)
            if key is not None:
                self.usage.record(PageUse(Hazard.FORWARD, live.copy(), writes=False, event=key.event, step=key.step,
                                          vacated=True, label=f"relocated under step {key.step}"))
        new = np.arange(lo, lo + size, dtype=np.int64)
        leaving = np.setdiff1d(old, new)
        if len(leaving):
            self.chain.fence_pages(self, leaving)
        self.state[old] = OUT
        self.holes.keep(np.zeros(self.holes.count, dtype=bool))
        self.state[dst] = LIVE
        tail = np.arange(lo + len(live), lo + size, dtype=np.int64)
        self.state[tail] = HOLE
        self.holes.push(tail)
        self.n_holes = len(tail)
        self.parked = False
        self.lo, self.hi = lo, lo + size
        self.chain.move_epoch += 1
        self.chain.log("relocate", self.name, lo, size)

    def _relocate_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy an order-keeping relocation in two launches: the pages moving down in ascending
        order, the pages moving up in descending order. Because the map keeps order, neither set
        writes a page the other reads, and within a set, in that order, no copy overwrites a
        source that is still to be read (`PageCopier.shift_pages`)."""
        keep = src != dst
        src, dst = src[keep], dst[keep]
        if not len(src):
            return
        if (np.diff(src) <= 0).any() or (np.diff(dst) <= 0).any():
            raise InvariantError("band.relocate_order", f"{self.name}: a relocation must keep page order")
        down = dst < src
        if down.any():
            self.chain.copier.shift_pages(self, src[down], dst[down], label="relocate")
        if not down.all():
            self.chain.copier.shift_pages(self, src[~down][::-1], dst[~down][::-1], label="relocate")
        self.ids.rebind_physical(src, dst)
        self.stats["moves"] += len(src)

    def extend(self, side: Side, pages: int) -> None:
        """Grow the span by `pages` holes on one side, with no copy (a planned pinned float)."""
        if pages <= 0:
            return
        if side is Side.UP:
            ids = np.arange(self.hi, self.hi + pages, dtype=np.int64)
            self.hi += pages
        else:
            ids = np.arange(self.lo - pages, self.lo, dtype=np.int64)
            self.lo -= pages
        self._wait_fences(ids)
        self.state[ids] = HOLE
        self.holes.push(ids)
        self.n_holes += pages
