"""The device backends: ordering, events, waits, timing and happens-before."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvchain.device import ModeledDevice, ThreadDevice
from kvchain.device.modeled import clock_leq
from kvchain.errors import InputError, KVChainError, TransferTimeoutError


def test_modeled_runs_work_at_simulated_completion_in_order():
    dev = ModeledDevice(seed=1)
    out = []
    s, f = dev.schedule_stream, dev.forward_stream
    dev.launch(s, lambda: out.append("s1"), label="s1")
    dev.launch(s, lambda: out.append("s2"), label="s2")
    ev = dev.record(s, "after s2")
    dev.stream_wait(f, ev)
    dev.launch(f, lambda: out.append("f1"), label="f1")
    assert out == []  # nothing ran: the host has not waited
    assert not dev.query(ev)
    dev.host_wait(ev)
    assert out == ["s1", "s2"] and dev.query(ev)
    dev.synchronize()
    assert out == ["s1", "s2", "f1"]
    assert dev.counters.host_waits_blocked >= 1


def test_modeled_timing_depends_on_the_seed_and_is_deterministic():
    def ends(seed):
        dev = ModeledDevice(seed=seed)
        for i in range(5):
            dev.launch(dev.forward_stream, None, label=f"w{i}")
        return [round(w.end, 6) for w in dev.history]

    assert ends(3) == ends(3)
    assert ends(3) != ends(4)


def test_modeled_delay_and_happens_before():
    dev = ModeledDevice(seed=0)
    dev.delay_next("slow", 100.0)
    dev.launch(dev.forward_stream, None, label="slow forward")
    dev.launch(dev.schedule_stream, None, label="unordered copy")
    ev = dev.record(dev.forward_stream)
    dev.stream_wait(dev.schedule_stream, ev)
    dev.launch(dev.schedule_stream, None, label="ordered copy")
    fwd, unordered, ordered = dev.history
    assert fwd.end - fwd.start > 100
    assert not clock_leq(fwd.clock, unordered.clock) and not clock_leq(unordered.clock, fwd.clock)
    assert clock_leq(fwd.clock, ordered.clock)
    assert ordered.start >= fwd.end


def test_modeled_host_wait_deadline():
    dev = ModeledDevice(seed=0)
    dev.delay_next("stuck", 1000.0)
    dev.launch(dev.stream("network"), None, label="stuck transfer")
    with pytest.raises(TransferTimeoutError):
        dev.host_wait(dev.record(dev.stream("network"), "transfer"), timeout=10.0)


def test_thread_device_orders_streams_by_events():
    dev = ThreadDevice()
    try:
        out = []
        gate = threading.Event()
        s, f = dev.schedule_stream, dev.forward_stream
        dev.launch(s, lambda: (gate.wait(5), out.append("slow schedule work")))
        ev = dev.record(s)
        dev.stream_wait(f, ev)
        dev.launch(f, lambda: out.append("forward"))
        time.sleep(0.05)
        assert out == []  # the forward stream waits; the host did not block
        gate.set()
        dev.synchronize()
        assert out == ["slow schedule work", "forward"]
        assert dev.query(ev)
    finally:
        dev.close()


def test_thread_device_forward_delay_starts_forwards_late():
    """A delayed forward stream lets schedule work queued after a launch run first, as it does when
    a busy accelerator starts a kernel late; with no delay the forward runs first."""
    for delay, first in ((0.3, "schedule"), (0.0, "forward")):
        dev = ThreadDevice(forward_delay=delay)
        try:
            out = []
            dev.launch(dev.forward_stream, lambda: None)  # the workers exist before the race below
            dev.synchronize()
            dev.launch(dev.forward_stream, lambda out=out: out.append("forward"))
            time.sleep(0.05)
            dev.launch(dev.schedule_stream, lambda out=out: out.append("schedule"))
            dev.synchronize()
            assert out[0] == first
        finally:
            dev.close()
    with pytest.raises(InputError):
        ThreadDevice(forward_delay=-1)


def test_thread_device_launch_delays_are_seeded_and_off_by_default():
    """HARN-14: seeded launch delays, as the CUDA device's spins: the same seed gives the same delay to
    the same launches, another seed others; each is at most `launch_delay * stream_scale[stream]`
    before the start and half that between start and body; a library user's device (no
    `launch_delay`) delays nothing."""
    def delays(dev: ThreadDevice) -> list[tuple[float, float]]:
        try:
            return [dev._delays(dev.stream(name)) for name in ("forward", "schedule", "copy") * 20]
        finally:
            dev.close()

    scale = {"forward": 8.0, "schedule": 1.0}
    a = delays(ThreadDevice(launch_delay=1e-4, seed=3, stream_scale=scale))
    assert a == delays(ThreadDevice(launch_delay=1e-4, seed=3, stream_scale=scale))
    assert a != delays(ThreadDevice(launch_delay=1e-4, seed=4, stream_scale=scale))
    for (before, during), name in zip(a, ("forward", "schedule", "copy") * 20):
        assert 0 <= before < 1e-4 * scale.get(name, 1.0) and during == pytest.approx(before / 2)
    assert max(b for b, _ in a[0::3]) > 1e-4  # forwards, scaled by 8, wait longer than any schedule item
    assert set(delays(ThreadDevice())) == {(0.0, 0.0)}
    assert set(delays(ThreadDevice(forward_delay=0.01))) == {(0.01, 0.0), (0.0, 0.0)}
    for bad in ({"launch_delay": -1e-4}, {"launch_delay": 1e-4, "stream_scale": {"copy": -1.0}}):
        with pytest.raises(InputError):
            ThreadDevice(**bad)


def test_thread_device_launch_delay_holds_a_kernel_between_start_and_body():
    """A delayed item runs `on_start`, waits, then its body: schedule work the host queues meanwhile
    lands between a forward's first and last reads, as it does on a busy accelerator."""
    dev = ThreadDevice(launch_delay=0.2, seed=0, stream_scale={"forward": 1.0, "schedule": 0.0})
    try:
        out = []
        dev.launch(dev.forward_stream, lambda: out.append("forward body"), on_start=lambda: out.append("forward start"))
        time.sleep(0.01)
        dev.launch(dev.schedule_stream, lambda: out.append("schedule"))
        dev.synchronize()
        assert out[0] == "schedule" or out == ["forward start", "schedule", "forward body"]
        assert out.index("schedule") < out.index("forward body")
    finally:
        dev.close()


