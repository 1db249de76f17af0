"""Named fault points: places in the pool where a known fault can be switched on.

The stress harness proves each of its checks sees the fault it is for by switching one on
(`kvchain.testing.mutants`). Library code asks `active(NAME)` at the exact place the fault breaks
the pool; with nothing switched on that is one lookup in an empty set, so the hot path pays
nothing measurable. Faults are process-wide, like the invariant level, and only tests and
`kvchain stress --mutant` switch them on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .errors import InputError

#: the schedule stream does not wait the running forward's shared reads (LIFE-4)
SKIP_WAR_BARRIER = "skip_war_barrier"
#: a page freed under a running forward becomes a hole at once (LIFE-24)
FREE_TO_HOLES = "free_to_holes"
#: settling a pending batch queues no stream wait (LIFE-29)
SKIP_SETTLE_WAIT = "skip_settle_wait"
#: attention pages are not zeroed on hand-out (ALLOC-20)
SKIP_ZEROING = "skip_zeroing"
#: pages a band grows over are not zeroed, only reused holes (ALLOC-20)
UNZEROED_GROWTH = "unzeroed_growth"
#: a move's sources become holes at once, with no forward hazard and no vacating (COMP-18)
REUSE_VACATED = "reuse_vacated"
#: a copy does not wait the unfinished writers of its sources (COMP-17)
SKIP_WRITER_WAITS = "skip_writer_waits"
#: fence waits and a relocation's wait on the forward that reads its pages are skipped (COMP-20)
SKIP_FENCE_WAITS = "skip_fence_waits"
#: the ledger's clearance of a chosen page omits host-copy uses (LEDG-15, LEDG-19)
SKIP_COPY_CLEARANCE = "skip_copy_clearance"
#: relief's recovery settles (stream waits) before its host read-ahead (LIFE-41)
READ_AFTER_SETTLE = "read_after_settle"
#: a free decides on whether the running forward's event fired (LIFE-39)
FREE_ON_FIRED_EVENT = "free_on_fired_event"
#: a take prefers holes whose uses' events fired, not by retirement (LEDG-31, LIFE-39)
HOLES_BY_FIRED_EVENT = "holes_by_fired_event"
#: a transfer's ledger uses never end (LEDG-3, LEDG-4)
NEVER_END_USES = "never_end_uses"
#: fences left by a forward outlive its retirement (LEDG-5)
KEEP_FENCES = "keep_fences"
#: the network transfer waiter releases transfers without waiting them (PD-2)
RELEASE_NETWORK_EARLY = "release_network_early"
#: a move's copy is declared but never lands (COMP-16)
LOSE_MOVE_COPY = "lose_move_copy"

POINTS: frozenset[str] = frozenset({
    SKIP_WAR_BARRIER, FREE_TO_HOLES, SKIP_SETTLE_WAIT, SKIP_ZEROING, UNZEROED_GROWTH, REUSE_VACATED,
    SKIP_WRITER_WAITS, SKIP_FENCE_WAITS, SKIP_COPY_CLEARANCE, READ_AFTER_SETTLE, FREE_ON_FIRED_EVENT,
    HOLES_BY_FIRED_EVENT, NEVER_END_USES, KEEP_FENCES, RELEASE_NETWORK_EARLY, LOSE_MOVE_COPY,
})

#: the faults switched on now; empty in every real run
ACTIVE: set[str] = set()


def active(point: str) -> bool:
    """Whether fault `point` is switched on."""
    return point in ACTIVE


@contextlib.contextmanager
def injected(*points: str) -> Iterator[None]:
    """Switch faults on for the body, and back off on exit."""
    unknown = [p for p in points if p not in POINTS]
    if unknown:
        raise InputError(f"unknown fault points {unknown}; known: {sorted(POINTS)}")
    added = [p for p in points if p not in ACTIVE]
    ACTIVE.update(added)
    try:
        yield
    finally:
        ACTIVE.difference_update(added)
