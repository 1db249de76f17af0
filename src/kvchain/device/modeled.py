"""`ModeledDevice`: deterministic, seeded asynchrony on the host.

Each launched work item gets a duration from a seeded generator; it starts when its stream's
previous item and every event its stream waits have completed, and it completes `duration` later.
`on_start` runs at its start time and `fn` at its completion time, in simulated-time order, so its
payload writes land when it completes: a missing wait corrupts real bytes. Simulated time moves only
when the host waits or calls `advance`, so two devices with different seeds run the same operations
with different completion timing, and decisions that depended on timing would differ.

Every item carries a vector clock (streams and the host are the actors), so any two accesses can be
checked for a happens-before order, independently of the timing this seed happened to produce."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import TransferTimeoutError
from .base import Device, Event, PageAccess, Stream

Clock = dict[str, int]


def clock_leq(a: Clock, b: Clock) -> bool:
    """a happens before (or equals) b."""
    return all(b.get(k, 0) >= v for k, v in a.items())


def _merge(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass(eq=False)
class ModeledEvent(Event):
    time: float = 0.0
    clock: Clock = field(default_factory=dict)


@dataclass(eq=False)
class WorkItem:
    seq: int
    stream: str
    label: str
    start: float
    end: float
    clock: Clock
    reads: Sequence[PageAccess]
    writes: Sequence[PageAccess]
    fn: Callable[[], None] | None
    on_start: Callable[[], None] | None
    started: bool = False
    done: bool = False


class ModeledDevice(Device):
    name = "modeled"

    def __init__(self, seed: int = 0, mean_duration: float = 1.0, jitter: float = 0.9,
                 durations: dict[str, float] | None = None) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.mean_duration = mean_duration
        self.jitter = jitter
        #: mean duration per stream name, overriding `mean_duration` (forwards run long, say)
        self.durations = dict(durations or {})
        self.now = 0.0
        self._tail: dict[str, float] = {}
        self._clocks: dict[str, Clock] = {}
        self.host_clock: Clock = {"host": 0}
        self._events: list[tuple[float, int, int, WorkItem]] = []  # (time, 0 end / 1 start, seq, item)
        self._seq = itertools.count()
        self._delays: list[tuple[str, float, int]] = []
        self.history: list[WorkItem] = []  # every item, for happens-before checks

    # -- timing knobs ---------------------------------------------------------------------------

    def delay_next(self, label_prefix: str, extra: float, count: int = 1) -> None:
        """Add `extra` to the duration of the next `count` items whose label starts with the prefix."""
        self._delays.append((label_prefix, extra, count))

    def _duration(self, stream: str, label: str) -> float:
        mean = self.durations.get(stream, self.mean_duration)
        d = mean * (1.0 + self.jitter * (2.0 * self.rng.random() - 1.0))
        for i, (prefix, extra, count) in enumerate(self._delays):
            if label.startswith(prefix):
                d += extra
                if count <= 1:
                    del self._delays[i]
                else:
                    self._delays[i] = (prefix, extra, count - 1)
                break
        return max(d, 1e-6)

    # -- primitives -------------------------------------------------------------------------------

    def _clock(self, stream: str) -> Clock:
        return self._clocks.setdefault(stream, {})

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
        name = stream.name
        clock = self._clock(name)
        _merge(clock, self.host_clock)  # work launched now follows everything the host has seen
        clock[name] = clock.get(name, 0) + 1
        start = max(self.now, self._tail.get(name, 0.0))
        end = start + self._duration(name, label)
        self._tail[name] = end
        item = WorkItem(next(self._seq), name, label, start, end, dict(clock), tuple(reads), tuple(writes),
                        fn, on_start)
        self.history.append(item)
        # at equal times completions run before starts: work that waits on another starts once it ended
        heapq.heappush(self._events, (start, 1, item.seq, item))
        heapq.heappush(self._events, (end, 0, item.seq, item))

    def record(self, stream: Stream, label: str = "") -> ModeledEvent:
        self.counters.records += 1
        name = stream.name
        clock = self._clock(name)
        _merge(clock, self.host_clock)
        return ModeledEvent(stream=stream, label=label, time=max(self._tail.get(name, 0.0), 0.0),
                            clock=dict(clock))

    def stream_wait(self, stream: Stream, event: Event) -> None:
        self.counters.stream_waits += 1
        assert isinstance(event, ModeledEvent)
        name = stream.name
        self._tail[name] = max(self._tail.get(name, 0.0), event.time)
        _merge(self._clock(name), event.clock)

    def host_wait(self, event: Event, timeout: float | None = None) -> None:
        self.counters.host_waits += 1
        assert isinstance(event, ModeledEvent)
        if event.time > self.now:
            self.counters.host_waits_blocked += 1
            if timeout is not None and event.time - self.now > timeout:
                self.advance(timeout)
                raise TransferTimeoutError(f"host wait for {event.label or 'an event'} ran past {timeout}")
            self.advance_to(event.time)
        _merge(self.host_clock, event.clock)
        self.host_clock["host"] = self.host_clock.get("host", 0) + 1

    def query(self, event: Event) -> bool:
        assert isinstance(event, ModeledEvent)
        return event.time <= self.now

    # -- simulated time ----------------------------------------------------------------------------

    def advance_to(self, t: float) -> None:
        """Run every start and completion up to time `t`, in time order."""
        while self._events and self._events[0][0] <= t:
            time, phase, _seq, item = heapq.heappop(self._events)
            self.now = max(self.now, time)
            if phase == 1:
                item.started = True
                if item.on_start is not None:
                    item.on_start()
            else:
                item.done = True
                if item.fn is not None:
                    item.fn()
        self.now = max(self.now, t)

    def advance(self, dt: float) -> None:
        self.advance_to(self.now + dt)

    def synchronize(self) -> None:
        end = max(self._tail.values(), default=self.now)
        self.advance_to(end)
        for clock in self._clocks.values():
            _merge(self.host_clock, clock)

    @property
    def idle(self) -> bool:
        return not self._events
