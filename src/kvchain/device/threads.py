"""`ThreadDevice`: real concurrency on a CPU. Each stream is a worker thread that runs its work in
order; events are `threading.Event`s set when the work queued before them has run; a stream wait
blocks that stream's worker, never the host. Torch releases the GIL in its kernels, so page copies,
zeroing and forwards really overlap, and a missing wait corrupts real bytes."""

from __future__ import annotations

import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import InputError, KVChainError, TransferTimeoutError
from .base import Device, Event, PageAccess, Stream


@dataclass(eq=False)
class ThreadEvent(Event):
    flag: threading.Event = field(default_factory=threading.Event)
    #: gates made before this event was recorded (`ThreadDevice(gate_ops=)`): all the held work
    #: it can depend on, since a stream only waits events recorded before the wait is queued
    gates_before: int = 0


class _Worker:
    def __init__(self, name: str) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"kvchain-stream-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            kind, payload = self.queue.get()
            if kind == "stop":
                return
            try:
                if kind == "run":
                    gate, before, during, on_start, fn = payload
                    if gate is not None:
                        gate.wait()
                    if before:
                        time.sleep(before)
                    if on_start is not None:
                        on_start()
                    if during:
                        time.sleep(during)
                    if fn is not None:
                        fn()
                elif kind == "wait":
                    payload.flag.wait()
                elif kind == "set":
                    payload.flag.set()
            except BaseException as exc:  # surfaced to the host at its next wait
                if self.error is None:
                    self.error = exc
                if kind == "set":
                    payload.flag.set()


