"""The small pool protocol the scheduler loop drives, so other pool designs plug into the same
loop for side-by-side comparison (and a model runner can attach later)."""

from __future__ import annotations

from typing import Protocol

from ..prefill_budget import Admission
from .policies import SchedulePolicy
from .pool import PoolStats
from .request import ScheduledRequest


class Pool(Protocol):
    name: str
    page_size: int
    #: what admission charges and who gives way on a full pool (`engine/policies.py`)
    policy: SchedulePolicy

    def arrival_check(self, req: ScheduledRequest) -> str | None:
        """None when the request could ever run (its max_new may be clipped to what fits); else
        the reason it is rejected at arrival, with the numbers."""

    def begin_pass(self, running: list[ScheduledRequest], frees_coming: bool) -> object:
        """Context for one admission pass (what running requests still need, what is reclaimable)."""

    def try_admit(self, pass_ctx: object, req: ScheduledRequest, token_limit: int) -> Admission:
        """Decide, and on ADMIT take the request's row and its first chunk (after its cached prefix)."""

    def next_chunk(self, req: ScheduledRequest, token_limit: int) -> int:
        """How many more prompt tokens a running prefill computes this step (0: wait a step)."""

    def extend(self, reqs: list[ScheduledRequest], new_lens: list[int]) -> None:
        """Grow running requests' KV to new lengths, making room from the cache if needed.
        Raises PoolFull with nothing changed."""

    def forward(self, reqs: list[ScheduledRequest]) -> None:
        """The step's forward over `reqs`, through the one step sequence (`engine/steps.py`): launched,
        recorded, processed; processing calls `processed`."""

    def processed(self, reqs: list[ScheduledRequest]) -> None:
        """After a step's forward: take checkpoints, retire window rows."""

    def finish(self, req: ScheduledRequest) -> None:
        """Cache what can be reused and free the rest."""

    def preempt(self, req: ScheduledRequest) -> None:
        """Give all of a running request's memory back; it recomputes later."""

    def retract_victims(self, plan: list[tuple[ScheduledRequest, int]], candidates: list[ScheduledRequest]
                        ) -> list[ScheduledRequest] | None:
        """The shortest prefix of `candidates` whose retraction lets the rest of the step's plan
        grow (asked of the allocator, nothing changed); None when no prefix does."""

    def admit_victims(self, running: list[ScheduledRequest], req: ScheduledRequest, candidates: list[ScheduledRequest],
                      token_limit: int) -> list[ScheduledRequest] | None:
        """The shortest prefix of `candidates` after whose preemption admission would take `req`;
        None when no prefix does."""

    def relieve(self) -> bool:
        """Give up holds that only waiting work has on memory; True when one was given up."""

    def stats(self) -> PoolStats: ...

    def check_idle(self) -> None: ...
