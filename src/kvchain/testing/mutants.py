"""Named faults the stress harness must catch, each injected by monkeypatching the pool from the
outside (in the process that runs the harness), each aimed at one check of `checks.py`.

A mutant that a sweep of seeds does not catch means the check it aims at is blind to the fault:
`tests/unit/testing/test_stress_mutants.py` holds every one to being caught within a few seeds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..alloc import band as band_module
from ..alloc.band import Band
from ..alloc.chain import ChainAllocator
from ..alloc.page_usage import Hazard, PageUsage
from ..alloc.signals import NetworkTransferWaiter
from ..device.base import PageAccess
from ..errors import InputError
from ..memory.copy import PageCopier
from ..storage import KVStorage
from . import checks

_MISSING = object()


class Patcher:
    """Set attributes and undo them in reverse order (like pytest's monkeypatch, without pytest)."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object]] = []

    def setattr(self, owner: object, name: str, value: object) -> None:
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        self._undo.append((owner, name, old))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str
    description: str
    apply: Callable[[Patcher], None]


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, target: str, description: str):
    def register(apply: Callable[[Patcher], None]) -> Callable[[Patcher], None]:
        MUTANTS[name] = Mutant(name, target, description, apply)
        return apply
    return register


def _skip_stream_waits(p: Patcher, prefixes: tuple[str, ...]) -> None:
    original = Band._stream_wait

    def _stream_wait(self, event, why):
        if why.startswith(prefixes):
            return None
        return original(self, event, why)

    p.setattr(Band, "_stream_wait", _stream_wait)


@mutant("skip_war_barrier", checks.UNORDERED_OVERLAP,
        "the schedule stream never waits the running forward's shared reads (LIFE-4)")
def _skip_war_barrier(p: Patcher) -> None:
    p.setattr(KVStorage, "apply_war_barrier", lambda self: None)


@mutant("free_to_holes", checks.LOST_WRITE,
        "a page freed under a running forward becomes a hole at once, not pending (LIFE-24)")
def _free_to_holes(p: Patcher) -> None:
    original = Band.free

    def free(self, ids):
        steps = self.chain.forward_steps
        steps.newest_unprocessed = lambda: None
        try:
            return original(self, ids)
        finally:
            del steps.newest_unprocessed

    p.setattr(Band, "free", free)


@mutant("skip_settle_wait", checks.UNORDERED_OVERLAP,
        "settling a pending batch does not make the schedule stream wait its forward (LIFE-29)")
def _skip_settle_wait(p: Patcher) -> None:
    _skip_stream_waits(p, ("settle",))


@mutant("skip_zeroing", checks.CROSS_DTYPE_BYTES, "attention pages are not zeroed on hand-out (ALLOC-20)")
def _skip_zeroing(p: Patcher) -> None:
    p.setattr(Band, "_maybe_zero_pages", lambda self, ids: None)


@mutant("unzeroed_growth", checks.CROSS_DTYPE_BYTES,
        "a state page's bytes reach an attention page: pages a band grows over are not zeroed, only "
        "reused holes (ALLOC-20)")
def _unzeroed_growth(p: Patcher) -> None:
    grow, zero = Band._grow_to, Band._maybe_zero_pages

    def _grow_to(self, after):
        ids = grow(self, after)
        self._mutant_grown = ids
        return ids

    def _maybe_zero_pages(self, ids):
        grown = getattr(self, "_mutant_grown", None)
        self._mutant_grown = None
        if grown is not None and len(grown):
            ids = ids[~np.isin(ids, grown)]
        return zero(self, ids)

    p.setattr(Band, "_grow_to", _grow_to)
    p.setattr(Band, "_maybe_zero_pages", _maybe_zero_pages)


@mutant("reuse_vacated", checks.LOST_WRITE,
        "a move's source is reused at once, though a running forward may still read it (COMP-18)")
def _reuse_vacated(p: Patcher) -> None:
    def _vacate_sources(self, src):
        self.state[src] = band_module.HOLE
        self.holes.push(src)

    p.setattr(Band, "_vacate_sources", _vacate_sources)


@mutant("move_without_writer_wait", checks.LOST_WRITE,
        "a move copies its sources without waiting their unfinished writers (COMP-17)")
def _move_without_writer_wait(p: Patcher) -> None:
    p.setattr(Band, "_wait_writers", lambda self, src: None)


@mutant("skip_fence_waits", checks.UNORDERED_OVERLAP,
        "writes over fenced bytes and relocations over pages a forward reads do not wait (COMP-20)")
def _skip_fence_waits(p: Patcher) -> None:
    _skip_stream_waits(p, ("relocation", "fence"))


@mutant("skip_copy_clearance", checks.UNORDERED_OVERLAP,
        "the next writer of a page a host copy still uses does not wait the copy (LEDG-15, LEDG-19)")
