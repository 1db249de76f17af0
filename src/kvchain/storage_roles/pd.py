"""`PDTransfers`: the allocator side of prefill/decode disaggregation.

A prefill node sends a request's pages; a decode node receives into pages it took. The transfer
engine runs outside every stream, so a network use can only be waited on the host; relief first
plans around network-held rows and waits them only when no such layout exists (PD-6, PD-7)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np

from ..alloc.signals import NetworkTransfer, ReceiveHold


@runtime_checkable
class PDTransfers(Protocol):
    """Network transfers and receive holds, keyed by physical ids (translated at submission)."""

    @abstractmethod
    def record_network_transfer(self, transfer: NetworkTransfer, pages: dict[str, np.ndarray]) -> None:
        """Record a PD send (reads `pages`) or receive (writes them): one NETWORK use per named band
        (PD-1), until the transfer is released. A source a send reads is vacated, not reused, when
        compaction moves it; capacity answers change (the capacity epoch moves). Raises `InputError`
        for a sub-pool the plan lacks."""

    @abstractmethod
    def end_network_transfer(self, transfer: NetworkTransfer) -> None:
        """The transfer released its pages (LEDG-4): its uses leave every ledger, with its fences,
        and vacated pages it alone held return to use. Ending a released transfer again is a
        no-op."""

    @abstractmethod
    def hold_receive_rows(self, name: str, pages: dict[str, np.ndarray]) -> ReceiveHold:
        """Hold a request's receive pages (physical, per sub-pool name) where they are until their
        ids reach the peer (PD-8): compaction leaves them, relief keeps them in place when it can.
        Returns the hold to pass to `published`. Holds nest: a page two holds cover stays held
        until both are published. Raises `InputError` for a sub-pool the plan lacks."""

    @abstractmethod
    def published(self, hold: ReceiveHold) -> None:
        """The held pages' ids reached the peer: they may move again. Publishing a hold twice is a
        no-op."""
