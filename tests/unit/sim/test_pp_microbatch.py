"""Pipeline micro-batches in flight on each stage (`sim/pp_microbatch.py`): the write-after-read
barrier once per launched micro-batch, after that iteration's result processing (LIFE-7), with
every stage's capacity digest checked every iteration."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.forward_steps import LaunchRecord
from kvchain.alloc.stage_capacity import check_stage_agreement
from kvchain.device import ModeledDevice, ThreadDevice
from kvchain.errors import InputError
from kvchain.sim.pp import build_stage, install_stages
from kvchain.sim.pp_microbatch import MicroBatchStageLoop
from kvchain.testing.checks import Granules, OverlapTracker
from support.stages import spec


@pytest.fixture(autouse=True)
def _checks(monkeypatch):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "1")


def _stages(pp_size: int, war_barrier: bool, seed: int = 3, devices=None):
    s = spec(16)
    devices = devices or [ModeledDevice(seed=10 + i, durations={"forward": 6.0 + 2.0 * i}) for i in range(2)]
    pools = [build_stage(s, i, backend=devices[i]) for i in range(2)]
    install_stages(pools)
    return [MicroBatchStageLoop(p.storage, pp_size, seed=seed, war_barrier=war_barrier) for p in pools]


def _run(loops, iterations: int) -> int:
    for it in range(iterations):
        digests = [loop.iterate() for loop in loops]
        for stage in range(1, len(loops)):
            check_stage_agreement(digests[stage], digests[stage - 1], stage, it)
    for loop in loops:
        loop.drain()
        loop.storage.check_idle()
    return iterations


def _conflicts(loop) -> list[str]:
    storage = loop.storage
    tracker = OverlapTracker(Granules(storage.allocator.layout, storage.table.rows))
    return tracker.consume(storage.device.history)


@pytest.mark.parametrize("pp_size", [2, 3])
def test_the_barrier_after_result_processing_keeps_reused_rows_safe(pp_size):
    """LIFE-7: `pp_size` micro-batches in flight; result processing aborts the chunked request
    while its next chunk still runs, and hands its row out again. With the barrier once per launched
    micro-batch, after the result processing, no read sees another row's page table and the modeled
    device finds no unordered access; both stages' digests agree every iteration."""
    loops = _stages(pp_size, war_barrier=True)
    _run(loops, 200)
    for loop in loops:
        st = loop.stats
        assert st.launched > 120 and st.finished > 10 and st.aborted_in_flight > 5 and st.rows_checked > 400
        assert st.mismatches == [] and _conflicts(loop) == []
    assert loops[0].digests == loops[1].digests
    assert loops[0].stats.moves != loops[1].stats.moves  # the stages' real layouts differ


@pytest.mark.parametrize("pp_size", [2, 3])
def test_without_the_barrier_an_in_flight_micro_batch_reads_a_rewritten_row(pp_size):
    """LIFE-7, the check is real: skip the barrier and the next upload into a row (a reused row of
    an aborted chunked request, or the chunked request's next chunk) lands while an in-flight
    micro-batch still reads it; the payload check and the device's happens-before check both see
    it. The capacity decisions, and so the digests, still agree."""
    loops = _stages(pp_size, war_barrier=False)
    _run(loops, 200)
    for loop in loops:
        assert loop.stats.mismatches
        assert any("writes metadata row" in c and "forward:" in c for c in _conflicts(loop))
    assert loops[0].digests == loops[1].digests


def test_each_iteration_launches_then_processes_then_applies_the_barrier(monkeypatch):
    """LIFE-7: each iteration launches micro-batch m with `pp_size` in flight, processes the result
    of the micro-batch launched before it (the oldest), and only then applies the barrier once,
    which waits the launched micro-batch's shared-read end."""
    pp_size = 3
    loop = _stages(pp_size, war_barrier=True)[0]
    storage, device = loop.storage, loop.storage.device
    log: list[tuple] = []
    launched: dict[int, LaunchRecord] = {}
    for name in ("record_forward", "forward_processed", "apply_war_barrier"):
        original = getattr(storage, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            record = args[0] if args and isinstance(args[0], LaunchRecord) else None
            out = _original(*args, **kwargs)
            if _name == "record_forward":
                launched[record.step] = record
                log.append((_name, record.step, len(storage.allocator.forward_steps.in_flight)))
            else:
                log.append((_name, record.step if record else None, None))
            return out

        monkeypatch.setattr(storage, name, wrapped)
    waits = []
    original_wait = device.stream_wait
    monkeypatch.setattr(device, "stream_wait", lambda stream, event: (waits.append((stream.name, event)),
                                                                        original_wait(stream, event))[1])
    iterations = []
    for _ in range(120):
        start = len(log)
        waits.clear()
        loop.iterate()
        iterations.append((log[start:], [e for s, e in waits if s == "schedule"]))
    checked = 0
    for entries, schedule_waits in iterations:
        if not entries or entries[0][0] != "record_forward":
            assert all(name != "apply_war_barrier" for name, *_ in entries)  # no launch: no barrier
            continue
        _, step, in_flight = entries[0]
        names = [name for name, *_ in entries]
        assert names.count("apply_war_barrier") == 1 and names[-1] == "apply_war_barrier", entries
        if in_flight == pp_size:  # the pipeline is full: the oldest is processed before the barrier
            assert names[1:] == ["forward_processed", "apply_war_barrier"], entries
            assert entries[1][1] == step - (pp_size - 1)
            checked += 1
        shared = launched[step].shared_read_done
        assert shared is not None and shared in schedule_waits
    assert checked > 40


def test_the_thread_device_runs_the_micro_batches_clean():
    """LIFE-7 on real threads: with the barrier, no read sees another row's page table."""
    devices = [ThreadDevice(), ThreadDevice()]
    try:
        loops = _stages(2, war_barrier=True, devices=devices)
        _run(loops, 120)
        assert all(loop.stats.mismatches == [] and loop.stats.aborted_in_flight > 0 for loop in loops)
        assert loops[0].digests == loops[1].digests
    finally:
        for d in devices:
            d.close()


def test_a_micro_batch_loop_needs_two_micro_batches():
    storage = build_stage(spec(16), 0, backend=ModeledDevice(seed=0)).storage
    with pytest.raises(InputError, match="2 or more micro-batches"):
        MicroBatchStageLoop(storage, 1)
    assert np.all(storage.table.seq_lens == 0)
