"""Named faults the stress harness must catch, each aimed at one check of `checks.py`.

Each mutant switches on one fault point of the pool (`kvchain.faults`), which the library checks
at the exact place the fault breaks it; nothing is patched. A mutant that a sweep of seeds does
not catch means the check it aims at is blind to the fault:
`tests/unit/testing/test_stress_mutants.py` holds every one to being caught within a few seeds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from .. import faults
from ..errors import InputError
from . import checks


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str
    description: str
    fault: str  # the fault point it switches on
    #: the check that must catch it on a real device (threads, cuda), where only the payload,
    #: divergence and ledger checks apply (HARN-14); None: a real device cannot show its hazard
    real_target: str | None = None
    real_reason: str = ""  # why a real device cannot show it (real_target None)


#: one row per mutant: the fault point it switches on, the check that must catch it, and what goes
#: wrong. A mutant is named after its fault point, but for the names in `_NAMED`.
_TABLE: tuple[tuple[str, str, str], ...] = (
    (faults.SKIP_WAR_BARRIER, checks.UNORDERED_OVERLAP,
     "the schedule stream never waits the running forward's shared reads (LIFE-4)"),
    (faults.FREE_TO_HOLES, checks.LOST_WRITE,
     "a page freed under a running forward becomes a hole at once, not pending (LIFE-24)"),
    (faults.SKIP_SETTLE_WAIT, checks.UNORDERED_OVERLAP,
     "settling a pending batch does not make the schedule stream wait its forward (LIFE-29)"),
    (faults.SKIP_ZEROING, checks.CROSS_DTYPE_BYTES,
     "attention pages are not zeroed on hand-out (ALLOC-20)"),
    (faults.UNZEROED_GROWTH, checks.CROSS_DTYPE_BYTES,
     "a state page's bytes reach an attention page: pages a band grows over are not zeroed, only reused "
     "holes (ALLOC-20)"),
    (faults.REUSE_VACATED, checks.LOST_WRITE,
     "a move's source is reused at once, though a running forward may still read it (COMP-18)"),
    (faults.SKIP_WRITER_WAITS, checks.LOST_WRITE,
     "a move copies its sources without waiting their unfinished writers (COMP-17)"),
    (faults.SKIP_FENCE_WAITS, checks.UNORDERED_OVERLAP,
     "writes over fenced bytes and relocations over pages a forward reads do not wait (COMP-20)"),
    (faults.SKIP_COPY_CLEARANCE, checks.UNORDERED_OVERLAP,
     "the next writer of a page a host copy still uses does not wait the copy (LEDG-15, LEDG-19)"),
    (faults.READ_AFTER_SETTLE, checks.HOST_READ_AFTER_WAIT,
     "urgent recovery settles (stream waits) before its host read-ahead (LIFE-41)"),
    (faults.FREE_ON_FIRED_EVENT, checks.RANK_DIVERGENCE,
     "a free decides on whether the running forward's event fired (device.query): fired, the page becomes "
     "a hole at once (LIFE-39)"),
    (faults.HOLES_BY_FIRED_EVENT, checks.RANK_DIVERGENCE,
     "a take prefers holes whose uses' events already fired (device.query), not by retirement (LEDG-31, "
     "LIFE-39)"),
    (faults.NEVER_END_USES, checks.LEDGER_LEAK,
     "a host copy's or network transfer's ledger uses never end (LEDG-3/4)"),
    (faults.KEEP_FENCES, checks.LEDGER_LEAK,
     "fences left by a forward outlive its retirement (LEDG-5)"),
    (faults.RELEASE_NETWORK_EARLY, checks.UNORDERED_OVERLAP,
     "a host wait for network transfers releases them without waiting, so their pages are reused while the"
     " transfer engine still reads or writes them (PD-2, LEDG-4)"),
    (faults.LOSE_MOVE_COPY, checks.LOST_WRITE,
     "a move rebinds its pages to their destinations but its copy never lands (COMP-16)"),
)
_NAMED = {faults.SKIP_WRITER_WAITS: "move_without_writer_wait"}

#: what a real device sees instead of the modeled device's checks: an access the vector clocks call
#: unordered corrupts bytes a forward, a backup or a send then reads (`lost_write`); a page handed
#: out unzeroed shows in the tail of the last page, which every forward checks reads zero (ALLOC-20)
_REAL = {checks.UNORDERED_OVERLAP: checks.LOST_WRITE, checks.CROSS_DTYPE_BYTES: checks.LOST_WRITE}
#: mutants whose hazard a real device cannot show, and why
_NOT_REAL = {
    faults.READ_AFTER_SETTLE: "the recovery read-ahead reads host-side lists only; on a real device a host read "
                              "after a queued stream wait stalls the host until the waited work ends, it corrupts "
                              "no bytes, so only the modeled device's happens-before clocks (HARN-9) see it",
}

MUTANTS: dict[str, Mutant] = {
    m.name: m for m in (
        Mutant(_NAMED.get(fault, fault), target, description, fault,
               None if fault in _NOT_REAL else _REAL.get(target, target), _NOT_REAL.get(fault, ""))
        for fault, target, description in _TABLE)
}


def get(name: str) -> Mutant:
    try:
        return MUTANTS[name]
    except KeyError:
        raise InputError(f"unknown mutant {name!r}; `kvchain stress --list-mutants` lists them") from None


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[Mutant | None]:
    """Run the body with mutant `name`'s fault point switched on (None: none), off again on exit."""
    if name is None:
        yield None
        return
    m = get(name)
    with faults.injected(m.fault):
        yield m
