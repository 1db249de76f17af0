"""Deferred publication on a decode node (PD-12, PD-13, PD-17) and received state slots landing on
their consumer's stream (PD-16), on ThreadDevice, whose streams are worker threads: a stream held
busy (a gate the test opens late) shows what publishing, or copying, too early would corrupt. The
peer's write is a host write the moment the ids are published, as a one-sided write lands."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvchain.device import ImmediateDevice, ModeledDevice, ThreadDevice
from kvchain.dist.pd import (
    DecodePreallocQueue,
    DeferredPublishError,
    deferred_publication,
    request_pages,
    segments_of,
    state_on_consumer_stream,
)
from support.chains import small_storage

SWITCH = "KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH"
OPEN_AFTER_S = 0.3


@pytest.fixture
def device():
    d = ThreadDevice()
    yield d
    d.close()


def make_storage(device, chain_kib: int = 24):
    return small_storage(page_size=4, chain_kib=chain_kib, windows=(8,), context=128, rows=8, backend=device)


def band(storage, name: str) -> torch.Tensor:
    return storage.arena.page_bytes_view(storage.plan.by_name(name).index)


def take(storage, seq: int) -> int:
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([seq]))
    storage.advance(np.array([row]))
    return row


def scribble(storage, row: int, value: int) -> None:
    """Host bytes `value` on every page `row` would receive (as a previous occupant left them)."""
    storage.device.synchronize()
    for name, ids in request_pages(storage, row).items():
        band(storage, name)[torch.from_numpy(ids)] = value


def busy(device, stream) -> threading.Event:
    """Hold `stream` busy until the returned gate opens (a timer opens it late)."""
    gate = threading.Event()
    device.launch(stream, gate.wait, label="busy")
    threading.Timer(OPEN_AFTER_S, gate.set).start()
    return gate


def payload(storage, p) -> dict[str, torch.Tensor]:
    """What the peer sends for `p`: distinct bytes per page."""
    out = {}
    for name, ids in p.ids.items():
        width = band(storage, name).shape[1]
        out[name] = torch.stack([torch.full((width,), 1 + (7 * i + 3 * len(name)) % 250, dtype=torch.uint8)
                                 for i in range(len(ids))]) if len(ids) else torch.zeros((0, width), dtype=torch.uint8)
    return out


def peer_writes(storage, sent: dict):
    """The peer's one-sided write: it lands on the published ids as soon as it learns them."""

    def publish(p) -> None:
        data = payload(storage, p)
        sent[p.rid] = data
        for name, ids in p.ids.items():
            band(storage, name)[torch.from_numpy(np.asarray(ids))] = data[name]

    return publish


def landed(storage, row: int, data: dict[str, torch.Tensor]) -> bool:
    """The row's pages, as they are now, hold what the peer sent, page for page."""
    storage.device.synchronize()
    return all(torch.equal(band(storage, name)[torch.from_numpy(ids)], data[name])
               for name, ids in request_pages(storage, row).items())


def test_deferred_publication_is_refused_outside_overlap_on_an_async_device_without_pp(monkeypatch, device):
    """PD-12: with the switch on, deferral needs the overlap scheduler, a device whose streams run
    apart from the host (ThreadDevice, CUDA) and no pipeline parallelism; anything else raises a
    typed error. With the switch off, nothing defers."""
    assert deferred_publication(device, overlap=True) is False
    monkeypatch.setenv(SWITCH, "1")
    assert deferred_publication(device, overlap=True) is True
    for dev, overlap, stages in ((device, False, 1), (ImmediateDevice(), True, 1), (ModeledDevice(), True, 1),
                                 (device, True, 2)):
        with pytest.raises(DeferredPublishError):
            deferred_publication(dev, overlap=overlap, pipeline_stages=stages)


