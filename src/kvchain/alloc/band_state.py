"""The state of one band: page states, counts, and the views pricing and compaction read.

`BandState` holds a band's arrays (page states, fixed and held pages, holes, pending batches, its
ledger and id map) and the counts pricing reads, each a `_CapacityField` that moves the chain's
capacity epoch when rebound (CAP-7). Its methods only read: the byte frontiers, the snapshot pricing
prices (counts and frontiers, never hole positions, CAP-4), the pages network transfers hold, and
the frontier scan compaction plans with. `Band` (`alloc/band.py`) adds the mutations."""

from __future__ import annotations

import enum

import numpy as np

from ..memory.arena import BandGrid
from ..plan import Placement, PoolKind, SubPool
from .forward_steps import PendingPages
from .id_space import IdStack, UnitIds
from .npfast import unique_sorted
from .page_usage import Hazard, PageUsage
from .pricing import BandSnap, CapacityEpoch


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


class _CapacityField:
    """A band attribute that pricing reads: every rebind moves the capacity epoch (CAP-7).

    Only `__set__` is defined, so a read finds the value in the instance dict at plain attribute
    speed, while every write still goes through here."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value
        obj.epoch.value += 1  # `CapacityEpoch.bump`, inlined: every take and free sets several


class BandState:
    """A band's arrays and counts, and the views read from them (pricing's snapshot, compaction's
    frontier scan): everything about a band that changes nothing."""

    lo = _CapacityField()
    hi = _CapacityField()
    parked = _CapacityField()
    n_live = _CapacityField()
    n_holes = _CapacityField()
    n_pending = _CapacityField()
    n_fixed = _CapacityField()
    n_vacated = _CapacityField()
    n_held = _CapacityField()

    def __init__(self, pool: SubPool, grid: BandGrid, epoch: CapacityEpoch, n_virtual: int) -> None:
        self.pool = pool
        self.grid = grid
        self.epoch = epoch  # the chain's: shared by every band, so any change moves it
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

    def live_pages(self) -> np.ndarray:
        if self.parked:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.state[self.lo : self.hi] == LIVE) + self.lo

    def network_held(self) -> np.ndarray:
        """Live pages a network transfer uses or a receive hold keeps (grid ids)."""
        if self.parked:
            return np.empty(0, dtype=np.int64)
        pages = [u.pages for u in self.usage.uses if u.hazard is Hazard.NETWORK]
        if self.n_held:
            pages.append(np.flatnonzero(self.held))
        if not pages:
            return np.empty(0, dtype=np.int64)
        ids = unique_sorted(np.concatenate(pages))
        return ids[self.state[ids] == LIVE]

    def network_used(self, ids: np.ndarray) -> np.ndarray:
        """Per page of `ids`, whether a network transfer still uses it."""
        mask = np.zeros(len(ids), dtype=bool)
        if not self.usage.count[ids].any():
            return mask
        for use in self.usage.uses:
            if use.hazard is Hazard.NETWORK:
                mask |= np.isin(ids, use.pages)
        return mask

    def _immovable(self, mode: SnapshotMode) -> np.ndarray:
        """Grid ids that stay where they are under `mode`: fixed pages, vacated pages, and in relief's
        first pass the rows network transfers hold."""
        parts = []
        if self.n_fixed:
            parts.append(np.flatnonzero(self.fixed_mask))
        if self.n_vacated and mode is not SnapshotMode.EVERY_BYTE:
            parts.append(np.flatnonzero(self.state == VACATED))
        if mode is SnapshotMode.HOLD_NETWORK:
            parts.append(self.network_held())
        if not parts:
            return np.empty(0, dtype=np.int64)
        return unique_sorted(np.concatenate(parts))

    def snapshot(self, mode: SnapshotMode = SnapshotMode.TAKE) -> BandSnap:
        """Counts and frontiers only, never hole positions (CAP-4). Fixed pages, vacated pages and
        (under HOLD_NETWORK) network-held rows count as immovable; only their farthest position
        from the band's base matters, for how far a compaction can pack it."""
        parked = self.parked
        # a fixed page is a live one held in place (`Band.fix`): counted once, as fixed
        live, fixed, pending = self.n_live - self.n_fixed, self.n_fixed, self.n_pending
        fixed_far = 0
        if self.n_vacated:
            if mode is SnapshotMode.EVERY_BYTE:
                pending += self.n_vacated
            else:
                fixed += self.n_vacated
        if mode is SnapshotMode.HOLD_NETWORK and (self.n_held or self.usage.uses):
            held = self.network_held()
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

    def frontier_scan(self, wanted: int, match, stop=None) -> np.ndarray:
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
