"""`ForwardHooks`: the overlap scheduler's calls around each step.

An overlap scheduler launches forward N+1 before it processes forward N. Each step is launched,
recorded (its `done` event and the ids it writes), barriered against the previous step's reads,
then processed once a completion covering it has been synchronised. Pages freed in between pend
under the newest recorded forward and return to use when it is processed (LIFE-21..23)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np

from ..alloc.forward_steps import LaunchRecord
from ..alloc.iteration_ids import IterationIds
from ..device.base import Event


@runtime_checkable
class ForwardHooks(Protocol):
    """Steps are launched, recorded and processed in launch order; a step breaking that order
    raises `InvariantError` naming the `forward_steps.*` check, before anything changed."""

    @abstractmethod
    def forward_launched(self, has_forward: bool = True) -> LaunchRecord:
        """Open a step (LIFE-21). Until it is recorded no page may be taken or freed (LIFE-31). A
        step without a forward of its own records no event and advances nothing (LIFE-35). The
        record stays the step's handle until `forward_processed`. Raises `InvariantError`
        (`forward_steps.launch_open`) while the previous launch is not yet recorded."""

    @abstractmethod
    def order_forward_after_schedule(self) -> None:
        """The forward stream waits the schedule stream, so the next forward follows every zeroing,
        move and state copy queued before it. Queues one stream wait; the host never waits."""

    @abstractmethod
    def record_forward(
        self,
        record: LaunchRecord,
        done: Event,
        writes: IterationIds | None,
        shared_read_done: Event | None = None,
    ) -> None:
        """Record the open step's forward (LIFE-22): its `done` event, fresh for every record, and
        the physical ids it writes (`writes=None` for a speculative step whose writes are unknown:
        compaction then moves nothing in any band until it is processed, LIFE-36).
        `shared_read_done` fires once its shared reads (metadata, KV pages) are over; the WAR
        barrier waits it. From now on frees pend under this forward and its writes are hazards in
        every band's ledger. Raises `InvariantError`: `forward_steps.record_order` when `record`
        is not the open launch, `forward_steps.fresh_event` for a reused event, and, with
        KVCHAIN_CHECK_KV_PAGE_INVARIANTS on, `requests.length_bounds` (CHK-18) for a row length out
        of bounds."""

    @abstractmethod
    def apply_war_barrier(self) -> None:
        """After each launch and before the previous result is processed, the schedule stream
        waits the running forward's shared-read end, or the whole forward stream when it declared
        none (LIFE-4/5/6). Queues one stream wait; the host never waits."""

    @abstractmethod
    def forward_processed(self, record: LaunchRecord) -> None:
        """The step's result was processed, after a host synchronisation that covers its forward
        (LIFE-28): pages pending under it return to the holes and its uses leave every ledger
        (LIFE-23). Raises `InvariantError`: `forward_steps.process_order` when an earlier step is
        unprocessed, `forward_steps.unrecorded` when its forward was never recorded."""

    @abstractmethod
    def reset_new_rows(self) -> np.ndarray:
        """Rows handed out since the last call: the next forward resets their request state on its
        own stream before its kernels (LIFE-18). Clears the marks; a second call returns none."""

    @abstractmethod
    def flush_opportunistic(self, max_moves: int | None = None) -> int:
        """Close holes lazily, between steps: at most KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL
        moves per end band, only where the free gap is tight; boundary holes are always absorbed.
        Returns the pages moved; when it is not 0 `move_epoch` changed and physical ids read before
        are stale. Rows and virtual ids are untouched."""