def test_publication_waits_the_allocations_event_in_a_later_iteration(device):
    """PD-13: the take's zeroing waits behind a busy schedule stream; the ids are read back on the
    publish stream gated on the allocation's event, and published in the next iteration only once
    that readback ran. The peer's write then lands after the zeroing: the pages hold its bytes.
    Published before the allocation's event, the zeroing would wipe them."""
    storage = make_storage(device)
    queue = DecodePreallocQueue(storage, deferred=True)
    old = take(storage, 37)
    scribble(storage, old, 0xAB)  # a previous request's bytes on the pages the receive takes next
    storage.free_rows(np.array([old]))
    sent: dict = {}
    assert queue.publish_pending_destinations(peer_writes(storage, sent)) == []  # iteration 1: nothing yet
    busy(device, device.schedule_stream)
    row = take(storage, 37)
    pages = request_pages(storage, row)
    p = queue.allocate("r1", row, pages, storage.hold_receive_rows("r1", pages), seq_len=37)
    assert not p.hold.published and not sent  # taken this iteration, published in a later one
    assert queue.publish_pending_destinations(peer_writes(storage, sent)) == [p]
    assert p.hold.published and queue.unpublished == []
    assert landed(storage, row, sent["r1"])


@pytest.mark.parametrize("relieve", ["moves", "moves behind a busy schedule stream"])
def test_a_page_moved_since_the_allocation_is_republished_after_the_schedule_stream(monkeypatch, device, relieve):
    """PD-17 under deferral (PD-13): between the allocation and the next iteration's publication,
    compaction moves the receive row's pages (`move_epoch` changes) and another request takes the
    pages they left. Publication reads the ids again and waits the schedule stream, which holds the
    moves' copies: the peer's bytes land on the request's pages as they are now. With the
    allocation-time ids they land on the other request's; read again but gated on the allocation's
    event, they land before the move's copy, which overwrites them."""
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_GAP_FRACTION", "1.0")
    storage = make_storage(device, chain_kib=32)
    queue = DecodePreallocQueue(storage, deferred=True)
    queue.publish_pending_destinations(lambda p: None)
    filler = take(storage, 17)
    row = take(storage, 37)
    pages = request_pages(storage, row)
    hold = storage.hold_receive_rows("r1", pages)
    queue.allocate("r1", row, pages, hold, seq_len=37)
    epoch = storage.move_epoch
    storage.published(hold)  # stands in for a relief that found no layout keeping the rows in place
    storage.free_rows(np.array([filler]))
    if relieve != "moves":
        busy(device, device.schedule_stream)
    storage.flush_opportunistic()
    moved = {k: v for k, v in request_pages(storage, row).items() if not np.array_equal(v, pages[k])}
    assert storage.move_epoch != epoch and moved
    other = take(storage, 17)  # the pages the move vacated belong to another request now
    sent: dict = {}
    queue.publish_pending_destinations(peer_writes(storage, sent))
    assert landed(storage, row, sent["r1"])
    storage.free_rows(np.array([row, other]))


def test_a_received_state_slot_is_copied_on_its_consumers_stream(device):
    """PD-16: the staged state bytes of a receive land on the forward stream that reads the slot
    next, after the allocation's event (the schedule stream, busy here). The forward launched right
    after reads the received state, not the slot's stale bytes; on another stream without that
    order, it would read them stale."""
    storage = make_storage(device)
    row = take(storage, 37)
    state = storage.plan.state.name
    slot = request_pages(storage, row)[state]
    scribble(storage, row, 0x11)  # the slot's previous occupant's state
    busy(device, device.schedule_stream)
    allocated = device.record(device.schedule_stream, "allocated")
    width = band(storage, state).shape[1]
    staged = torch.full((width,), 0x5A, dtype=torch.uint8)
    place = state_on_consumer_stream(storage, allocated)
    place(storage.arena.data, staged, segments_of(storage, {state: slot}))
    seen = {}
    device.launch(device.forward_stream, lambda: seen.update(state=band(storage, state)[int(slot[0])].clone()),
                  label="the forward that reads the slot")
    device.synchronize()
    assert torch.equal(seen["state"], staged)
    assert torch.equal(band(storage, state)[int(slot[0])], staged)
