"""`Band` (an end of the chain) and `FloatBand` (a band between the ends).

A band holds pages of its own page-byte size on its grid in the arena: a span `[lo, hi)` of grid
ids, with live pages, holes (free pages inside the span), and pending pages (freed under a forward
still in flight). A take (`_acquire`) uses holes, then settles pending batches, then grows the
frontier; `pricing.take_layout` decides the growth so that pricing and takes agree exactly. A free
is logical: it leaves a hole (or a pending page) and holes are closed later by compaction."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CapacityError, InvariantError
from ..memory.arena import BandGrid
from ..plan import Placement, PoolKind, SubPool
from . import invariants
from .forward_steps import PendingPages
from .id_space import IdStack, UnitIds
from .pricing import BandSnap, Side, take_layout

if TYPE_CHECKING:
    from .chain import ChainAllocator


class allocator_operation:
    """One allocator operation (a take, a free, a flush, an advance): the invariant level is read
    once at its start, and the rules that hold within one operation are checked against it."""

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


OUT, LIVE, HOLE, PENDING, SINK = (int(s) for s in PageState)


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
        self.holes = IdStack(n)
        self.ids = UnitIds(n_virtual, n, grid.sink_id)
        self.pending = PendingPages()
        self.stats = {"moves": 0, "flushes": 0, "settled_batches": 0, "zeroed_pages": 0}
        self.n_live = 0
        self.n_holes = 0
        self.n_pending = 0
        self.n_fixed = 0
        self.parked = False
        if self.placement is Placement.DOWN_END:
            self.lo = self.hi = n
        else:
            self.lo = self.hi = grid.first_id

    # -- views of state ---------------------------------------------------------------------

    def __repr__(self) -> str:
        span = "parked" if self.parked else f"[{self.lo}, {self.hi})"
        return (f"{type(self).__name__}({self.name} {span} live={self.n_live} holes={self.n_holes} "
                f"pending={self.n_pending} fixed={self.n_fixed})")

    @property
    def bottom(self) -> int:
        return self.grid.origin + self.lo * self.page_bytes

    @property
    def top(self) -> int:
        return self.grid.origin + self.hi * self.page_bytes

    @property
    def span(self) -> int:
        return 0 if self.parked else self.hi - self.lo

    def _fixed_far(self) -> int:
        if not self.n_fixed or self.parked:
            return 0
        fixed = np.flatnonzero(self.fixed_mask)
        if self.placement is Placement.DOWN_END:
            return self.hi - int(fixed.min())
        return int(fixed.max()) - self.lo + 1

    def snapshot(self) -> BandSnap:
        """Counts and frontiers only, never hole positions (CAP-4)."""
        parked = self.parked
        return BandSnap(
            self.index, self.placement, self.page_bytes, self.grid.origin, self.grid.first_id, self.grid.n_grid,
            -1 if parked else self.lo, -1 if parked else self.hi, parked, self.n_live, self.n_holes,
            self.n_pending, self.n_fixed, self._fixed_far() if self.n_fixed else 0, self.n_fixed > 0,
        )

    # -- taking -----------------------------------------------------------------------------

    def _acquire(self, n: int, after: BandSnap | None = None) -> np.ndarray:
        """Hand out `n` writable pages: holes, then settled pending batches, then frontier growth.

        `after` is this band's layout after the take when the caller already computed it with
        `take_layout` on the current state (a chain take's in-place plan). Every failure check
        runs before anything settles, so a refused take changes nothing."""
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
            self.settle_pending(self.pending.oldest_covering(from_pending))
        parts = []
        from_holes = n - grow
        if from_holes:
            parts.append(self._take_holes(from_holes))
        if grow:
            parts.append(self._grow_to(after))
        ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.state[ids] = LIVE
        self.n_live += n
        self._maybe_zero_pages(ids)
        return ids

    def _take_holes(self, k: int) -> np.ndarray:
        ids = self.holes.pop(k)
        self.n_holes -= k
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
        NaN or a neighbour's FP32 state bytes read as BF16 would reach the output."""
        if not self.zero_on_handout or not len(ids):
            return
        self.stats["zeroed_pages"] += len(ids)
        self.chain.copier.zero_pages(self, ids)

    # -- freeing ----------------------------------------------------------------------------

    def free(self, ids: np.ndarray) -> None:
        """Logical free (LIFE-2, LIFE-3): the pages are unbound and leave at once, with no stream
        wait. Under a
        recorded, unprocessed forward they pend on it; otherwise they become holes."""
        self.chain.forward_steps.assert_no_open_launch("free", self.name, len(ids))
        if not len(ids):
            return
        invariants.check_freed_pages(self, ids)
        self.ids.unbind_physical(ids)
        key = self.chain.forward_steps.newest_unprocessed()
        if key is not None:
            self.state[ids] = PENDING
            self.pending.add(key.step, key.event, ids)
            self.n_pending += len(ids)
        else:
            self.state[ids] = HOLE
            self.holes.push(ids)
            self.n_holes += len(ids)
        self.n_live -= len(ids)
        self._after_free()

    def _after_free(self) -> None:
        pass

    def settle_pending(self, n_batches: int | None = None) -> int:
        """Settle the oldest `n_batches` pending batches (all when None): the schedule stream waits
        their forwards' events; the host never blocks. Their pages become holes."""
        n = len(self.pending.batches) if n_batches is None else n_batches
        if n <= 0:
            return 0
        device = self.chain.device
        batches = self.pending.pop_oldest(n)
        for batch in batches:
            device.stream_wait(device.schedule_stream, batch.event)
        self._pending_to_holes(batches)
        self.stats["settled_batches"] += len(batches)
        return sum(b.size for b in batches)

    def release_pending_through(self, step: int) -> int:
        """Return every batch keyed at or before a processed forward to the holes (LIFE-27)."""
        batches = self.pending.pop_through(step)
        if batches:
            self._pending_to_holes(batches)
        return sum(b.size for b in batches)

    def _pending_to_holes(self, batches) -> None:
        ids = np.concatenate([b.pages() for b in batches])
        self.state[ids] = HOLE
        self.holes.push(ids)
        self.n_pending -= len(ids)
        self.n_holes += len(ids)
        self._after_free()

    # -- compaction -------------------------------------------------------------------------

    def _frontier_scan(self, wanted: int, match) -> np.ndarray:
        """Grid ids where `match(states, ids)` holds, nearest the frontier first, scanning inward in
        chunks until `wanted` are found: work in proportion to what the caller needs, not the span."""
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
            hit = ids[match(self.state[ids], ids)]
            found.append(hit)
            got += len(hit)
        out = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
        return out[:wanted]

    def flush(self, max_moves: int | None) -> int:
        """Move the live pages nearest the frontier into the holes nearest the band's base, then
        absorb the holes left at the frontier. Returns pages moved. Fixed pages never move."""
        if self.parked or self.span == 0 or not self.n_holes:
            return 0
        moved = 0
        if not self.n_pending and max_moves != 0:
            holes = self.holes.view()
            down = self.placement is Placement.DOWN_END
            k = len(holes) if max_moves is None else min(max_moves, len(holes))
            if k < len(holes):
                part = np.partition(holes, len(holes) - k if down else k - 1)
                dst = part[len(holes) - k :] if down else part[:k]
            else:
                dst = holes.copy()
            dst = np.sort(dst)[::-1] if down else np.sort(dst)
            fixed = self.fixed_mask
            src = self._frontier_scan(k, lambda st, ids: (st == LIVE) & ~fixed[ids])
            n = min(len(src), len(dst))
            beyond = dst[:n] > src[:n] if down else dst[:n] < src[:n]
            k = int(np.count_nonzero(beyond))
            if k:
                self._commit_move_batch(src[:k].copy(), dst[:k].copy())
                moved = k
        self._absorb_boundary_holes()
        self.stats["flushes"] += 1
        return moved

    def flush_for_allocation(self) -> int:
        """Urgent flush for relief: settled first, uncapped, packs every movable page (COMP-8)."""
        invariants.geometry_ready(self)
        if self.n_pending:
            self.settle_pending()
        return self.flush(max_moves=None)

    def _absorb_boundary_holes(self) -> None:
        """Retreat the frontier over trailing holes; never over a pending, live or fixed page."""
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
        """Holes that leave the span: out of the band."""
        self.state[ids] = OUT
        self.holes.keep(self.state[self.holes.view()] == HOLE)
        self.n_holes -= len(ids)

    def _commit_move_batch(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy live pages `src` into holes `dst` and rebind their virtual ids (COMP-16)."""
        self.chain.copier.move_pages(self, src, dst)
        self.ids.rebind_physical(src, dst)
        self.state[dst] = LIVE
        self.holes.keep(self.state[self.holes.view()] == HOLE)
        self.state[src] = HOLE
        self.holes.push(src)
        self.stats["moves"] += len(src)
        self.chain.move_epoch += 1
        self.epoch.bump()

    def prewarm_compaction(self) -> None:
        """Run the page-copy path once at startup (COMP-25) so the first serving-time move neither
        compiles kernels nor allocates memory outside the pools: copy the sink (or the base page)
        onto itself."""
        page = self.grid.sink_id if self.grid.sink_id is not None else self.grid.first_id
        if page < self.grid.n_grid:
            ids = np.array([page], dtype=np.int64)
            self.chain.copier.move_pages(self, ids, ids)

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
    no live, fixed or pending page."""

    def __init__(self, pool: SubPool, grid: BandGrid, chain: ChainAllocator, n_virtual: int) -> None:
        super().__init__(pool, grid, chain, n_virtual)
        self.lo = self.hi = -1
        self.parked = True

    def _after_free(self) -> None:
        if not self.parked and self.n_live + self.n_pending + self.n_fixed == 0:
            self.park()

    def park(self) -> None:
        """Give the whole span back: an empty float is transparent (COMP-24)."""
        if self.n_live + self.n_pending + self.n_fixed:
            raise InvariantError("band.park_nonempty", f"{self.name} cannot park with pages in it")
        if self.parked:
            return
        self.state[self.lo : self.hi] = OUT
        self.holes.keep(np.zeros(self.holes.count, dtype=bool))
        self.n_holes = 0
        self.lo = self.hi = -1
        self.parked = True

    def flush(self, max_moves: int | None) -> int:
        """Floats never compact: a flush only hands back boundary holes (COMP-21, COMP-22)."""
        self._absorb_span_boundary_holes()
        return 0

    def flush_for_allocation(self) -> int:
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
        the rest holes. Pending pages must have settled (`band.geometry_ready`)."""
        invariants.geometry_ready(self)
        if self.n_pending:
            self.settle_pending()
        if self.n_fixed:
            raise InvariantError("band.relocate_fixed", f"{self.name} holds fixed pages and cannot move")
        live = self.live_pages()
        if size < len(live) or lo < self.grid.first_id or lo + size > self.grid.n_grid:
            raise CapacityError(f"{self.name}: block [{lo}, {lo + size}) cannot hold {len(live)} live pages")
        dst = np.arange(lo, lo + len(live), dtype=np.int64)
        if not self.parked:
            self.state[self.lo : self.hi] = OUT
        self.holes.keep(np.zeros(self.holes.count, dtype=bool))
        if len(live):
            self._relocate_pages(live, dst)
        self.state[dst] = LIVE
        tail = np.arange(lo + len(live), lo + size, dtype=np.int64)
        self.state[tail] = HOLE
        self.holes.push(tail)
        self.n_holes = len(tail)
        self.parked = False
        self.lo, self.hi = lo, lo + size
        self.chain.move_epoch += 1

    def _relocate_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy in waves so that no copy overwrites a page a later copy still reads."""
        keep = src != dst
        src, dst = src[keep], dst[keep]
        remaining = np.ones(len(src), dtype=bool)
        reading = np.zeros(self.grid.n_grid, dtype=bool)
        while remaining.any():
            reading[:] = False
            reading[src[remaining]] = True
            wave = remaining & ~reading[dst]
            if not wave.any():
                raise AssertionError("relocation copies form a cycle")
            self.chain.copier.move_pages(self, src[wave], dst[wave])
            remaining &= ~wave
        if len(src):
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
        self.state[ids] = HOLE
        self.holes.push(ids)
        self.n_holes += pages
