"""`PageUsage`: the per-band page ledger, and `CLEARANCE`, the one rule for who waits for what.

A band records one `PageUse` per use of its pages that is not over yet: a forward's writes, a
host-tier copy, a network transfer, vacated move sources, fixed pages. The next writer of a page
(a `Consumer`) must clear every `Hazard` recorded on it, as `CLEARANCE` says: a stream wait, a
host wait, after the forward retires, or never (the page is excluded). `clearance` is the one
reader of that table: every wait the allocator queues is a `Wait` it returned."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .. import faults
from ..device.base import Event
from .npfast import add_at
from .signals import HostTransfer, NetworkTransfer


class Hazard(enum.Enum):
    FORWARD = "forward"  # a forward in flight writes the pages (or may read a vacated source)
    COPY_READ = "copy_read"  # a host-tier backup reads them
    COPY_WRITE = "copy_write"  # a host-tier load writes them
    NETWORK = "network"  # a PD send reads them or a receive writes them
    FIXED = "fixed"  # a load reservation, or rows a relief keeps in place


class Consumer(enum.Enum):
    FORWARD = "forward"  # the next forward
    SCHEDULE_COPY = "schedule_copy"  # a move or a state copy
    ZERO = "zero"  # hand-out zeroing
    HOST_LOAD = "host_load"  # a host-tier load
    NETWORK_RECEIVE = "network_receive"  # a PD receive


class Clear(enum.Enum):
    NONE = "none"  # already ordered
    STREAM_WAIT = "stream wait"
    HOST_WAIT = "host wait"
    AFTER_RETIRE = "after retire"  # the forward must have retired first
    EXCLUDED = "excluded"  # the page may not be chosen


_COPY = {Hazard.COPY_READ: Clear.STREAM_WAIT, Hazard.COPY_WRITE: Clear.STREAM_WAIT}

#: Who waits for what (LEDG-9..29): read by `clearance` alone.
CLEARANCE: dict[Consumer, dict[Hazard, Clear]] = {
    Consumer.FORWARD: {Hazard.FORWARD: Clear.NONE, **_COPY, Hazard.NETWORK: Clear.HOST_WAIT,
                       Hazard.FIXED: Clear.EXCLUDED},
    Consumer.SCHEDULE_COPY: {Hazard.FORWARD: Clear.STREAM_WAIT, **_COPY, Hazard.NETWORK: Clear.HOST_WAIT,
                             Hazard.FIXED: Clear.EXCLUDED},
    Consumer.ZERO: {Hazard.FORWARD: Clear.STREAM_WAIT, **_COPY, Hazard.NETWORK: Clear.HOST_WAIT,
                    Hazard.FIXED: Clear.EXCLUDED},
    Consumer.HOST_LOAD: {Hazard.FORWARD: Clear.NONE, **_COPY, Hazard.NETWORK: Clear.HOST_WAIT,
                         Hazard.FIXED: Clear.EXCLUDED},
    Consumer.NETWORK_RECEIVE: {Hazard.FORWARD: Clear.AFTER_RETIRE, **_COPY, Hazard.NETWORK: Clear.HOST_WAIT,
                               Hazard.FIXED: Clear.EXCLUDED},
}


@dataclass(eq=False)
class PageUse:
    """One unfinished use of some of a band's pages (physical grid ids)."""

    hazard: Hazard
    pages: np.ndarray
    writes: bool
    event: Event | None = None  # what a stream wait waits (forward_done, a copy's finish event)
    step: int | None = None  # FORWARD: the forward's step; it retires with it
    transfer: NetworkTransfer | HostTransfer | None = None
    vacated: bool = False  # the pages are move sources that stay out of use until this ends
    label: str = ""

    def __repr__(self) -> str:
        return f"PageUse({self.hazard.value}, {len(self.pages)} pages, {self.label})"


@dataclass(frozen=True)
class Wait:
    """What a consumer must do before it writes: one clearance action, with why (for the log)."""

    clear: Clear
    use: PageUse
    why: str


