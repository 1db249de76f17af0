"""`ChainWaits`: the chain's one dispatch of waits, and its ledger across bands.

Every wait the allocator performs is a `Wait` that `page_usage.clearance` (the one reader of
`CLEARANCE`) returned, and it is performed here, in `_clear`: a stream wait queued on the schedule
stream (the host never blocks), a host wait for a transfer, or the check that a page the consumer
must not take was not chosen. Fences (bytes that left a band while something may still touch them)
are kept here and cleared before anything writes over them. `ChainAllocator` is built on this."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import faults
from ..device.base import Device, Event
from ..errors import InvariantError
from . import invariants
from .band import Band
from .forward_steps import ForwardSteps
from .page_usage import Clear, Consumer, Fence, Hazard, Wait, clearance
from .signals import HostTransfer, NetworkTransfer, NetworkTransferWaiter


class ChainWaits:
    """Waits, fences and transfers over every band of one chain (the state `ChainAllocator` sets up)."""

    bands: list[Band]
    device: Device
    forward_steps: ForwardSteps
    fences: list[Fence]
    waiter: NetworkTransferWaiter
    #: when a list, every decision (pages chosen, frontiers, moves, waits) is appended to it
    decisions: list | None

    def _clear(self, band: Band, waits: Sequence[Wait], waited: set[int] | None = None) -> None:
        """Perform what `page_usage.clearance` said must happen before `band` writes: stream waits
        on the schedule stream (each event once), host waits for transfers, and the checks that a
        page needing a retired forward or excluded from the consumer was not chosen."""
        if waited is None:
            waited = set()
        for wait in waits:
            use = wait.use
            clear = wait.clear
            if clear is Clear.STREAM_WAIT:
                if use.event is not None and use.event.seq not in waited:
                    waited.add(use.event.seq)
                    self._stream_wait(band, use.event, wait.why)
            elif clear is Clear.HOST_WAIT:
                self.wait_transfers([use.transfer])
            elif clear is Clear.AFTER_RETIRE:
                if use.step is not None and use.step > self.forward_steps.processed_through:
                    raise InvariantError("page_usage.after_retire",
                                         f"{band.name}: {wait.why}: chose pages an unretired forward uses")
            elif clear is Clear.EXCLUDED:
                raise InvariantError("page_usage.excluded", f"{band.name}: {wait.why}: chose {use}")

    def _stream_wait(self, band: Band, event: Event, why: str) -> None:
        """Queue a wait on the schedule stream: the host never blocks (LIFE-29)."""
        invariants.before_wait()
        device = self.device
        device.stream_wait(device.schedule_stream, event)
        band.stats["stream_waits"] += 1
        self.log("stream_wait", band.name, why, event.label)

    def _settle(self, band: Band, n_batches: int | None = None, park: bool = True) -> None:
        """Settle pending batches of one band (`Band.settle_pending`) and queue their waits."""
        waits, fences = band.settle_pending(n_batches, park)
        if waits:
            self._settle_waits(band, waits)
        self._add_fences(fences)

    def _settle_waits(self, band: Band, waits: Sequence[Wait]) -> None:
        if faults.ACTIVE and faults.active(faults.SKIP_SETTLE_WAIT):
            return
        self._clear(band, waits)

    def _add_fences(self, fences: Sequence[Fence]) -> None:
        if fences:
            self.fences += fences

    # -- the ledger across bands ------------------------------------------------------------------

    def log(self, kind: str, *fields) -> None:
        if self.decisions is not None:
            self.decisions.append((kind, *(f.tolist() if isinstance(f, np.ndarray) else f for f in fields)))

    def network_transfers(self) -> list[NetworkTransfer]:
        seen: dict[int, NetworkTransfer] = {}
        for band in self.bands:
            for use in band.usage.uses:
                if use.hazard is Hazard.NETWORK and isinstance(use.transfer, NetworkTransfer):
                    seen.setdefault(use.transfer.id, use.transfer)
        return list(seen.values())

    def wait_transfers(self, transfers: Sequence[NetworkTransfer]) -> None:
        """Host-wait network transfers (the transfer engine runs outside every stream), then release
        them everywhere (LEDG-4). Past the deadline this raises naming the transfers in flight."""
        transfers = [t for t in transfers if t is not None and not t.released]
        if not transfers:
            return
        self.log("host_wait", [t.name for t in transfers])
        self.waiter.wait(transfers)
        for t in transfers:
            self.end_transfer(t)

    def end_transfer(self, transfer: NetworkTransfer | HostTransfer) -> None:
        """A transfer is over (released, or its host copy acknowledged): end its uses in every band
        and the fences it left, and return vacated pages it alone held."""
        if isinstance(transfer, NetworkTransfer):
            transfer.released = True
        else:
            transfer.ended = True
        key = self.forward_steps.newest_unprocessed()
        for band in self.bands:
            if band.usage.end_transfer(transfer):
                band.epoch.bump()
            self._add_fences(band.take_ready_vacated(key))
        self.fences = [f for f in self.fences if f.use.transfer is not transfer]

    def wait_fences(self, band: Band, ids: np.ndarray) -> None:
        """Before `band` writes bytes that left another band (or itself), clear their fences on the
        schedule stream (COMP-20); a fence cleared there is dropped."""
        if not self.fences or not len(ids):
            return
        lo, hi = band.byte_ranges(ids)
        a, b = int(lo.min()), int(hi.max())
        keep = []
        waited: set[int] = set()
        skip_streams = faults.ACTIVE and faults.active(faults.SKIP_FENCE_WAITS)
        # a host wait below may end a transfer whose pages park a float, which appends fences to
        # this very list: they are visited too
        for fence in self.fences:
            if fence.hi <= a or fence.lo >= b or not ((lo < fence.hi) & (hi > fence.lo)).any():
                keep.append(fence)
                continue
            waits = clearance(Consumer.SCHEDULE_COPY, (fence.use,), f"fence left by {fence.use.label}")
            if skip_streams:
                waits = [w for w in waits if w.clear is not Clear.STREAM_WAIT]
            self._clear(band, [w for w in waits if w.clear in (Clear.STREAM_WAIT, Clear.HOST_WAIT)], waited)
        self.fences = keep
