"""The device protocol under the allocator: streams, events, stream and host waits, launched work.

Backends: `ImmediateDevice` (work completes at launch), `ModeledDevice` (deterministic, seeded
simulated timing, vector clocks), `ThreadDevice` (a worker thread per stream, real concurrency on a
CPU) and `CudaDevice` (torch.cuda streams and events)."""

from .base import Device, Event, PageAccess, Stream
from .immediate import ImmediateDevice
from .modeled import ModeledDevice
from .threads import ThreadDevice

__all__ = ["Device", "Event", "ImmediateDevice", "ModeledDevice", "PageAccess", "Stream", "ThreadDevice"]
