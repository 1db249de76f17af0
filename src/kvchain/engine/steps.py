"""The scheduler side of one step, written once (LIFE-4..6, LIFE-21..23, LIFE-28, COMP-3, CHK-15).

Under an overlap scheduler forward N+1 is launched before forward N is processed, and the order of
the hooks around a forward is what keeps the pool's pages safe. Every driver of a `KVStorage` (the
overlap driver, the stress harness, the trace recorder, a model-free serving loop, an engine that
runs a model) goes through this one sequence:

1. **launch** (`StepSequence.launch`): the step's metadata upload on the schedule stream, the
   forward stream waiting the schedule stream (`order_forward_after_schedule`), the launch record
   (`forward_launched`, LIFE-21), the forward's own kernels with its shared-read end and its
   `forward_done` event, then `record_forward` (LIFE-22);
2. **write-after-read barrier** (`apply_war_barrier`, LIFE-4/5), right after the launch and before
   the previous result is processed (LIFE-6);
3. **processing the previous result** (`process_oldest`): the host waits the forward's
   `forward_done` (LIFE-28), `forward_processed` retires it (LIFE-23), and only then the driver's
   own handling of the result (frees, window retirement) runs;
4. **early-processing flush** (`flush`): the opportunistic flush, between steps (COMP-3);
5. **idle checks** (`check_idle`): nothing left in flight, then the pool's leak, row and byte
   checks (CHK-15).

`step` runs 1-4 in that order, as an overlap loop does; a driver that interleaves them by hand (the
stress harness and the trace recorder run one operation at a time) calls the parts. A driver brings
what differs: its forward's kernels (`Forward`), what it keeps per forward (the payload of
`Launched`), and what processing a result means to it (`on_processed`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..alloc.forward_steps import LaunchRecord
from ..alloc.iteration_ids import IterationIds
from ..device.base import Device, Event, PageAccess
from ..errors import InputError, InvariantError
from ..storage import KVStorage
from ..units import is_integer

P = TypeVar("P")


@dataclass(frozen=True)
class MetadataUpload:
    """The step's metadata write on the schedule stream: the page tables and state slots the forward
    reads, copied into the buffers it reads them from. `writes` names those buffers' rows, so a
    device that tracks accesses orders the upload against the forward still reading them."""

    run: Callable[[], None]
    writes: Sequence[PageAccess] = ()
    label: str = "upload"


@dataclass(frozen=True)
class Forward:
    """One forward as a driver hands it to the sequence.

    `reads(step)` launches, on the forward stream, the kernels that read the forward's shared inputs
    (its metadata and the KV pages). With `writes`, the sequence then records the shared-read end,
    which the write-after-read barrier waits (LIFE-4), and `writes(step)` launches the rest; without
    it the forward declares no shared-read end and the barrier waits the whole forward stream
    (LIFE-5). `ids` are the ids the forward writes (None: unknown, as for a speculative forward,
    LIFE-36). `upload`, when given, runs on the schedule stream before the forward stream is
    ordered after it."""

    reads: Callable[[int], None]
    writes: Callable[[int], None] | None = None
    ids: IterationIds | None = None
    upload: MetadataUpload | None = None

    @classmethod
    def read_then_write(cls, device: Device, read: Callable[[int], None], write: Callable[[], None], *,
                        reads: Sequence[PageAccess], writes: Sequence[PageAccess], ids: IterationIds | None,
                        upload: MetadataUpload | None = None, read_at_start: bool = False) -> Forward:
        """A forward of two kernels on the forward stream: `read(step)` over its shared inputs
        `reads` (labelled `forward:N:read`), then, after the shared-read end, `write()` over `writes`
        (`forward:N:write`). With `read_at_start`, `read` also runs as its kernel starts: a payload
        check of what a kernel reads all through its run sees both ends of it."""

        def launch_read(step: int) -> None:
            def run() -> None:
                read(step)

            device.launch(device.forward_stream, run, on_start=run if read_at_start else None, reads=reads,
                          label=f"forward:{step}:read")

        def launch_write(step: int) -> None:
            device.launch(device.forward_stream, write, writes=writes, label=f"forward:{step}:write")

        return cls(launch_read, launch_write, ids, upload)


@dataclass
class Launched(Generic[P]):
    """A forward launched and not yet processed: its launch record, its `forward_done` event and what
    the driver keeps with it (its rows, its requests)."""

    record: LaunchRecord
    done: Event
    payload: P

    @property
    def step(self) -> int:
        return self.record.step


@dataclass(frozen=True)
class StepResult(Generic[P]):
    """What one `StepSequence.step` did: the forward it launched (None: nothing was scheduled), the
    results it processed, oldest first, and its flush (`moved` pages, None when it did not flush;
    `flush_host_waits`: host waits that blocked inside the flush, which must stay 0, COMP-5)."""

    launched: Launched[P] | None
    processed: tuple[Launched[P], ...]
    moved: int | None
    flush_host_waits: int = 0


@dataclass
class SequenceStats:
    launched: int = 0
    processed: int = 0
    flushes: int = 0
    moved: int = 0


class StepSequence(Generic[P]):
    """The launch / record / barrier / process / flush / idle order for one `KVStorage`.

    `depth`: forwards left in flight after a step that launched one (1: an overlap scheduler, which
    processes forward N after launching N+1; 0: a loop that processes each forward in its own step).
    `war_barrier`: apply the write-after-read barrier after each launch; only a driver that shows
    what goes wrong without it turns it off (LIFE-8 keeps it on for every device). `on_processed`:
    the driver's handling of a processed result (frees, window retirement), run after
    `forward_processed`, so pages it frees do not pend under the forward just retired."""

    def __init__(self, storage: KVStorage, *, depth: int = 1, war_barrier: bool = True,
                 on_processed: Callable[[Launched[P]], object] | None = None) -> None:
        if not is_integer(depth) or depth < 0:
            raise InputError(f"a step sequence keeps 0 or more forwards in flight, not {depth!r}")
        if not isinstance(war_barrier, bool):
            raise InputError(f"war_barrier must be a bool, not {war_barrier!r}")
        self.storage = storage
        self.depth = depth
        self.war_barrier = war_barrier
        self.on_processed = on_processed
        self.in_flight: deque[Launched[P]] = deque()
        self.stats = SequenceStats()

    @property
    def device(self) -> Device:
        return self.storage.device

    # -- 1, 2: launch and the barrier --------------------------------------------------------------

    def launch(self, forward: Forward, payload: P) -> Launched[P]:
        """Launch one forward (LIFE-21/22) and apply the write-after-read barrier (LIFE-4..6)."""
        storage, device = self.storage, self.device
        if forward.upload is not None:
            upload = forward.upload
            device.launch(device.schedule_stream, upload.run, writes=upload.writes, label=upload.label)
        storage.order_forward_after_schedule()
        record = storage.forward_launched()
        step = record.step
        forward.reads(step)
        shared = None
        if forward.writes is not None:
            shared = device.record(device.forward_stream, f"shared_read_done:{step}")
            forward.writes(step)
        done = device.record(device.forward_stream, f"forward_done:{step}")
        storage.record_forward(record, done, forward.ids, shared_read_done=shared)
        launched = Launched(record, done, payload)
        self.in_flight.append(launched)
        self.stats.launched += 1
        if self.war_barrier:
            storage.apply_war_barrier()
        return launched

    # -- 3: processing a result --------------------------------------------------------------------

    def process_oldest(self, handle: Callable[[Launched[P]], object] | None = None) -> Launched[P]:
        """Process the oldest forward in flight: the host waits its `forward_done` (LIFE-28),
        `forward_processed` retires it (LIFE-23), then `handle` (by default `on_processed`) runs."""
        if not self.in_flight:
            raise InvariantError("steps.process_empty", "no forward in flight to process")
        launched = self.in_flight.popleft()
        self.device.host_wait(launched.done)
        self.storage.forward_processed(launched.record)
        self.stats.processed += 1
        handle = handle or self.on_processed
        if handle is not None:
            handle(launched)
        return launched

    def process_until(self, keep: int) -> tuple[Launched[P], ...]:
        """Process the oldest forwards until at most `keep` remain in flight."""
        out = []
        while len(self.in_flight) > keep:
            out.append(self.process_oldest())
        return tuple(out)

    def drain(self) -> tuple[Launched[P], ...]:
        """Process every forward in flight (the device is not synchronized: the caller decides)."""
        return self.process_until(0)

    # -- 4: the early-processing flush -------------------------------------------------------------

    def flush(self, max_moves: int | None = None) -> int:
        """The opportunistic flush between steps (COMP-3): at most `max_moves` page moves per end
        band (None: `KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL`). Returns the pages moved."""
        moved = self.storage.flush_opportunistic(max_moves)
        self.stats.flushes += 1
        self.stats.moved += moved
        return moved

    # -- 1-4 in order ------------------------------------------------------------------------------

    def step(self, forward: Forward | None, payload: P, *, flush: bool = True,
             max_moves: int | None = None) -> StepResult[P]:
        """One overlap step after scheduling: launch the scheduled forward (None: nothing was
        scheduled) and apply the barrier, process results until `depth` forwards remain in flight
        (none when nothing was launched), then flush."""
        launched = self.launch(forward, payload) if forward is not None else None
        processed = self.process_until(self.depth if launched is not None else 0)
        moved = None
        waits = 0
        if flush:
            counters = self.device.counters
            before = counters.host_waits_blocked
            moved = self.flush(max_moves)
            waits = counters.host_waits_blocked - before
        return StepResult(launched, processed, moved, waits)

    # -- 5: idle -----------------------------------------------------------------------------------

    def check_idle(self, held: dict[str, int] | None = None) -> None:
        """The idle checks (CHK-15): no forward left unprocessed, then the pool's own checks (no page
        pending, none leaked beyond what rows and `held` account for, row states, byte accounting),
        which raise on a leak while `KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE` is on (CHK-17)."""
        if self.in_flight:
            steps = [x.step for x in self.in_flight]
            raise InvariantError("steps.idle_in_flight",
                                 f"{len(steps)} forwards launched and never processed (steps {steps[:4]})")
        self.storage.check_idle(held)
