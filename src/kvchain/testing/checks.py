"""The page-safety harness's checks (HARN-5..12), each incremental so it can run after every operation.

* `lost_write` (HARN-6/7): forwards and transfers compare what they read with what was last written
  for it; the harness records their mismatches (`Finding`s) as the device runs them.
* `unordered_overlap` (HARN-8): `OverlapTracker` walks the modeled device's work items in launch
  order, keeping per byte granule the last write's vector clock and, per actor, the last read's:
  a new access must be ordered after the last write (and a write after every read since it).
  That is FastTrack's argument: every earlier access is ordered before what it keeps, or was
  already reported, so each item costs a few vectorised comparisons over the granules it touches.
* `host_read_after_wait` (HARN-9): `HostReadTracker` notes, per step, stream waits on work the host
  has not seen finish (by happens-before, so every rank agrees), and flags a host read after one.
* `rank_divergence` (HARN-10): `divergence` compares two ranks' decision logs and step outcomes.
* `cross_dtype_bytes` (HARN-11): `ByteShadow` tags each byte granule with the band that last wrote
  it, updated as work completes (a copy carries its source's tags); an attention page a forward
  reads must not hold bytes last written as FP32 state.
* `ledger_leak` (HARN-12): `ledger_problems` lists what a quiescent pool still records."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..device.base import PageAccess
from ..errors import KVChainError
from ..units import count_of

if TYPE_CHECKING:
    from ..device.modeled import WorkItem
    from ..memory.arena import ArenaLayout
    from ..storage import KVStorage

LOST_WRITE = "lost_write"
UNORDERED_OVERLAP = "unordered_overlap"
HOST_READ_AFTER_WAIT = "host_read_after_wait"
RANK_DIVERGENCE = "rank_divergence"
CROSS_DTYPE_BYTES = "cross_dtype_bytes"
LEDGER_LEAK = "ledger_leak"
#: not one of the spec's six: the pool (or the harness) raised where it should not
ERROR = "error"

CHECKS: tuple[str, ...] = (LOST_WRITE, UNORDERED_OVERLAP, HOST_READ_AFTER_WAIT, RANK_DIVERGENCE,
                           CROSS_DTYPE_BYTES, LEDGER_LEAK)
ALL_CHECKS: tuple[str, ...] = (*CHECKS, ERROR)

#: `PageAccess.band` of the persistent metadata buffer forwards read their page tables from
META_BAND = -1


@dataclass(frozen=True)
class Finding:
    """One broken check, seen by one rank (None: seen comparing the ranks)."""

    check: str
    message: str
    rank: int | None = None

    def to_json(self) -> dict:
        return {"check": self.check, "message": self.message, "rank": self.rank}


class Granules:
    """Byte granules of the arena (the gcd of every band's page bytes and grid origin), plus one
    granule per row of the metadata buffer after them: the unit the byte checks track."""

    def __init__(self, layout: ArenaLayout, meta_rows: int = 0) -> None:
        size = 0
        for g in layout.grids:
            size = math.gcd(size, g.page_bytes)
            size = math.gcd(size, g.origin)
        self.size = max(size, 1)
        self.n_arena = layout.arena_bytes // self.size
        self.n = self.n_arena + meta_rows
        self._origin = np.array([g.origin // self.size for g in layout.grids], dtype=np.int64)
        self._per_page = np.array([g.page_bytes // self.size for g in layout.grids], dtype=np.int64)
        self._offsets = [np.arange(int(k), dtype=np.int64) for k in self._per_page]

    def of(self, band: int, ids: np.ndarray) -> np.ndarray:
        """Granule indices of pages `ids` of band `band`'s grid (page-major, granule order within)."""
        ids = np.asarray(ids, dtype=np.int64)
        if band == META_BAND:
            return self.n_arena + ids
        k = int(self._per_page[band])
        start = self._origin[band] + ids * k
        if k == 1:
            return start
        return (start[:, None] + self._offsets[band][None, :]).ravel()


def _accesses(accesses: Sequence[PageAccess], granules: Granules) -> np.ndarray:
    parts = [granules.of(a.band, a.ids) for a in accesses if len(a.ids)]
    if not parts:
        return np.empty(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class OverlapTracker:
    """`unordered_overlap` (HARN-8), incremental over the modeled device's history."""

    def __init__(self, granules: Granules, actors: Sequence[str] = ("host", "schedule", "forward", "copy",
                                                                  "network")) -> None:
        self.granules = granules
        self.actors: dict[str, int] = {}
        n = granules.n
        self._cap = max(8, len(actors))
        self.write_clock = np.zeros((n, self._cap), dtype=np.int64)
        self.write_item = np.full(n, -1, dtype=np.int64)
        self.read_clock = np.zeros((n, self._cap, self._cap), dtype=np.int64)  # per reading actor
        self.read_item = np.full((n, self._cap), -1, dtype=np.int64)
        self.labels: dict[int, str] = {}
        for a in actors:
            self._actor(a)

    def _actor(self, name: str) -> int:
        index = self.actors.get(name)
        if index is None:
            index = len(self.actors)
            if index >= self._cap:
                raise KVChainError(f"overlap tracker: more than {self._cap} streams")
            self.actors[name] = index
        return index

    def _vector(self, clock: dict[str, int]) -> np.ndarray:
        v = np.zeros(self._cap, dtype=np.int64)
        for name, value in clock.items():
            v[self._actor(name)] = value
        return v

    def consume(self, items: Iterable[WorkItem]) -> list[str]:
        """Check items in launch order (launch order extends happens-before); returns conflicts."""
        problems: list[str] = []
        for item in items:
            reads = _accesses(item.reads, self.granules)
            writes = _accesses(item.writes, self.granules)
            if not len(reads) and not len(writes):
                continue
            self.labels[item.seq] = f"{item.label or '?'}@{item.stream}"
            clock = self._vector(item.clock)
            me = self._actor(item.stream)
            if len(reads):
                bad = ~(self.write_clock[reads] <= clock).all(axis=1)
                if bad.any():
                    problems.append(self._describe(item, "reads", reads[bad], self.write_item[reads[bad]]))
                self.read_clock[reads, me] = clock
                self.read_item[reads, me] = item.seq
            if len(writes):
                bad = ~(self.write_clock[writes] <= clock).all(axis=1)
                if bad.any():
                    problems.append(self._describe(item, "writes", writes[bad], self.write_item[writes[bad]]))
                unordered = ~(self.read_clock[writes] <= clock).all(axis=2)  # [granule, reader]
                unordered[:, me] = False  # reads on this stream come before it in stream order
                if unordered.any():
                    g, reader = np.nonzero(unordered)
                    problems.append(self._describe(item, "writes", writes[g], self.read_item[writes[g], reader],
                                                   "read"))
                self.write_clock[writes] = clock
                self.write_item[writes] = item.seq
                self.read_clock[writes] = 0
                self.read_item[writes] = -1
        return problems

    def _describe(self, item: WorkItem, verb: str, granules: np.ndarray, others: np.ndarray,
                  other_kind: str = "write") -> str:
        other = int(others[0])
        where = self._where(int(granules[0]))
        return (f"{item.label or '?'}@{item.stream} {verb} {where} unordered with the {other_kind} by "
                f"{self.labels.get(other, '?')} ({count_of(len(np.unique(granules)), 'granule')})")

    def _where(self, granule: int) -> str:
        if granule >= self.granules.n_arena:
            return f"metadata row {granule - self.granules.n_arena}"
        return f"byte {granule * self.granules.size}"


class ByteShadow:
    """Which band last wrote each byte granule of the arena, in the order writes land (HARN-11).

    A copy (one read and one write of the same band and size: a move, a relocation, a state copy)
    carries its source's tags; any other write tags its granules with its band. Forward token
    writes fill only some rows of a page and leave its other bytes as they were, so they keep the
    tags (`partial=True`)."""

    PRISTINE = -1

    def __init__(self, granules: Granules, state_band: int | None) -> None:
        self.granules = granules
        self.state_band = state_band
        self.tags = np.full(granules.n_arena, self.PRISTINE, dtype=np.int16)

    def landed(self, reads: Sequence[PageAccess], writes: Sequence[PageAccess], partial: bool = False) -> None:
        writes = [w for w in writes if w.band != META_BAND and len(w.ids)]
        if not writes:
            return
        if len(reads) == 1 and len(writes) == 1 and reads[0].band == writes[0].band and \
                len(reads[0].ids) == len(writes[0].ids):
            src = self.granules.of(reads[0].band, reads[0].ids)
            dst = self.granules.of(writes[0].band, writes[0].ids)
            self.tags[dst] = self.tags[src]
            return
        for w in writes:
            if partial and w.band != self.state_band:
                continue
            self.tags[self.granules.of(w.band, w.ids)] = w.band

    def state_bytes_in(self, band: int, ids: np.ndarray) -> np.ndarray:
        """Of pages `ids` of attention band `band`, those holding bytes last written as FP32 state."""
        if self.state_band is None or not len(ids):
            return ids[:0]
        k = int(self.granules._per_page[band])
        tags = self.tags[self.granules.of(band, ids)].reshape(len(ids), k)
        return ids[(tags == self.state_band).any(axis=1)]


class HostReadTracker:
    """`host_read_after_wait` (HARN-9), per step (one harness operation). A stream wait counts when
    the host has not seen its event finish: the event's clock is not below the host's, which is
    logical (host waits) and so the same on every rank. Host reads of device state: the recovery
    read-ahead (heard through `ChainAllocator.host_read_observers`) and the PD id readback before
    publication."""

    def __init__(self) -> None:
        self.waited: str | None = None
        self.found: list[str] = []

    def begin_step(self) -> None:
        self.waited = None

    def stream_wait(self, stream: str, label: str, unfinished: bool) -> None:
        if unfinished and self.waited is None:
            self.waited = f"{stream} waits {label or 'an event'}"

    def host_read(self, what: str) -> None:
        if self.waited is not None:
            self.found.append(f"host read of {what} after a stream wait on unfinished work ({self.waited})")


def divergence(a: Sequence, b: Sequence) -> str | None:
    """The first difference between two ranks' logs, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: rank 0 {_short(x)} / rank 1 {_short(y)}"
    if len(a) != len(b):
        return f"rank 0 logged {len(a)} entries, rank 1 {len(b)}"
    return None


def _short(x: object, limit: int = 160) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ledger_problems(storage: KVStorage, held: dict[str, int] | None = None,
                    idle_check: Callable[[dict[str, int] | None], None] | None = None) -> list[str]:
    """What a quiescent pool (every forward processed, every transfer ended, the device drained)
    still records (HARN-12): ledger uses, fences, pending, vacated, fixed or held pages, forwards
    in flight, and the idle checks' leaks (CHK-15): `idle_check`, by default the pool's own
    (a driver passes its step sequence's, which also sees forwards it never processed)."""
    chain = storage.allocator
    out = []
    for band in chain.bands:
        usage = band.usage
        if usage.uses:
            out.append(f"{band.name}: ledger keeps {usage.uses[:3]}{' ...' if len(usage.uses) > 3 else ''}")
        if usage.unknown_writer is not None:
            out.append(f"{band.name}: ledger keeps an unknown writer ({usage.unknown_writer.label})")
        if int(usage.count.sum()):
            out.append(f"{band.name}: ledger counts {int(usage.count.sum())} page uses")
        for what in ("n_pending", "n_vacated", "n_fixed", "n_held"):
            if getattr(band, what):
                out.append(f"{band.name}: {getattr(band, what)} {what[2:]} pages")
    if chain.fences:
        out.append(f"{len(chain.fences)} fences left, e.g. {chain.fences[0].use.label}")
    if chain.forward_steps.in_flight:
        out.append(f"{len(chain.forward_steps.in_flight)} forwards in flight")
    if not out:
        try:
            (idle_check or storage.check_idle)(held)
        except KVChainError as e:
            out.append(str(e))
    return out
