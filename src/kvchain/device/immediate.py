"""`ImmediateDevice`: every launched callable runs at launch, so every event has fired when it is
recorded. The allocator's logic is the same as under asynchrony; only nothing is ever in flight."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .base import Device, Event, PageAccess, Stream


class ImmediateDevice(Device):
    name = "immediate"

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
        self.counters.launches += 1
        if on_start is not None:
            on_start()
        if fn is not None:
            fn()

    def record(self, stream: Stream, label: str = "") -> Event:
        self.counters.records += 1
        return Event(stream=stream, label=label)

    def stream_wait(self, stream: Stream, event: Event) -> None:
        self.counters.stream_waits += 1

    def host_wait(self, event: Event, timeout: float | None = None) -> None:
        self.counters.host_waits += 1

    def query(self, event: Event) -> bool:
        return True
