"""`CudaDevice`: torch.cuda streams and events. Launched callables run under their stream, so the
kernels they enqueue run on it; host waits poll the event until their deadline."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError, TransferTimeoutError
from .base import Device, Event, PageAccess, Stream


@dataclass(eq=False)
class CudaEvent(Event):
    handle: torch.cuda.Event | None = None


@dataclass(eq=False)
class CudaStream(Stream):
    handle: torch.cuda.Stream | None = None


class CudaDevice(Device):
    name = "cuda"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        if not torch.cuda.is_available():
            raise InputError("CudaDevice needs CUDA, which is not available on this machine")
        super().__init__()
        self.device = torch.device(device)

    def _make_stream(self, name: str) -> Stream:
        return CudaStream(name, self, torch.cuda.Stream(device=self.device))

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
        assert isinstance(stream, CudaStream)
        with torch.cuda.stream(stream.handle):
            if on_start is not None:
                on_start()
            if fn is not None:
                fn()

    def record(self, stream: Stream, label: str = "") -> CudaEvent:
        self.counters.records += 1
        assert isinstance(stream, CudaStream)
        event = torch.cuda.Event()
        event.record(stream.handle)
        return CudaEvent(stream=stream, label=label, handle=event)

    def stream_wait(self, stream: Stream, event: Event) -> None:
        self.counters.stream_waits += 1
        assert isinstance(stream, CudaStream) and isinstance(event, CudaEvent)
        stream.handle.wait_event(event.handle)

    def host_wait(self, event: Event, timeout: float | None = None) -> None:
        self.counters.host_waits += 1
        assert isinstance(event, CudaEvent)
        if event.handle.query():
            return
        self.counters.host_waits_blocked += 1
        if timeout is None:
            event.handle.synchronize()
            return
        deadline = time.monotonic() + timeout
        while not event.handle.query():
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"host wait for {event.label or 'an event'} ran past {timeout} s")
            time.sleep(50e-6)

    def query(self, event: Event) -> bool:
        assert isinstance(event, CudaEvent)
        return bool(event.handle.query())
