"""The step sequence alone (`engine/steps.py`): the order of launch, record, barrier, processing and
flush, how many forwards it keeps in flight, and the idle checks, on the modeled device and on real
threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvchain.device import ModeledDevice, ThreadDevice
from kvchain.device.base import PageAccess
from kvchain.engine import Forward, MetadataUpload, StepSequence
from kvchain.errors import InputError, InvariantError
from kvchain.testing.overlap import overlap_storage

DEVICES = {
    "modeled": lambda: ModeledDevice(seed=0, durations={"forward": 6.0}),
    "threads": ThreadDevice,
}


@pytest.fixture(params=sorted(DEVICES))
def storage(request):
    device = DEVICES[request.param]()
    yield overlap_storage(device, chain_kib=12)
    device.close()


def _request(storage, length: int) -> tuple[int, np.ndarray]:
    row = storage.alloc_row()
    return row, storage.alloc_extend(np.array([row]), np.array([length]))


def _forward(storage, row: int, vtok: np.ndarray, *, split: bool = True, upload: bool = True) -> Forward:
    """A forward with no kernels of its own: it only launches labelled work on the forward stream."""
    device = storage.device

    def reads(step: int) -> None:
        device.launch(device.forward_stream, None, label=f"forward:{step}:read")

    def writes(step: int) -> None:
        device.launch(device.forward_stream, None, label=f"forward:{step}:write")

    meta = MetadataUpload(lambda: None, (PageAccess(-1, np.arange(1)),)) if upload else None
    return Forward(reads, writes if split else None, storage.iteration_ids(vtok, np.array([row])), meta)


class _Log:
    """Every step-sequence hook the storage sees and the device work launched, recorded and waited
    outside those hooks, in order."""

    HOOKS = ("order_forward_after_schedule", "forward_launched", "record_forward", "apply_war_barrier",
             "forward_processed", "flush_opportunistic")

    def __init__(self, storage, monkeypatch) -> None:
        self.entries: list[tuple] = []
        self._inside = 0
        device = storage.device
        for name in self.HOOKS:
            monkeypatch.setattr(storage, name, self._hook(name, getattr(storage, name)))
        for name in ("launch", "record", "host_wait", "stream_wait"):
            monkeypatch.setattr(device, name, self._device(name, getattr(device, name)))
        self.waits: list = []

    def _hook(self, name, original):
        def hook(*args, **kwargs):
            self._inside += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self._inside -= 1
            step = getattr(out, "step", None) if name == "forward_launched" else getattr(
                args[0] if args else None, "step", None)
            self.entries.append((name,) if step is None else (name, step))
            return out
        return hook

    def _device(self, name, original):
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            if name == "stream_wait":
                self.waits.append((args[0].name, args[1]))
            if self._inside:
                return out
            if name == "launch":
                self.entries.append(("launch", args[0].name, kwargs.get("label", "")))
            elif name == "record":
                self.entries.append(("record", args[0].name, kwargs.get("label", args[1] if len(args) > 1 else "")))
            elif name == "host_wait":
                self.entries.append(("host_wait", args[0].label))
            return out
        return call


def test_an_overlap_step_launches_records_barriers_then_processes_the_previous_result_then_flushes(
        storage, monkeypatch):
    """LIFE-4, LIFE-6, LIFE-21/22/23, LIFE-28, COMP-3: one step uploads its metadata on the schedule
    stream, orders the forward stream after it, opens the launch record, launches the forward with
    its shared-read end and `forward_done`, records it, applies the write-after-read barrier; only
    then does the host wait the previous forward, retire it, hand it to the driver, and flush."""
    handled = []
    steps = StepSequence(storage, depth=1, on_processed=lambda x: handled.append((x.step, x.payload)))
    row1, vtok1 = _request(storage, 6)
    first = steps.step(_forward(storage, row1, vtok1), "first")
    assert first.launched is not None and first.processed == () and len(steps.in_flight) == 1
    row2, vtok2 = _request(storage, 5)
    forward = _forward(storage, row2, vtok2)
    log = _Log(storage, monkeypatch)
    result = steps.step(forward, "second")
    s1, s2 = first.launched.step, result.launched.step
    assert log.entries == [
        ("launch", "schedule", "upload"),
        ("order_forward_after_schedule",),
        ("forward_launched", s2),
        ("launch", "forward", f"forward:{s2}:read"),
        ("record", "forward", f"shared_read_done:{s2}"),
        ("launch", "forward", f"forward:{s2}:write"),
        ("record", "forward", f"forward_done:{s2}"),
        ("record_forward", s2),
        ("apply_war_barrier",),
        ("host_wait", f"forward_done:{s1}"),
        ("forward_processed", s1),
        ("flush_opportunistic",),
    ]
    assert handled == [(s1, "first")]  # after forward_processed, before the flush (no storage call between)
    assert [x.step for x in result.processed] == [s1] and [x.step for x in steps.in_flight] == [s2]
    # the barrier waited the running forward's shared-read end (LIFE-4)
    barrier = [event for stream, event in log.waits if stream == "schedule"]
    assert [e.label for e in barrier] == [f"shared_read_done:{s2}"]
    assert result.moved == 0 and result.flush_host_waits == 0


def test_a_forward_without_a_shared_read_end_makes_the_barrier_wait_the_whole_forward_stream(storage, monkeypatch):
    """LIFE-5: a forward that declares no shared-read end records none; the barrier then waits an
    event recorded on the forward stream behind everything launched there."""
    steps = StepSequence(storage)
    log = _Log(storage, monkeypatch)
    row, vtok = _request(storage, 4)
    launched = steps.launch(_forward(storage, row, vtok, split=False, upload=False), None)
    assert launched.record.shared_read_done is None
    assert not any(e[0] == "record" and e[2].startswith("shared_read_done") for e in log.entries)
    barrier = [event for stream, event in log.waits if stream == "schedule"]
    assert len(barrier) == 1 and barrier[0].stream is storage.device.forward_stream
    assert barrier[0].label == "war barrier"
    steps.drain()
    steps.check_idle()


def test_without_the_barrier_nothing_waits_on_the_schedule_stream(storage, monkeypatch):
    steps = StepSequence(storage, war_barrier=False)
    log = _Log(storage, monkeypatch)
    row, vtok = _request(storage, 4)
    steps.launch(_forward(storage, row, vtok), None)
    assert ("apply_war_barrier",) not in log.entries
    assert not [stream for stream, _ in log.waits if stream == "schedule"]
    steps.drain()


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_step_keeps_depth_forwards_in_flight_and_a_step_without_a_forward_processes_them_all(storage, depth):
    """LIFE-23: forwards are processed oldest first; after a step that launched one, `depth` stay in
    flight (1: the overlap scheduler's N+1 running while N is processed)."""
    order = []
    steps = StepSequence(storage, depth=depth, on_processed=lambda x: order.append(x.payload))
    for k in range(4):
        row, vtok = _request(storage, 3)
        steps.step(_forward(storage, row, vtok), k, flush=False)
        assert len(steps.in_flight) == min(depth, k + 1)
    assert order == list(range(4 - depth))
    result = steps.step(None, None)
    assert result.launched is None and [x.payload for x in result.processed] == list(range(4 - depth, 4))
    assert order == [0, 1, 2, 3] and not steps.in_flight
    steps.check_idle()
    assert (steps.stats.launched, steps.stats.processed, steps.stats.flushes) == (4, 4, 1)


def test_processing_waits_the_forward_before_retiring_it(storage):
    """LIFE-28: `forward_processed` runs only once the host has waited `forward_done`: by then every
    kernel of the forward ran (on threads: the flag the kernel set is visible)."""
    device = storage.device
    ran = []

    def reads(step: int) -> None:
        device.launch(device.forward_stream, lambda: ran.append(step), label=f"forward:{step}:read")

    steps = StepSequence(storage, depth=0)
    row, vtok = _request(storage, 4)
    seen = []
    steps.on_processed = lambda x: seen.append((x.step, list(ran), x.record.processed))
    result = steps.step(Forward(reads, ids=storage.iteration_ids(vtok, np.array([row]))), None)
    step = result.launched.step
    assert seen == [(step, [step], True)]


@pytest.mark.parametrize(("barrier", "want"), [(True, ["read", "schedule"]), (False, ["schedule", "read"])])
def test_the_barrier_holds_schedule_stream_work_until_the_forward_s_shared_reads_end(barrier, want):
    """LIFE-4 on real threads: schedule-stream work queued after the barrier runs only once the
    running forward's shared reads are over; without the barrier it runs while they still run."""
    device = ThreadDevice()
    try:
        storage = overlap_storage(device, chain_kib=12)
        gate, scheduled = threading.Event(), threading.Event()
        order: list[str] = []

        def read() -> None:
            gate.wait(5.0)
            order.append("read")

        def launch_reads(step: int) -> None:
            device.launch(device.forward_stream, read, label=f"forward:{step}:read")

        def launch_writes(step: int) -> None:
            device.launch(device.forward_stream, None, label=f"forward:{step}:write")

        def schedule_work() -> None:
            order.append("schedule")
            scheduled.set()

        row, vtok = _request(storage, 4)
        steps = StepSequence(storage, war_barrier=barrier)
        steps.launch(Forward(launch_reads, launch_writes, storage.iteration_ids(vtok, np.array([row]))), None)
        device.launch(device.schedule_stream, schedule_work, label="zero")
        scheduled.wait(0.3)  # long enough for unordered work to run first
        gate.set()
        steps.drain()
        device.synchronize()
        assert order == want
    finally:
        device.close()


def test_idle_checks_raise_on_a_forward_never_processed(storage):
    """CHK-15: at idle nothing the sequence launched is left unprocessed."""
    steps = StepSequence(storage)
    row, vtok = _request(storage, 4)
    launched = steps.launch(_forward(storage, row, vtok), None)
    with pytest.raises(InvariantError, match=rf"steps.idle_in_flight: 1 forwards .*steps \[{launched.step}\]"):
        steps.check_idle()
    steps.drain()
    steps.check_idle()


def test_idle_checks_raise_on_a_leaked_page(storage, monkeypatch):
    """CHK-15, CHK-17: at idle a page no row or holder accounts for is a leak, and with the strict
    switch on (its default) the idle check raises, naming the sub-pool and the counts."""
    steps = StepSequence(storage)
    row, vtok = _request(storage, 4)
    steps.step(_forward(storage, row, vtok), None)
    steps.step(None, None)
    slots = storage.alloc_state_slots(2)  # taken, and held by nobody the check is told of
    with pytest.raises(InvariantError, match=r"storage.idle_leak: state: \d+ live pages, rows and holders account for \d+"):
        steps.check_idle()
    steps.check_idle({"state": len(slots)})
    monkeypatch.setenv("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "0")
    steps.check_idle()  # not strict: the leak is logged, not raised


def test_processing_with_nothing_in_flight_and_a_negative_depth_are_refused(storage):
    steps = StepSequence(storage)
    with pytest.raises(InvariantError, match="no forward in flight"):
        steps.process_oldest()
    with pytest.raises(InputError, match="not -1"):
        StepSequence(storage, depth=-1)


def test_the_flush_is_bounded_and_counted(storage):
    """COMP-3: the sequence's flush enters through the pool's opportunistic flush, with the bound it
    is given, and counts what it moved."""
    storage.allocator.compaction_gap_fraction = 1.0
    steps = StepSequence(storage, depth=0)
    rows = [_request(storage, 9)[0] for _ in range(6)]
    storage.free_rows(np.array(rows[::2]))
    before = storage.stats().moves
    assert steps.flush(max_moves=1) == storage.stats().moves - before <= len(storage.allocator.bands)
    moved = steps.flush()
    assert steps.stats.moved == storage.stats().moves - before and steps.stats.flushes == 2 and moved >= 0


@pytest.mark.parametrize("at_start", [True, False])
def test_a_read_then_write_forward_launches_two_labelled_kernels_around_the_shared_read_end(storage, monkeypatch,
                                                                                            at_start):
    """LIFE-4: `Forward.read_then_write` reads, then the sequence records the shared-read end, then
    it writes; with `read_at_start` the read also runs as its kernel starts."""
    calls = []
    row, vtok = _request(storage, 4)
    forward = Forward.read_then_write(storage.device, lambda step: calls.append(("read", step)),
                                      lambda: calls.append(("write",)), reads=(), writes=(),
                                      ids=storage.iteration_ids(vtok, np.array([row])), read_at_start=at_start)
    log = _Log(storage, monkeypatch)
    steps = StepSequence(storage, depth=0)
    step = steps.step(forward, None, flush=False).processed[0].step
    device_entries = [e for e in log.entries if e[0] in ("launch", "record")]
    assert device_entries == [("launch", "forward", f"forward:{step}:read"),
                              ("record", "forward", f"shared_read_done:{step}"),
                              ("launch", "forward", f"forward:{step}:write"),
                              ("record", "forward", f"forward_done:{step}")]
    assert calls == [("read", step)] * (2 if at_start else 1) + [("write",)]
