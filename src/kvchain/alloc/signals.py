"""What a wait waits for: forward events (device), host copies (device events on a copy stream),
and network transfers, which run outside every stream and so are waited by the host.

A `NetworkTransfer` is released logically (`KVStorage.end_network_transfer`, or when a host wait
for it returns), the same on every rank. A host wait has a deadline
(`KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT`) and raises naming every transfer still in flight."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import env, faults
from ..device.base import Device, Event
from ..errors import TransferTimeoutError

_transfer_ids = itertools.count(1)


@dataclass(eq=False)
class NetworkTransfer:
    """One PD send (reads its pages) or receive (writes them). `done` is the event the transfer
    engine fires when the remote side has finished with the pages."""

    name: str
    sends: bool
    done: Event | None = None
    id: int = field(default_factory=lambda: next(_transfer_ids))
    released: bool = False

    def __repr__(self) -> str:
        return f"NetworkTransfer({self.name}#{self.id}, {'send' if self.sends else 'receive'})"


@dataclass(eq=False)
class HostTransfer:
    """One host-tier copy: a backup reads its pages (COPY_READ), a load writes them (COPY_WRITE).
    `done` is its finish event on the copy stream."""

    name: str
    writes: bool
    done: Event
    id: int = field(default_factory=lambda: next(_transfer_ids))
    ended: bool = False


@dataclass(eq=False)
class ReceiveHold:
    """Receive rows a decode node holds until their physical ids are published: compaction leaves
    them alone and relief keeps them in place when it can."""

    name: str
    pages: dict[int, object]  # band index -> physical page ids
    published: bool = False


MinReduce = Callable[[bool], bool]


class NetworkTransferWaiter:
    """Host waits for network transfers. Each rank judges its own engine; `all_done` (a MIN-reduce
    across the ranks that share the layout, identity by default) makes every rank leave the wait in
    the same round, and past the deadline every rank raises in the same round."""

    def __init__(self, device: Device, all_done: MinReduce | None = None) -> None:
        self.device = device
        self.all_done = all_done or (lambda local: local)

    def wait(self, transfers: Sequence[NetworkTransfer], timeout: float | None = None) -> None:
        if timeout is None:
            timeout = float(env.get("KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT"))
        pending = [t for t in transfers if not t.released]
        if not pending:
            return
        if faults.ACTIVE and faults.active(faults.RELEASE_NETWORK_EARLY):
            for t in pending:
                t.released = True
            return
        try:
            for t in pending:
                if t.done is not None:
                    self.device.host_wait(t.done, timeout=timeout)
            local_done = True
        except TransferTimeoutError:
            local_done = False
        if not self.all_done(local_done):
            names = ", ".join(repr(t) for t in pending)
            raise TransferTimeoutError(f"page move waited past {timeout} s for transfers still in flight: {names}")
        for t in pending:
            t.released = True
