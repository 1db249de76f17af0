"""What the allocator needs from a device, and nothing more.

Work is launched on a stream with the pages it reads and writes; streams run their work in order;
an event recorded on a stream fires when the work before it completes; a stream wait orders a
stream's later work after an event without blocking the host; a host wait blocks the host. Every
wait is counted, so tests can prove that a path never blocks the host."""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class PageAccess(NamedTuple):
    """Pages of one band's grid (physical ids, an int64 array) that launched work touches."""

    band: int
    ids: np.ndarray


@dataclass(eq=False)
class Stream:
    """An ordered queue of work."""

    name: str
    device: Device = field(repr=False)


_event_ids = itertools.count(1)


@dataclass(eq=False)
class Event:
    """A point on a stream. `seq` is unique per device and only grows."""

    seq: int = field(default_factory=lambda: next(_event_ids))
    stream: Stream | None = None
    label: str = ""


@dataclass
class DeviceCounters:
    launches: int = 0
    records: int = 0
    stream_waits: int = 0
    host_waits: int = 0
    host_waits_blocked: int = 0  # host waits on work that had not completed yet


class Device(abc.ABC):
    """A backend. Subclasses implement the primitives; the streams every pool uses are named here."""

    SCHEDULE = "schedule"
    FORWARD = "forward"
    COPY = "copy"

    def __init__(self) -> None:
        self.counters = DeviceCounters()
        self._streams: dict[str, Stream] = {}

    def stream(self, name: str) -> Stream:
        if name not in self._streams:
            self._streams[name] = self._make_stream(name)
        return self._streams[name]

    @property
    def schedule_stream(self) -> Stream:
        """Where allocator work (zeroing, moves, state copies) runs."""
        return self.stream(self.SCHEDULE)

    @property
    def forward_stream(self) -> Stream:
        return self.stream(self.FORWARD)

    @property
    def copy_stream(self) -> Stream:
        """Where host-tier copies run (backups and loads), ordered after the forward stream by the
        one who launches them (HIC-1, HIC-9)."""
        return self.stream(self.COPY)

    def _make_stream(self, name: str) -> Stream:
        return Stream(name, self)

    # -- primitives -------------------------------------------------------------------------

    @abc.abstractmethod
    def launch(
        self,
        stream: Stream,
        fn: Callable[[], None] | None,
        *,
        reads: Sequence[PageAccess] = (),
        writes: Sequence[PageAccess] = (),
        label: str = "",
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """Queue work on `stream`; it runs after everything queued there before it. `on_start`
        runs when the work starts (a kernel's reads), `fn` when it completes (its writes land)."""

    @abc.abstractmethod
    def record(self, stream: Stream, label: str = "") -> Event:
        """A fresh event that fires when the work queued on `stream` so far completes."""

    @abc.abstractmethod
    def stream_wait(self, stream: Stream, event: Event) -> None:
        """Order `stream`'s later work after `event`; never blocks the host."""

    @abc.abstractmethod
    def host_wait(self, event: Event, timeout: float | None = None) -> None:
        """Block the host until `event` fires (raises TransferTimeoutError past `timeout`)."""

    @abc.abstractmethod
    def query(self, event: Event) -> bool:
        """Whether `event` has fired. Decisions must never depend on this (it differs by rank)."""

    def close(self) -> None:  # noqa: B027 - a no-op unless a backend runs workers
        """Stop any worker the backend runs (threads)."""

    def synchronize(self) -> None:
        """Block the host until all queued work completes (tests and idle checks only)."""
        for stream in list(self._streams.values()):
            self.host_wait(self.record(stream, "synchronize"))
