"""`HostTier`: the allocator side of host-memory backups and loads.

A backup copies live pages to host memory while they stay in use (a read); a load copies host pages
into fresh device pages (a write) that are fixed under a reservation until the tree names them
(HIC-4..6). Every copy is in the ledger from its record to its end, so the next writer of its pages
waits its event on a stream and the host never waits (LEDG-3, HIC-2)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np

from ..alloc.page_usage import PageUse
from ..alloc.signals import HostTransfer
from ..device.base import Event


@runtime_checkable
class HostTier(Protocol):
    """Host-tier copies. Physical ids handed to a copy are translated at submission
    (`physical_pages`, HIC-7); a load's pages are fixed, so no move changes them while it runs."""

    @abstractmethod
    def alloc_load(self, sub_pool: str, n: int) -> tuple[np.ndarray, PageUse]:
        """`n` physical pages of `sub_pool` for a load, fixed under a load reservation (HIC-4): no
        compaction or relocation moves them until `end_load_reservations`. Settles pending pages
        first when the holes do not cover the load (HIC-5) and relieves the chain when the band is
        short (ALLOC-19). Returns the pages and the reservation. Raises `CapacityError`, changing
        nothing, when no layout serves the load, and `InputError` for a sub-pool the plan lacks."""

    @abstractmethod
    def end_load_reservations(self, sub_pool: str, reservation: PageUse) -> None:
        """End a load reservation: its pages may move again (HIC-6, HIC-8). A page another
        reservation still covers stays fixed."""

    @abstractmethod
    def bind_loaded(self, sub_pool: str, physical: np.ndarray) -> np.ndarray:
        """Fresh ids for a load's pages of the owner (virtual pages, for the tree to hold) or of the
        state sub-pool (slot ids), bound to `physical`: pages `alloc_load` took, still under their
        reservation and bound to nothing. Window rows are named by owner ids instead
        (`UnifiedRadixCache.name_loaded_window_rows_by_owner`, HIC-6). Raises `InputError` for a
        window sub-pool or pages no load reserved, and `CapacityError` when the ids run short."""

    @abstractmethod
    def record_host_transfer(self, name: str, writes: bool, pages: dict[str, np.ndarray], done: Event) -> HostTransfer:
        """Record a host-tier copy of physical `pages` per sub-pool name, finishing at `done`: a
        backup reads them (`writes=False`, COPY_READ), a load writes them (COPY_WRITE). Returns the
        transfer, in every named band's ledger until `end_host_transfer`; until then the next
        writer of its pages waits `done` on its stream (LEDG-3, HIC-2). Raises `InputError` for a
        sub-pool the plan lacks."""

    @abstractmethod
    def end_host_transfer(self, transfer: HostTransfer) -> None:
        """The copy is over (its finish acknowledged): its uses leave every ledger, with the fences
        it left in the arena, and vacated pages it alone held return to use."""
