"""`StorageOps`: what the storage facade needs of the chain, over names and ids.

`KVStorage` reaches no band, id map, ledger, epoch, copier, device or forward step: every call it
makes into the pool is one of these operations, over sub-pool names, owner virtual ids and state
slot ids. Each is built on the chain's own take (`_plan_and_take`), free (`free_virtual`), host-tier
load (`take_for_load`) and state copy (`copy_state`), which `ChainAllocator` defines."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import faults
from ..device.base import Device, Event
from ..errors import CapacityError, InputError, InvariantError
from ..plan import KVStoragePlan, PoolKind
from .band import Band
from .forward_steps import ForwardSteps, LaunchRecord
from .id_space import UNBOUND, IdStack
from .invariants import check_windows_released
from .page_usage import Hazard, PageUse
from .signals import HostTransfer, NetworkTransfer
from .stage_capacity import StageCapacity

#: an empty, read-only id array: what a take of no pages returns
NO_PAGES = np.empty(0, dtype=np.int64)
NO_PAGES.flags.writeable = False


class StorageOps:
    """The chain's operations as `KVStorage` calls them (the state `ChainAllocator` sets up)."""

    plan: KVStoragePlan
    bands: list[Band]
    owner: Band
    token_bands: list[Band]
    window_bands: list[Band]
    state_band: Band | None
    virtual_free: IdStack
    slot_free: IdStack
    device: Device
    forward_steps: ForwardSteps
    _stages: StageCapacity | None

    def _band_named(self, sub_pool: str) -> Band:
        return self.bands[self.plan.by_name(sub_pool).index]

    def _bands_named(self, pages: dict[str, np.ndarray]) -> list[tuple[Band, np.ndarray]]:
        """(band, page ids) per sub-pool name, every name resolved before anything changes."""
        return [(self._band_named(name), np.asarray(ids, dtype=np.int64)) for name, ids in pages.items()]

    def take_virtual(self, n_pages: int, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
        """One chain take: `n_pages` pages in every token band bound to as many fresh owner virtual
        pages, and `n_slots` state pages bound to fresh slot ids. Returns (virtual pages, slot ids).
        Raises CapacityError, with nothing changed, when ids or bytes run short."""
        if self._stages is not None:
            short = self._stages.ids_fit(n_pages, n_slots)
            if short is not None:
                raise CapacityError(short)
        if n_pages > len(self.virtual_free):
            raise CapacityError(f"owner has {len(self.virtual_free)} free virtual pages, {n_pages} needed")
        if n_slots > len(self.slot_free):
            raise CapacityError(f"state sub-pool has {len(self.slot_free)} free slot ids, {n_slots} needed")
        if n_pages < 0 or n_slots < 0:
            raise InputError(f"a take of {n_pages} pages and {n_slots} slots")
        state = self.state_band
        demand = [int(n_pages)] * len(self.bands)
        if state is not None:
            demand[state.index] = int(n_slots)
        physical = self._plan_and_take(tuple(demand))  # a demand built here needs no `_check_demand`
        vpages = slots = NO_PAGES
        if n_pages:
            vpages = self.virtual_free.pop(n_pages)
            for band in self.token_bands:
                band.bind(vpages, physical[band.index])
        if n_slots:
            slots = self.slot_free.pop(n_slots)
            state.bind(slots, physical[state.index])
        return vpages, slots

    def free_virtual_pages(self, vpages: np.ndarray) -> None:
        """Each window frees the rows it still binds of `vpages`, then the owner frees them all and
        the ids return to the free stack (CHK-8 between the two)."""
        if not len(vpages):
            return
        for band in self.window_bands:
            bound = vpages[band.ids.v2p[vpages] != UNBOUND]
            self.free_virtual(band, bound)
        check_windows_released(self, vpages)
        self.free_virtual(self.owner, vpages)
        self.virtual_free.push(vpages)

    def free_window_rows(self, sub_pool: str, vpages: np.ndarray) -> None:
        """One window frees its rows of `vpages`; every other band keeps them bound."""
        self.free_virtual(self._band_named(sub_pool), vpages)

    def free_state_slots(self, slots: np.ndarray) -> None:
        """The state band frees the pages behind `slots`; the slot ids return to the free stack."""
        if not len(slots):
            return
        self.free_virtual(self.state_band, slots)
        self.slot_free.push(slots)

    def rehome_window(self, sub_pool: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Rebind one window's pages from virtual pages `src` to unbound virtual pages `dst`; nothing
        is taken, freed or copied (WIN-7)."""
        band = self._band_named(sub_pool)
        physical = band.ids.v2p[src]
        if (physical < 0).any() or (band.ids.v2p[dst] >= 0).any():
            raise InvariantError("chain.window_segment_bound", f"{sub_pool}: rehome needs bound sources and free targets")
        band.ids.unbind_physical(physical)
        band.ids.bind(dst, physical)

    def bind_window(self, sub_pool: str, vpages: np.ndarray, physical: np.ndarray) -> None:
        """Bind live pages of one window to owner virtual pages (WIN-7): pages a load reservation
        fixes and nothing binds yet, to ids the window does not bind. Raises InputError, changing
        nothing, for any other page or id (a bound or free page would be counted twice or leak)."""
        band = self._band_named(sub_pool)
        loose = (band.ids.p2v[physical] != UNBOUND) | ~band.fixed_mask[physical]
        if loose.any():
            raise InputError(f"{sub_pool}: pages {physical[loose][:8].tolist()} are not a load's reserved, "
                             "unbound pages")
        taken = band.ids.v2p[vpages] != UNBOUND
        if taken.any():
            raise InputError(f"{sub_pool}: owner pages {vpages[taken][:8].tolist()} already bind a row there")
        band.bind(vpages, physical)

    def end_load_reservation(self, sub_pool: str, reservation: PageUse) -> None:
        """The reservation's pages may move again (HIC-6). Raises InputError, changing nothing, for
        a reservation this sub-pool does not hold (another's, or one ended already)."""
        band = self._band_named(sub_pool)
        if not any(use is reservation for use in band.usage.uses):
            raise InputError(f"{sub_pool} holds no such load reservation (another sub-pool's, or ended already)")
        band.unfix(reservation)

    def assert_between_steps(self, what: str) -> None:
        """A row's length changes only outside a launch and the recording of its event (LIFE-31),
        whether or not the call takes or frees a page."""
        self.forward_steps.assert_closed(what)

    def copy_state_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Copy state slots on the schedule stream after every unfinished writer of the sources,
        clearing the ledger on the destinations first (LEDG-14..17)."""
        v2p = self.state_band.ids.v2p
        src = v2p[src_slots]
        dst = v2p[dst_slots]
        if (src < 0).any() or (dst < 0).any():
            raise InvariantError("band.free_of_bound_page", "state copy names an unbound slot")
        self.copy_state(src, dst)

    def physical_pages(self, sub_pool: str, virtual: np.ndarray) -> np.ndarray:
        """Physical ids behind bound virtual ids of one sub-pool (slot ids for state); raises
        InvariantError naming the sub-pool when one is unbound."""
        physical = self._band_named(sub_pool).ids.v2p[virtual]
        if (physical < 0).any():
            raise InvariantError("band.free_of_bound_page", f"{sub_pool}: translation of unbound ids")
        return physical

    def alloc_load(self, sub_pool: str, n: int) -> tuple[np.ndarray, PageUse]:
        """`n` pages of one sub-pool fixed under a load reservation (HIC-4/5)."""
        return self.take_for_load(self._band_named(sub_pool), n)

    def bind_loaded(self, sub_pool: str, physical: np.ndarray) -> np.ndarray:
        """Fresh owner virtual ids (or, for the state band, slot ids) bound to a host-tier load's
        pages: ones a load reservation fixes and nothing binds yet."""
        band = self._band_named(sub_pool)
        loose = (band.ids.p2v[physical] != UNBOUND) | ~band.fixed_mask[physical]
        if loose.any():
            raise InputError(f"{sub_pool}: pages {physical[loose][:8].tolist()} are not a load's reserved, "
                             "unbound pages")
        free = self.slot_free if band is self.state_band else self.virtual_free
        if len(physical) > len(free):
            raise CapacityError(f"{sub_pool}: {len(free)} free ids, {len(physical)} needed for a load")
        ids = free.pop(len(physical))
        band.bind(ids, physical)
        return ids

    def record_host_transfer(self, transfer: HostTransfer, pages: dict[str, np.ndarray]) -> None:
        """One COPY_WRITE (a load) or COPY_READ (a backup) use per sub-pool named in `pages`."""
        hazard = Hazard.COPY_WRITE if transfer.writes else Hazard.COPY_READ
        for band, ids in self._bands_named(pages):
            band.usage.record(PageUse(hazard, ids, transfer.writes, event=transfer.done, transfer=transfer,
                                      label=f"{hazard.value} {transfer.name}"))

    def record_network_transfer(self, transfer: NetworkTransfer, pages: dict[str, np.ndarray]) -> None:
        """One NETWORK use per sub-pool named in `pages` (a receive writes them); each band's capacity
        epoch moves, since network-held rows price differently (PD-1)."""
        for band, ids in self._bands_named(pages):
            band.usage.record(PageUse(Hazard.NETWORK, ids, writes=not transfer.sends, event=transfer.done,
                                      transfer=transfer, label=repr(transfer)))
            band.epoch.bump()

    def hold_rows(self, pages: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
        """Hold physical pages per sub-pool in place (no compaction moves them) until `release_rows`;
        returns the held pages per band index, the argument `release_rows` takes (PD-8)."""
        named = self._bands_named(pages)
        for band, ids in named:  # every page before anything changes: a receive writes bound pages
            unbound = band.ids.p2v[ids] == UNBOUND
            if unbound.any():
                raise InputError(f"{band.name}: pages {ids[unbound][:8].tolist()} are not bound (a receive "
                                 "writes the pages a row took)")
        held = {}
        for band, ids in named:
            band.held[ids] += 1
            band.n_held += len(ids)
            held[band.index] = ids
        return held

    def release_rows(self, held: dict[int, np.ndarray]) -> None:
        """End a `hold_rows`: the pages may move again."""
        for index, ids in held.items():
            band = self.bands[index]
            band.held[ids] -= 1
            band.n_held -= len(ids)

    def forward_launched(self, has_forward: bool = True) -> LaunchRecord:
        """A step launched (LIFE-21); see `ForwardSteps.forward_launched`."""
        return self.forward_steps.forward_launched(has_forward)

    def record_forward(self, record: LaunchRecord, done: Event, written: Sequence[np.ndarray | None] | None,
                       shared_read_done: Event | None = None) -> None:
        """The launched forward's `done` event and, per band in chain order, the pages it writes
        (None for a band it leaves alone); `written=None` when unknown, every band then counts it
        as writing everywhere (LIFE-22, LIFE-36)."""
        self.forward_steps.forward_recorded(record, done, writes_known=written is not None)
        record.shared_read_done = shared_read_done
        for band in self.bands:
            if written is None:
                band.set_inflight_forward(record.step, done, None)
            elif written[band.index] is not None:
                band.set_inflight_forward(record.step, done, written[band.index])

    def order_forward_after_schedule(self) -> None:
        """The forward stream waits everything queued on the schedule stream so far."""
        device = self.device
        device.stream_wait(device.forward_stream, device.record(device.schedule_stream, "schedule"))

    def apply_war_barrier(self) -> None:
        """The schedule stream waits the running forward's shared-read end, or the whole forward
        stream when it declared none (LIFE-4/5/6)."""
        if faults.ACTIVE and faults.active(faults.SKIP_WAR_BARRIER):
            return
        device = self.device
        running = self.forward_steps.newest_unprocessed()
        event = getattr(running, "shared_read_done", None) if running is not None else None
        if event is None:
            event = device.record(device.forward_stream, "war barrier")
        device.stream_wait(device.schedule_stream, event)

    def band_counts(self) -> dict[str, dict[str, int]]:
        """Per band name: its `live`, `holes`, `pending` and `span` pages, its `page_bytes` and the
        pages it has `moves`d. Reads counters only."""
        return {b.name: {"live": b.n_live, "holes": b.n_holes, "pending": b.n_pending, "span": b.span,
                         "page_bytes": b.page_bytes, "moves": b.stats["moves"]} for b in self.bands}

    def pages_accounted_for(self, vpages: np.ndarray, n_slots: int) -> dict[str, int]:
        """Live pages per band that owner virtual pages `vpages` and `n_slots` state slots account for:
        the owner one per virtual page, a window the rows it still binds, the state band the slots."""
        out = {}
        for band in self.bands:
            if band.pool.kind is PoolKind.STATE:
                out[band.name] = n_slots
            elif band is self.owner:
                out[band.name] = len(vpages)
            else:
                out[band.name] = int(np.count_nonzero(band.ids.v2p[vpages] != UNBOUND))
        return out
