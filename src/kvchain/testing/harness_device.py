"""The devices a stress rank runs on: `HarnessDevice`, the modeled device that reports stream waits
and landed writes to the checks; `thread_device`, worker threads with seeded delays; and
`cuda_device`, real CUDA streams with seeded delays (HARN-14)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch

from ..device.base import Device, Event, PageAccess, Stream
from ..device.modeled import ModeledDevice, clock_leq
from ..device.threads import ThreadDevice
from .checks import ByteShadow, HostReadTracker
from .harness_config import RankTiming

# ----------------------------------------------------------------------------------- the device



class HarnessDevice(ModeledDevice):
    """A `ModeledDevice` that tells its rank about stream waits (`host_read_after_wait`) and
    updates the byte shadow as each item's writes land (`cross_dtype_bytes`)."""

    def __init__(self, timing: RankTiming) -> None:
        super().__init__(seed=timing.seed, durations={"forward": timing.forward, "copy": timing.copy,
                                                      "network": timing.network, "schedule": timing.schedule})
        self.shadow: ByteShadow | None = None
        self.reads: HostReadTracker | None = None

    def launch(self, stream: Stream, fn: Callable[[], None] | None, *, reads: Sequence[PageAccess] = (),
               writes: Sequence[PageAccess] = (), label: str = "", on_start: Callable[[], None] | None = None) -> None:
        shadow = self.shadow
        if shadow is not None and writes:
            partial = label.startswith("forward:")

            def landed() -> None:
                if fn is not None:
                    fn()
                shadow.landed(reads, writes, partial)

            super().launch(stream, landed, reads=reads, writes=writes, label=label, on_start=on_start)
        else:
            super().launch(stream, fn, reads=reads, writes=writes, label=label, on_start=on_start)

    def stream_wait(self, stream: Stream, event: Event) -> None:
        if self.reads is not None:
            unfinished = not clock_leq(getattr(event, "clock", {}), self.host_clock)
            self.reads.stream_wait(stream.name, event.label, unfinished)
        super().stream_wait(stream, event)


#: the threads device's launch delay per unit of a stream's mean duration (seconds): a forward of
#: mean 8 waits up to 0.4 ms before it starts and 0.2 ms more before its body, while the host, a few
#: operations on, queues the work a missing wait would not hold back
THREAD_LAUNCH_DELAY = 50e-6
#: the threads device holds each forward, copy and network item until the host is up to this many
#: operations on (seeded per item, `ThreadDevice(gate_ops=)`), so work a missing wait lets through
#: meets it
THREAD_GATE_OPS = 6
#: real time one unit of a `tick`'s simulated time takes on the threads device (seconds)
THREAD_TICK = 20e-6


class HarnessThreadDevice(ThreadDevice):
    """`ThreadDevice` with the rank's seeded launch delays; a `tick` lets real time pass."""

    def __init__(self, timing: RankTiming) -> None:
        super().__init__(launch_delay=THREAD_LAUNCH_DELAY, seed=timing.seed, stream_scale={
            "forward": timing.forward, "copy": timing.copy, "network": timing.network, "schedule": timing.schedule},
            gate_ops=THREAD_GATE_OPS)

    def advance(self, dt: float) -> None:
        time.sleep(dt * THREAD_TICK)


def thread_device(timing: RankTiming) -> Device:
    """Worker threads whose every launch is delayed by the rank's seeded amount (HARN-14)."""
    return HarnessThreadDevice(timing)


def cuda_device(timing: RankTiming) -> Device:
    """`CudaDevice` with every launched item delayed by a seeded spin, so missing waits show (HARN-14)."""
    from ..device.cuda import CudaDevice

    class DelayedCudaDevice(CudaDevice):
        def __init__(self) -> None:
            super().__init__()
            self.rng = random.Random(timing.seed)
            self.scale = {"forward": timing.forward, "copy": timing.copy, "network": timing.network}

        def launch(self, stream, fn, *, reads=(), writes=(), label="", on_start=None):
            cycles = int(self.rng.random() * self.scale.get(stream.name, 1.0) * 200_000)

            def start() -> None:
                torch.cuda._sleep(cycles)
                if on_start is not None:
                    on_start()

            def end() -> None:
                torch.cuda._sleep(cycles // 2)
                if fn is not None:
                    fn()

            super().launch(stream, end, reads=reads, writes=writes, label=label, on_start=start)

        def advance(self, dt: float) -> None:
            pass

    return DelayedCudaDevice()
