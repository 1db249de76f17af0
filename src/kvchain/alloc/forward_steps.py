"""`ForwardSteps` and `PendingPages`: pages freed while a forward may still touch them.

Under an overlap scheduler, forward N+1 is launched before forward N is processed. A page freed
while a recorded forward is unprocessed joins its band's pending batches, keyed by the newest
such forward and its event. It counts as free in capacity, and returns to the holes when that
forward is processed (`Band.release_pending_through`) or when a take settles its batch (the stream
waits the event; the host never does).

`ForwardSteps` only keeps the order of the steps: `forward_processed` returns the step it retired
and the chain (`ChainAllocator.forward_processed`) retires it in every band."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..device.base import Event
from ..errors import InvariantError
from .pricing import CapacityEpoch


@dataclass
class PendingBatch:
    """Pages freed under one forward: they wait its event (or its processing)."""

    key: int  # the forward's step id
    event: Event
    ids: list[np.ndarray] = field(default_factory=list)
    size: int = 0

    def pages(self) -> np.ndarray:
        if len(self.ids) > 1:
            self.ids = [np.concatenate(self.ids)]
        return self.ids[0] if self.ids else np.empty(0, dtype=np.int64)


class PendingPages:
    """One band's pending batches, oldest first. Batches sharing an event stay one batch."""

    def __init__(self) -> None:
        self.batches: deque[PendingBatch] = deque()
        self.count = 0

    def add(self, key: int, event: Event, ids: np.ndarray) -> None:
        if not len(ids):
            return
        if self.batches and self.batches[-1].key == key:
            batch = self.batches[-1]
        else:
            if self.batches and self.batches[-1].key > key:
                raise InvariantError("forward_steps.pending_order", f"batch key {key} after {self.batches[-1].key}")
            batch = PendingBatch(key, event)
            self.batches.append(batch)
        batch.ids.append(ids)
        batch.size += len(ids)
        self.count += len(ids)

    def oldest_covering(self, pages: int) -> int:
        """How many oldest batches must settle to free at least `pages` pages."""
        got = 0
        for n, batch in enumerate(self.batches, 1):
            got += batch.size
            if got >= pages:
                return n
        return len(self.batches)

    def pop_oldest(self, n: int) -> list[PendingBatch]:
        out = [self.batches.popleft() for _ in range(n)]
        self.count -= sum(b.size for b in out)
        return out

    def pop_through(self, key: int) -> list[PendingBatch]:
        out = []
        while self.batches and self.batches[0].key <= key:
            out.append(self.batches.popleft())
        self.count -= sum(b.size for b in out)
        return out

    def __iter__(self) -> Iterator[PendingBatch]:
        return iter(self.batches)


@dataclass
class LaunchRecord:
    """One scheduler step from launch to processing."""

    step: int
    has_forward: bool
    event: Event | None = None
    recorded: bool = False
    writes_known: bool = True
    processed: bool = False
    shared_read_done: Event | None = None


class ForwardSteps:
    """The forwards in flight, in launch order, and the assertions that keep pending pages sound:

    * no managed page is freed or allocated between a step's launch and the recording of its event;
    * recorded forwards are processed in launch order, each with a fresh event;
    * with no recorded forward in flight, no page is pending (`check_idle`)."""

    def __init__(self, epoch: CapacityEpoch) -> None:
        self.epoch = epoch
        self.next_step = 1
        self.in_flight: deque[LaunchRecord] = deque()
        self.processed_through = 0  # every forward with step <= this is processed (retired)
        self._open: LaunchRecord | None = None
        self._seen_events: set[int] = set()

    def forward_launched(self, has_forward: bool = True) -> LaunchRecord:
        if self._open is not None:
            raise InvariantError("forward_steps.launch_open", f"step {self._open.step} launched but never recorded")
        record = LaunchRecord(self.next_step, has_forward)
        self.next_step += 1
        self.in_flight.append(record)
        self._open = record if has_forward else None
        return record

    def forward_recorded(self, record: LaunchRecord, event: Event | None, writes_known: bool = True) -> None:
        if not record.has_forward:
            if event is not None:
                raise InvariantError("forward_steps.no_forward_event", f"step {record.step} has no forward to record")
            return
        if self._open is not record:
            raise InvariantError("forward_steps.record_order", f"step {record.step} is not the open launch")
        if event is None or event.seq in self._seen_events:
            raise InvariantError("forward_steps.fresh_event", f"step {record.step} must record a fresh event")
        self._seen_events.add(event.seq)
        record.event = event
        record.recorded = True
        record.writes_known = writes_known
        self._open = None
        self.epoch.bump()  # frees now pend: capacity answers may change

    def forward_processed(self, record: LaunchRecord) -> int | None:
        """Mark the oldest step processed; returns its step when it had a forward (which the chain
        then retires), else None."""
        if not self.in_flight or self.in_flight[0] is not record:
            head = self.in_flight[0].step if self.in_flight else None
            raise InvariantError(
                "forward_steps.process_order", f"step {record.step} processed before step {head} (launch order)"
            )
        if record.has_forward and not record.recorded:
            raise InvariantError("forward_steps.unrecorded", f"step {record.step} processed before it was recorded")
        self.in_flight.popleft()
        record.processed = True
        if not record.has_forward:
            return None
        self.processed_through = record.step
        return record.step

    def assert_no_open_launch(self, what: str, band: str, n: int) -> None:
        """Called by every take and free of a managed page (LIFE-31)."""
        if self._open is not None:
            raise InvariantError(
                "forward_steps.page_between_launch_and_record",
                f"{what} of {n} {band} pages between the launch of step {self._open.step} "
                "and the recording of its event",
            )

    def assert_closed(self, what: str) -> None:
        """Called by every call that changes a row's length or frees a row (LIFE-31), before any
        change: the launched forward's metadata was built from the rows as they stand."""
        if self._open is not None:
            raise InvariantError(
                "forward_steps.page_between_launch_and_record",
                f"{what} between the launch of step {self._open.step} and the recording of its event",
            )

    def newest_unprocessed(self) -> LaunchRecord | None:
        """The newest recorded, unprocessed forward: the key of a page freed now."""
        for record in reversed(self.in_flight):
            if record.recorded:
                return record
        return None

    def check_idle(self, pending: dict[str, int]) -> None:
        """With no recorded forward in flight, no band (name: pending pages) holds a pending page."""
        if self.newest_unprocessed() is None:
            for name, count in pending.items():
                if count:
                    raise InvariantError(
                        "forward_steps.idle_pending",
                        f"{name}: {count} pages pending with no recorded forward in flight",
                    )