def test_thread_device_host_wait_timeout_and_errors():
    dev = ThreadDevice()
    try:
        gate = threading.Event()
        dev.launch(dev.forward_stream, lambda: gate.wait(5))
        with pytest.raises(TransferTimeoutError):
            dev.host_wait(dev.record(dev.forward_stream), timeout=0.05)
        gate.set()
        dev.launch(dev.forward_stream, lambda: 1 / 0)
        with pytest.raises(KVChainError, match="ZeroDivisionError"):
            dev.synchronize()
    finally:
        dev.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_streams_and_events():
    from kvchain.device.cuda import CudaDevice

    dev = CudaDevice()
    x = torch.zeros(1 << 20, device="cuda")
    dev.launch(dev.schedule_stream, lambda: x.add_(1))
    ev = dev.record(dev.schedule_stream)
    dev.stream_wait(dev.forward_stream, ev)
    y = torch.empty_like(x)
    dev.launch(dev.forward_stream, lambda: y.copy_(x))
    dev.host_wait(dev.record(dev.forward_stream), timeout=10)
    assert float(y[0]) == 1.0


UNCLOSED = '''
import torch
from kvchain import ThreadDevice

device = ThreadDevice()
a = torch.ones(400, 400)


def fails():
    raise RuntimeError("a kernel failed")


def busy():
    for _ in range(20):
        a @ a


device.launch(device.forward_stream, fails)
for _ in range(5):
    device.launch(device.schedule_stream, busy)
device.synchronize()  # raises: the script ends with the device never closed
'''


def test_a_thread_device_never_closed_lets_a_failing_script_exit_cleanly(tmp_path):
    """A script that raises with its `ThreadDevice` still busy and never closed exits with Python's
    own error (1), not an abort (134, "terminate called without an active exception") from a worker
    left inside a torch kernel while the interpreter tears torch down."""
    import subprocess
    import sys

    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "a kernel failed" in done.stderr and "terminate called" not in done.stderr, done.stderr[-2000:]