class ThreadDevice(Device):
    """`forward_delay`: seconds each piece of forward-stream work waits before it starts, as a busy
    accelerator starts a launched kernel late; the host runs on meanwhile, so schedule-stream work
    queued after the launch really meets the forward still running (tests that show what a missing
    wait corrupts set it).

    `launch_delay` (seconds, 0: off, as library users run it): seeded delays on every stream, as
    `kvchain stress --device cuda` spins each launched kernel. Each launched item waits
    `u * launch_delay * stream_scale[stream]` before it starts and half that again between its start
    (`on_start`) and its body (`fn`), as a kernel runs a while between its first and its last
    reads; `u` is uniform in [0, 1), drawn at launch on the host from `random.Random(seed)`, so a
    seed gives the same delays to the same launches (the threads still interleave as they will).
    The stress harness sets it, so a missing wait meets the work it should have waited.

    `gate_ops` (0: off): each item launched on a stream other than the schedule stream (forwards,
    host-tier copies, network transfers) is held, before it starts, until the host has reached `u`
    more operations (`host_op`), `u` drawn uniform in [0, gate_ops] from the same seeded generator;
    a host wait on unfinished work opens the gates made before its event was recorded (all the
    held work the event can depend on: a stream waits only events recorded before the wait is
    queued), so work launched later stays held (a forward queued behind the one the host
    processes); `synchronize` and `close` open every gate (the host never waits work it holds).
    Delays of microseconds do not outlast a host that spends milliseconds per operation; a gate
    does, so schedule-stream work queued a few operations later without the waits it needs meets
    a forward or a transfer before it has read."""

    name = "threads"

    def __init__(self, forward_delay: float = 0.0, *, launch_delay: float = 0.0, seed: int = 0,
                 stream_scale: Mapping[str, float] | None = None, gate_ops: int = 0) -> None:
        super().__init__()
        if gate_ops < 0:
            raise InputError(f"a forward gate holds 0 or more host operations, not {gate_ops}")
        if forward_delay < 0:
            raise InputError(f"a forward delay is 0 or more seconds, not {forward_delay}")
        if launch_delay < 0:
            raise InputError(f"a launch delay is 0 or more seconds, not {launch_delay}")
        scale = dict(stream_scale or {})
        if any(v < 0 for v in scale.values()):
            raise InputError(f"stream delay scales are 0 or more, not {scale}")
        self.forward_delay = forward_delay
        self.launch_delay = launch_delay
        self.stream_scale = scale
        self._rng = random.Random(seed)
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()
        self.gate_ops = gate_ops
        self._host_ops = 0
        self._gates: list[tuple[int, int, threading.Event]] = []  # (host operation it opens at, serial, gate)
        self._gates_made = 0
        # A device its user never closed (a script that raised) still stops its workers before the
        # interpreter exits: a worker inside a torch kernel while torch's own state is torn down
        # aborts the process ("terminate called without an active exception", exit code 134).
        self._stop_workers = weakref.finalize(self, _stop, self._workers, self._gates)

    def host_op(self) -> None:
        """The host reached its next operation: open the gates held until it (`gate_ops`)."""
        self._host_ops += 1
        if self._gates:
            self._open_gates(lambda at, _serial: at <= self._host_ops)

    def _open_gates(self, which: Callable[[int, int], bool] | None = None) -> None:
        """Open the gates `which(host operation, serial)` selects (None: every gate)."""
        keep = []
        for at, serial, gate in self._gates:
            if which is None or which(at, serial):
                gate.set()
            else:
                keep.append((at, serial, gate))
        self._gates[:] = keep  # in place: the exit hook holds this list

    def _gate(self, stream: Stream) -> threading.Event | None:
        if not self.gate_ops or stream.name == self.SCHEDULE:
            return None
        hold = self._rng.randint(0, self.gate_ops)
        if not hold:
            return None
        gate = threading.Event()
        self._gates.append((self._host_ops + hold, self._gates_made, gate))
        self._gates_made += 1
        return gate

    def _worker(self, stream: Stream) -> _Worker:
        worker = self._workers.get(stream.name)
        if worker is None:
            with self._lock:
                worker = self._workers.setdefault(stream.name, _Worker(stream.name))
        return worker

    def _delays(self, stream: Stream) -> tuple[float, float]:
        """This launch's wait before its start and between its start and its body."""
        before = self.forward_delay if stream.name == self.FORWARD else 0.0
        if not self.launch_delay:
            return before, 0.0
        spin = self._rng.random() * self.launch_delay * self.stream_scale.get(stream.name, 1.0)
        return before + spin, spin / 2

    def _raise_worker_errors(self) -> None:
        for name, worker in self._workers.items():
            if worker.error is not None:
                error, worker.error = worker.error, None
                if isinstance(error, InputError):  # what the caller handed in, refused where it ran
                    raise InputError(f"{error} (on stream {name!r})") from error
                raise KVChainError(f"work on stream {name!r} failed: {error!r}") from error

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
        gate = self._gate(stream)
        before, during = self._delays(stream)
        self._worker(stream).queue.put(("run", (gate, before, during, on_start, fn)))

    def record(self, stream: Stream, label: str = "") -> ThreadEvent:
        self.counters.records += 1
        event = ThreadEvent(stream=stream, label=label, gates_before=self._gates_made)
        self._worker(stream).queue.put(("set", event))
        return event

    def stream_wait(self, stream: Stream, event: Event) -> None:
        self.counters.stream_waits += 1
        assert isinstance(event, ThreadEvent)
        if not event.flag.is_set():
            self._worker(stream).queue.put(("wait", event))

    def host_wait(self, event: Event, timeout: float | None = None) -> None:
        self.counters.host_waits += 1
        assert isinstance(event, ThreadEvent)
        if not event.flag.is_set():
            if self._gates:
                self._open_gates(lambda _at, serial: serial < event.gates_before)
            self.counters.host_waits_blocked += 1
            if not event.flag.wait(timeout):
                raise TransferTimeoutError(f"host wait for {event.label or 'an event'} ran past {timeout} s")
        self._raise_worker_errors()

    def query(self, event: Event) -> bool:
        assert isinstance(event, ThreadEvent)
        return event.flag.is_set()

    def synchronize(self) -> None:
        self._open_gates()
        for name in list(self._workers):
            self.host_wait(self.record(self.stream(name), "synchronize"))
        self._raise_worker_errors()

    def close(self) -> None:
        self._stop_workers()
        # work launched after a close starts new workers: they are stopped the same way
        self._stop_workers = weakref.finalize(self, _stop, self._workers, self._gates)


def _stop(workers: dict[str, _Worker], gates: list[tuple[int, int, threading.Event]]) -> None:
    """Open every gate, stop every worker once its queued work has run, and wait for them."""
    for _at, _serial, gate in gates:
        gate.set()
    gates.clear()
    for worker in workers.values():
        worker.queue.put(("stop", None))
    deadline = time.monotonic() + 10.0  # a worker held on an event nobody will set is left behind
    for worker in workers.values():
        worker.thread.join(timeout=max(0.0, deadline - time.monotonic()))
    workers.clear()
