"""The device protocol under the allocator: streams, events, stream and host waits, launched work.

Backends: `ImmediateDevice` (work completes at launch), and the asynchronous backends that run the
same allocator with work in flight."""

from .base import Device, Event, PageAccess, Stream
from .immediate import ImmediateDevice

__all__ = ["Device", "Event", "ImmediateDevice", "PageAccess", "Stream"]