def clearance(consumer: Consumer, uses: Iterable[PageUse], why: str | None = None) -> list[Wait]:
    """What `consumer` must clear of `uses` before it writes, read from CLEARANCE (LEDG-9). The
    only reader of the table: the allocator's executor performs the waits it returns."""
    rules = CLEARANCE[consumer]
    out = []
    for use in uses:
        clear = rules[use.hazard]
        if clear is not Clear.NONE:
            out.append(Wait(clear, use, why if why is not None else f"{consumer.value} clears {use.hazard.value}"))
    return out


def forward_reads(event: Event, step: int, why: str) -> list[Wait]:
    """The schedule stream's clearance of pages a forward in flight may still read (a pending
    batch it settles, a block a relocation copies over): derived from CLEARANCE like any other."""
    use = PageUse(Hazard.FORWARD, _NO_PAGES, writes=False, event=event, step=step, label=why)
    return clearance(Consumer.SCHEDULE_COPY, (use,), why)


@dataclass(eq=False)
class Fence:
    """Bytes that left a band while a use of them was unfinished: whichever band next writes them
    clears the use first (COMP-20)."""

    lo: int
    hi: int
    use: PageUse


_NO_PAGES = np.empty(0, dtype=np.int64)
_NO_PAGES.flags.writeable = False


class PageUsage:
    """One band's ledger. `count[p]` is how many unfinished uses cover grid id p, so the common
    case (no use on the pages at hand) is one vectorised check."""

    def __init__(self, n_grid: int) -> None:
        self.uses: list[PageUse] = []
        self.count = np.zeros(n_grid, dtype=np.int32)
        self.unknown_writer: PageUse | None = None  # a forward whose writes are unknown (speculative)

    def __len__(self) -> int:
        return len(self.uses) + (self.unknown_writer is not None)

    def record(self, use: PageUse) -> PageUse:
        use.pages = np.asarray(use.pages, dtype=np.int64)
        add_at(self.count, use.pages, 1)
        self.uses.append(use)
        return use

    def end(self, use: PageUse) -> None:
        if use is self.unknown_writer:
            self.unknown_writer = None
            return
        self.uses.remove(use)
        add_at(self.count, use.pages, -1)

    def busy(self, pages: np.ndarray) -> np.ndarray:
        """Per page, whether any unfinished use covers it."""
        return self.count[pages] > 0

    def on(self, pages: np.ndarray) -> list[PageUse]:
        """The unfinished uses that cover any of `pages` (an unknown writer covers all)."""
        out = [self.unknown_writer] if self.unknown_writer is not None else []
        if not len(pages) or not self.uses or not self.count[pages].any():
            return out
        mask = np.zeros(len(self.count), dtype=bool)
        mask[pages] = True
        out += [u for u in self.uses if mask[u.pages].any()]
        return out

    def clearance(self, consumer: Consumer, pages: np.ndarray) -> list[Wait]:
        """What `consumer` must clear before writing `pages`: the uses on them, through `clearance`."""
        uses = self.on(pages)
        if faults.ACTIVE and faults.active(faults.SKIP_COPY_CLEARANCE):
            uses = [u for u in uses if u.hazard not in (Hazard.COPY_READ, Hazard.COPY_WRITE)]
        return clearance(consumer, uses)

    def writers_clearance(self, pages: np.ndarray) -> list[Wait]:
        """What a schedule-stream copy reading `pages` must clear: their unfinished writers (a
        forward in flight, a host load, a network receive; COMP-17)."""
        if faults.ACTIVE and faults.active(faults.SKIP_WRITER_WAITS):
            return []
        return clearance(Consumer.SCHEDULE_COPY, [u for u in self.on(pages) if u.writes])

    def end_forwards_through(self, step: int) -> list[PageUse]:
        """Retire the forward uses of every forward with step <= `step` (LEDG-7)."""
        done = [u for u in self.uses if u.hazard is Hazard.FORWARD and u.step is not None and u.step <= step]
        for u in done:
            self.end(u)
        if self.unknown_writer is not None and self.unknown_writer.step <= step:
            done.append(self.unknown_writer)
            self.unknown_writer = None
        return done

    def end_transfer(self, transfer: NetworkTransfer | HostTransfer) -> list[PageUse]:
        if faults.ACTIVE and faults.active(faults.NEVER_END_USES):
            return []
        done = [u for u in self.uses if u.transfer is transfer]
        for u in done:
            self.end(u)
        return done
