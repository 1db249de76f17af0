"""CLEARANCE held by behaviour, one test per cell (LEDG-10..29): each builds its hazard on the pages
a consumer is about to write, runs that consumer through its real entry point, and checks on the
modeled device that the wait the cell requires happened, and only that one.

The checks read the device, not the allocator's bookkeeping: a stream wait shows as the hazard's
event in the vector clock of the consumer's own work (its zeroing, its state copy, the forward
that writes the pages); a host wait as the transfer's event in the host's clock; "none" as that
event absent from both; "excluded" and "after retire" as a refusal before the consumer writes.

The consumers: `FORWARD` is the next forward, writing pages it took (`alloc_extend`) and launched
through the step sequence; `SCHEDULE_COPY` a state copy into a live slot; `ZERO` a take's
hand-out zeroing; `HOST_LOAD` a host-tier load's take (`alloc_load`); `NETWORK_RECEIVE` a take
for a PD receive (`take_from(..., consumer=NETWORK_RECEIVE)`). For the take consumers the hazard
lies on the band's holes: pages a freed row left while a backup still read them or a load still
wrote them, a network transfer recorded on them, a fixing use, or a speculative forward in flight
(whose unknown writes cover every page)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from kvchain.alloc.page_usage import CLEARANCE, Clear, Consumer, Hazard
from kvchain.alloc.signals import NetworkTransfer
from kvchain.device.modeled import clock_leq
from kvchain.errors import InvariantError
from support.modeled import launch_forward, modeled_storage, process, request

C, H = Consumer, Hazard

#: the rule id of each cell (COPY_READ and COPY_WRITE share one)
RULE = {
    (C.FORWARD, H.FORWARD): "LEDG-10", (C.FORWARD, H.COPY_READ): "LEDG-11", (C.FORWARD, H.COPY_WRITE): "LEDG-11",
    (C.FORWARD, H.NETWORK): "LEDG-12", (C.FORWARD, H.FIXED): "LEDG-13",
    (C.SCHEDULE_COPY, H.FORWARD): "LEDG-14", (C.SCHEDULE_COPY, H.COPY_READ): "LEDG-15",
    (C.SCHEDULE_COPY, H.COPY_WRITE): "LEDG-15", (C.SCHEDULE_COPY, H.NETWORK): "LEDG-16",
    (C.SCHEDULE_COPY, H.FIXED): "LEDG-17",
    (C.ZERO, H.FORWARD): "LEDG-18", (C.ZERO, H.COPY_READ): "LEDG-19", (C.ZERO, H.COPY_WRITE): "LEDG-19",
    (C.ZERO, H.NETWORK): "LEDG-20", (C.ZERO, H.FIXED): "LEDG-21",
    (C.HOST_LOAD, H.FORWARD): "LEDG-22", (C.HOST_LOAD, H.COPY_READ): "LEDG-23",
    (C.HOST_LOAD, H.COPY_WRITE): "LEDG-23", (C.HOST_LOAD, H.NETWORK): "LEDG-24", (C.HOST_LOAD, H.FIXED): "LEDG-25",
    (C.NETWORK_RECEIVE, H.FORWARD): "LEDG-26", (C.NETWORK_RECEIVE, H.COPY_READ): "LEDG-27",
    (C.NETWORK_RECEIVE, H.COPY_WRITE): "LEDG-27", (C.NETWORK_RECEIVE, H.NETWORK): "LEDG-28",
    (C.NETWORK_RECEIVE, H.FIXED): "LEDG-29",
}

#: what the design's table says, cell by cell: the test expects this, not what CLEARANCE holds
SPEC = {
    C.FORWARD: (Clear.NONE, Clear.STREAM_WAIT, Clear.HOST_WAIT, Clear.EXCLUDED),
    C.SCHEDULE_COPY: (Clear.STREAM_WAIT, Clear.STREAM_WAIT, Clear.HOST_WAIT, Clear.EXCLUDED),
    C.ZERO: (Clear.STREAM_WAIT, Clear.STREAM_WAIT, Clear.HOST_WAIT, Clear.EXCLUDED),
    C.HOST_LOAD: (Clear.NONE, Clear.STREAM_WAIT, Clear.HOST_WAIT, Clear.EXCLUDED),
    C.NETWORK_RECEIVE: (Clear.AFTER_RETIRE, Clear.STREAM_WAIT, Clear.HOST_WAIT, Clear.EXCLUDED),
}
_COLUMN = {H.FORWARD: 0, H.COPY_READ: 1, H.COPY_WRITE: 1, H.NETWORK: 2, H.FIXED: 3}


def _expected(consumer: Consumer, hazard: Hazard) -> Clear:
    return SPEC[consumer][_COLUMN[hazard]]


@dataclass
class Built:
    """A hazard on the pages the consumer will write: the event a wait must cover (a forward's or
    a copy's end), or the network transfer a host wait must cover, and how to end it afterwards."""

    event: object | None = None
    transfer: NetworkTransfer | None = None
    finish: Callable[[], None] = lambda: None


def _copy_event(dev, name):
    """A host-tier copy still running on the copy stream: its finish event."""
    dev.launch(dev.stream("copy"), None, label=name)
    return dev.record(dev.stream("copy"), f"{name} done")


def _transfer(dev, name, sends):
    """A network transfer still running: a host wait for it advances the host past its event."""
    dev.launch(dev.stream("network"), None, label=name)
    return NetworkTransfer(name, sends=sends, done=dev.record(dev.stream("network"), f"{name} done"))


def _on_holes(storage, dev, hazard) -> tuple[Built, np.ndarray]:
    """The owner band's only holes, left by a freed row, carrying `hazard`. Returns the hazard and
    the holes (physical ids)."""
    chain = storage.allocator
    owner = chain.owner
    row, _ = request(storage, 8)
    pages = storage.physical_pages(owner.name, storage.table.pages_of(row))
    built = Built()
    if hazard in (H.COPY_READ, H.COPY_WRITE):
        writes = hazard is H.COPY_WRITE
        built.event = _copy_event(dev, "load" if writes else "backup")
        transfer = storage.record_host_transfer("load" if writes else "backup", writes, {owner.name: pages},
                                                built.event)
        built.finish = lambda: storage.end_host_transfer(transfer)
    storage.free_rows(np.array([row]))
    if hazard is H.NETWORK:
        # a receive into these pages is still in flight (keyed by physical ids, as at submission)
        built.transfer = _transfer(dev, "receive", sends=False)
        chain.record_network_transfer(built.transfer, {owner.name: pages})
    elif hazard is H.FIXED:
        use = owner.fix(pages, "load reservation")
        built.finish = lambda: owner.unfix(use)
    elif hazard is H.FORWARD:
        # a speculative forward in flight: its writes are unknown, so they cover every page
        record = launch_forward(storage, writes_known=False)
        built.event = record.event
        built.finish = lambda: process(storage, record)
    assert owner.n_holes == len(pages) and (owner.usage.on(pages) or hazard is H.FORWARD)
    return built, pages


def _on_slot(storage, dev, hazard) -> tuple[Built, int, int]:
    """A live state slot (another request's) carrying `hazard`, and the slot a copy reads from,
    which carries nothing: (hazard, source slot, destination slot)."""
    chain = storage.allocator
    state = chain.state_band
    row, _ = request(storage, 8)
    other, vtok = request(storage, 8)
    src, dst = int(storage.table.state_slot[row]), int(storage.table.state_slot[other])
    phys = state.ids.v2p[np.array([dst])]  # transfers and fixing uses name physical ids
    built = Built()
    if hazard is H.FORWARD:
        record = launch_forward(storage, np.array([other]), vtok[-1:])  # writes the destination's slot
        built.event = record.event
        built.finish = lambda: process(storage, record)
    elif hazard in (H.COPY_READ, H.COPY_WRITE):
        writes = hazard is H.COPY_WRITE
        built.event = _copy_event(dev, "load" if writes else "backup")
        transfer = storage.record_host_transfer("load" if writes else "backup", writes,
                                                {state.name: phys}, built.event)
        built.finish = lambda: storage.end_host_transfer(transfer)
    elif hazard is H.NETWORK:
        built.transfer = _transfer(dev, "receive", sends=False)
        storage.record_network_transfer(built.transfer, {state.name: phys})
    else:
        use = state.fix(phys, "kept in place")
        built.finish = lambda: state.unfix(use)
    assert not state.usage.writers_clearance(state.ids.v2p[np.array([src])]), "the source must carry nothing"
    return built, src, dst


def _writes_to(dev, start, band_index, pages, label):
    """Work items launched since `start` with `label` that write any of `pages` of one band."""
    return [w for w in dev.history[start:] if w.label == label
            and any(a.band == band_index and np.isin(pages, a.ids).any() for a in w.writes)]


def _run(storage, dev, consumer, hazard):
    """Build the hazard, run the consumer, and return (the hazard, the consumer's writing work
    items, or the error that refused it)."""
    chain = storage.allocator
    owner = chain.owner
    if consumer is C.SCHEDULE_COPY:
        built, src, dst = _on_slot(storage, dev, hazard)
        start = len(dev.history)
        try:
            storage.copy_state(np.array([src]), np.array([dst]))
        except InvariantError as e:
            return built, e
        return built, [w for w in dev.history[start:] if w.label == "state_copy"]
    if consumer is C.FORWARD and hazard is H.FORWARD:
        # the forward in flight writes a live page; the next forward writes it too (a decode's
        # next token in the same page): no take, no clearance, the forward stream orders them
        row, vtok = request(storage, 6)
        first = launch_forward(storage, np.array([row]), vtok[-1:], label="forward in flight")
        assert owner.usage.on(storage.physical_pages(owner.name, storage.table.pages_of(row)))
        vtok = storage.alloc_decode(np.array([row]))
        start = len(dev.history)
        launch_forward(storage, np.array([row]), vtok, label="next forward")
        return Built(first.event, finish=lambda: process(storage, first)), \
            [w for w in dev.history[start:] if w.label == "next forward"]
    built, pages = _on_holes(storage, dev, hazard)
    start = len(dev.history)
    try:
        if consumer is C.FORWARD:
            # the next forward: it takes the pages for its tokens, then writes them
            row, vtok = request(storage, 8)
            assert np.isin(pages, storage.physical_pages(owner.name, storage.table.pages_of(row))).all()
            launch_forward(storage, np.array([row]), vtok, label="next forward")
            return built, [w for w in dev.history[start:] if w.label == "next forward"]
        if consumer is C.HOST_LOAD:
            taken, _reservation = storage.alloc_load(owner.name, len(pages))
        else:
            taken = chain.take_from(owner, len(pages), consumer=consumer)
    except InvariantError as e:
        return built, e
    assert np.isin(pages, taken).all(), "the consumer must write the hazard's pages"
    return built, _writes_to(dev, start, owner.index, pages, "zero")


def _schedule_clock(dev):
    return dev.record(dev.schedule_stream, "after the consumer").clock


CELLS = [(c, h) for c in C for h in H]


@pytest.mark.parametrize(("consumer", "hazard"), CELLS,
                         ids=[f"{RULE[c, h]}-{c.value}-{h.value}" for c, h in CELLS])
def test_consumer_clears_hazard_as_its_cell_says(consumer, hazard):
    """LEDG-10..29, one cell each (the id names the cell's rule): the consumer, through its real
    entry point, clears the hazard on the pages it writes exactly as the design's table says."""
    storage, dev = modeled_storage()
    expected = _expected(consumer, hazard)
    assert CLEARANCE[consumer][hazard] is expected  # the table the code reads agrees with the design
    host_waits = dev.counters.host_waits
    built, out = _run(storage, dev, consumer, hazard)
    if expected is Clear.EXCLUDED:
        assert isinstance(out, InvariantError) and out.check == "page_usage.excluded", \
            f"{consumer.value} wrote pages the ledger keeps from it: {out}"
        return
    if expected is Clear.AFTER_RETIRE:
        assert isinstance(out, InvariantError) and out.check == "page_usage.after_retire", \
            f"{consumer.value} took pages an unretired forward uses: {out}"
        built.finish()  # the forward retires: the same take now goes through, with no wait
        taken = storage.allocator.take_from(storage.allocator.owner, 2, consumer=consumer)
        assert len(taken) == 2
        return
    assert not isinstance(out, Exception), out
    assert out, f"{consumer.value} launched no work on the hazard's pages"
    if expected is Clear.STREAM_WAIT:
        assert all(clock_leq(built.event.clock, w.clock) for w in out), \
            f"{consumer.value} writes before {built.event.label} without a stream wait"
        assert clock_leq(built.event.clock, _schedule_clock(dev))
        assert dev.counters.host_waits == host_waits, "a stream wait, not a host wait"
    elif expected is Clear.HOST_WAIT:
        assert built.transfer.released, f"{consumer.value} wrote pages a network transfer still uses"
        assert dev.counters.host_waits > host_waits
        assert clock_leq(built.transfer.done.clock, dev.host_clock), "released without the host waiting it"
        assert all(clock_leq(built.transfer.done.clock, w.clock) for w in out)
        assert not any(u.transfer is built.transfer for b in storage.allocator.bands for u in b.usage.uses)
    else:  # NONE: the consumer is ordered already (the forward stream orders forwards)
        stream = built.event.stream.name
        assert all(w.stream == stream or not clock_leq(built.event.clock, w.clock) for w in out), \
            f"{consumer.value} waited {built.event.label}, which nothing requires"
        assert all(clock_leq(built.event.clock, w.clock) for w in out if w.stream == stream)
        assert not clock_leq(built.event.clock, _schedule_clock(dev))
        assert dev.counters.host_waits == host_waits
    built.finish()


def test_a_real_load_reservation_is_never_handed_out():
    """LEDG-13, LEDG-21, LEDG-25, LEDG-29: pages a host-tier load reserves are fixed live pages: no
    take of any consumer hands them out while the reservation lasts, however much it takes."""
    storage, _dev = modeled_storage()
    chain = storage.allocator
    owner = chain.owner
    reserved, reservation = storage.alloc_load(owner.name, 2)
    for consumer in (C.ZERO, C.HOST_LOAD, C.NETWORK_RECEIVE):
        taken = chain.take_alone(owner, 3, consumer=consumer)
        assert not np.isin(taken, reserved).any(), consumer
        chain.free(owner, taken)
    row, _ = request(storage, 16)  # the next forward's pages
    assert not np.isin(storage.physical_pages(owner.name, storage.table.pages_of(row)), reserved).any()
    storage.end_load_reservations(owner.name, reservation)
