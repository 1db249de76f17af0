"""`Translation`: virtual ids to the physical ids kernels and copies use, once per iteration.

Rows and the scheduler hold virtual ids; kernels index each sub-pool's typed views by physical
ids. Translation happens once per sub-pool per iteration (IDS-8, IDS-9). A physical id is valid until
the next move: `move_epoch` tells a reader when to translate again (PD-17)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np

from ..alloc.iteration_ids import IterationIds
from ..alloc.runner_ids import RunnerIds
from ..device.base import Device
from ..layout.views import SubPoolView


@runtime_checkable
class Translation(Protocol):
    """Reads only: nothing here takes, frees or moves a page."""

    @property
    @abstractmethod
    def device(self) -> Device:
        """The device the allocator's work runs on (streams, events, counters)."""

    @property
    @abstractmethod
    def move_epoch(self) -> int:
        """Moves since start: physical ids read under one value stay valid while it holds; a reader
        re-reads them when it changed (PD-17)."""

    @abstractmethod
    def view(self, name: str) -> SubPoolView:
        """The sub-pool's typed tensors `[n_pages, ...]` per layer component, indexed by physical
        page id; the view itself never changes. Raises `InputError` for a sub-pool the plan lacks."""

    @abstractmethod
    def iteration_ids(self, virtual_tokens: np.ndarray, rows: np.ndarray | None = None) -> IterationIds:
        """Where a forward writes: per sub-pool the physical token ids of `virtual_tokens` (an
        unbound page, a retired window row, writes the sink), and the physical state slots of
        `rows` when given. Valid until `move_epoch` changes."""

    @abstractmethod
    def runner_ids(self, rows: np.ndarray) -> RunnerIds:
        """What a forward reads: per attention sub-pool a physical page table over the rows' pages
        (an unbound page reads the sink, never a freed page), and each row's physical state slot
        (-1 for none). Valid until `move_epoch` changes."""

    @abstractmethod
    def physical_pages(self, sub_pool: str, virtual: np.ndarray) -> np.ndarray:
        """Physical page ids (slots for state) behind bound virtual ids, at the submission of a
        host-tier copy or a transfer (HIC-7). Raises `InvariantError` (`band.free_of_bound_page`)
        when one is not bound, and `InputError` for a sub-pool the plan lacks."""
