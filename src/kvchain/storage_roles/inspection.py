"""`Inspection`: usage figures and the idle checks.

`check_idle` is the pool's integrity method: run when no forward is in flight, it proves that what
rows and holders account for is exactly what is live, and that every byte of the chain is counted
once (CHK-15)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class StorageStats:
    """Pages per sub-pool by state, and the chain's bytes: a snapshot, never updated."""

    live_pages: dict[str, int]
    hole_pages: dict[str, int]
    pending_pages: dict[str, int]
    span_pages: dict[str, int]
    live_bytes: int
    chain_bytes: int
    active_rows: int
    moves: int
    #: float bands relocated so far (each a whole float's live pages copied to a new block)
    relocations: int = 0

    @property
    def utilisation(self) -> float:
        return self.live_bytes / max(1, self.chain_bytes)


@runtime_checkable
class Inspection(Protocol):
    """Reads only, except that a failed check raises."""

    @abstractmethod
    def stats(self) -> StorageStats:
        """Live, hole, pending and span pages per sub-pool, live and chain bytes, rows in use,
        pages moved and float relocations so far. Reads counters only (no device sync)."""

    @abstractmethod
    def expected_live_pages(self) -> dict[str, int]:
        """Live pages per sub-pool that the rows in use account for: the owner one per page a row
        owns (past its tree-shared prefix), each window the rows it still binds, state one per slot
        held by a row."""

    @abstractmethod
    def check_idle(self, held: dict[str, int] | None = None) -> None:
        """The idle checks (CHK-15), with no forward in flight: no page pending
        (`forward_steps.idle_pending`), live pages per sub-pool equal to what rows and `held` (the
        prefix tree's, say) account for, row states sound, byte conservation. A leak or a bad row
        raises `InvariantError` (`storage.idle_leak`) unless
        KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE is off, which logs it instead (CHK-17); the
        other checks always raise (`forward_steps.idle_pending`, `chain.byte_accounting`)."""