def _skip_copy_clearance(p: Patcher) -> None:
    original = PageUsage.clearance

    def clearance(self, consumer, pages):
        return [w for w in original(self, consumer, pages)
                if w.use.hazard not in (Hazard.COPY_READ, Hazard.COPY_WRITE)]

    p.setattr(PageUsage, "clearance", clearance)


@mutant("read_after_settle", checks.HOST_READ_AFTER_WAIT,
        "urgent recovery settles (stream waits) before its host read-ahead (LIFE-41)")
def _read_after_settle(p: Patcher) -> None:
    from ..alloc.band import FloatBand

    def _urgent_recovery(self):
        for band in self.bands:
            band.settle_pending_for_recovery()
        for band in self.bands:
            band.read_ahead_for_recovery()
        for band in self.bands:
            if isinstance(band, FloatBand) and not band.parked and band.n_live + band.n_fixed + band.n_vacated == 0:
                band.park()

    p.setattr(ChainAllocator, "_urgent_recovery", _urgent_recovery)


@mutant("free_on_fired_event", checks.RANK_DIVERGENCE,
        "a free decides on whether the running forward's event fired (device.query): fired, the page "
        "becomes a hole at once (LIFE-39)")
def _free_on_fired_event(p: Patcher) -> None:
    original = Band.free

    def free(self, ids):
        steps = self.chain.forward_steps
        key = steps.newest_unprocessed()
        if key is None or not self.chain.device.query(key.event):
            return original(self, ids)
        steps.newest_unprocessed = lambda: None
        try:
            return original(self, ids)
        finally:
            del steps.newest_unprocessed

    p.setattr(Band, "free", free)


@mutant("holes_by_fired_event", checks.RANK_DIVERGENCE,
        "a take prefers holes whose uses' events already fired (device.query), not by retirement "
        "(LEDG-31, LIFE-39)")
def _holes_by_fired_event(p: Patcher) -> None:
    original = PageUsage.busy

    def _take_holes(self, k):
        device = self.chain.device
        cleared = np.zeros(self.grid.n_grid, dtype=bool)
        for use in self.usage.uses:
            if use.event is not None and device.query(use.event):
                cleared[use.pages] = True

        def busy(pages):
            return original(self.usage, pages) & ~cleared[pages]

        self.usage.busy = busy
        try:
            return take_holes(self, k)
        finally:
            del self.usage.busy

    take_holes = Band._take_holes
    p.setattr(Band, "_take_holes", _take_holes)


@mutant("never_end_uses", checks.LEDGER_LEAK, "a host copy's or network transfer's ledger uses never end (LEDG-3/4)")
def _never_end_uses(p: Patcher) -> None:
    p.setattr(PageUsage, "end_transfer", lambda self, transfer: [])


@mutant("keep_fences", checks.LEDGER_LEAK, "fences left by a forward outlive its retirement (LEDG-5)")
def _keep_fences(p: Patcher) -> None:
    original = ChainAllocator.on_forward_retired

    def on_forward_retired(self, step):
        fences = [f for f in self.fences if f.use.step is not None]
        original(self, step)
        self.fences = self.fences + [f for f in fences if f not in self.fences]

    p.setattr(ChainAllocator, "on_forward_retired", on_forward_retired)


@mutant("release_network_early", checks.UNORDERED_OVERLAP,
        "a host wait for network transfers releases them without waiting, so their pages are reused while "
        "the transfer engine still reads or writes them (PD-2, LEDG-4)")
def _release_network_early(p: Patcher) -> None:
    def wait(self, transfers, timeout=None):
        for t in transfers:
            t.released = True

    p.setattr(NetworkTransferWaiter, "wait", wait)


@mutant("lose_move_copy", checks.LOST_WRITE,
        "a move rebinds its pages to their destinations but its copy never lands (COMP-16)")
def _lose_move_copy(p: Patcher) -> None:
    original = PageCopier.move_pages

    def move_pages(self, band, src, dst, label="move"):
        if label != "move":
            return original(self, band, src, dst, label)
        self.device.launch(self.device.schedule_stream, None, reads=(PageAccess(band.index, src.copy()),),
                           writes=(PageAccess(band.index, dst.copy()),), label=label)

    p.setattr(PageCopier, "move_pages", move_pages)


def get(name: str) -> Mutant:
    try:
        return MUTANTS[name]
    except KeyError:
        raise InputError(f"unknown mutant {name!r}; `kvchain stress --list-mutants` lists them") from None


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[Mutant | None]:
    """Run the body with mutant `name` injected (None: none), undone on exit."""
    if name is None:
        yield None
        return
    m = get(name)
    patcher = Patcher()
    try:
        m.apply(patcher)
        yield m
    finally:
        patcher.undo()

