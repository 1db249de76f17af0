"""What a stress rank keeps track of: its requests (`Req`) and their statuses, host-tier copies and
network transfers (`Job`), and token positions to check (`_Tokens`). Its forwards in flight are the
step sequence's (`engine.steps.Launched`, carrying the batch's request ids)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..alloc.signals import HostTransfer, NetworkTransfer, ReceiveHold
from ..device.base import Event

# ----------------------------------------------------------------------------------- one rank

READY, LOADING, HELD, RECEIVING, SENDING = "ready", "loading", "held", "receiving", "sending"


@dataclass
class Req:
    """A request as the scheduler sees it. `written`: tokens whose writes were launched (a forward)
    or landed (a load or receive, once ended)."""

    rid: int
    row: int
    written: int = 0
    status: str = READY
    in_flight: int = 0
    hold: ReceiveHold | None = None


@dataclass
class Job:
    """A host-tier copy (backup, load) or a network transfer (send, receive)."""

    kind: str
    name: str
    rid: int | None
    done: Event | None = None
    transfer: HostTransfer | NetworkTransfer | None = None
    length: int = 0


@dataclass
class _Tokens:
    """Token positions to check: batch index, page column, offset, wanted value, tail (reads zero)."""

    rows: torch.Tensor
    cols: torch.Tensor
    offs: torch.Tensor
    want: torch.Tensor
    need: torch.Tensor  # wanted value known, or a tail position
