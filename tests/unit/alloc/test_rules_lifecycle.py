"""Lifecycle and ledger rules held one by one on the modeled device: frees, the write-after-read
barrier, launch records, forward recording and retirement, and what the ledger holds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from kvchain.alloc.band import PENDING
from kvchain.alloc.forward_steps import LaunchRecord
from kvchain.alloc.id_space import UNBOUND
from kvchain.alloc.page_usage import CLEARANCE, Clear, Consumer, Hazard, PageUsage, PageUse
from kvchain.alloc.signals import NetworkTransfer
from kvchain.device import ImmediateDevice, ModeledDevice, ThreadDevice
from kvchain.errors import InvariantError
from kvchain.testing.overlap import OverlapDriver, overlap_storage
from support.modeled import launch_forward, modeled_storage, process, request


def _spy_waits(monkeypatch, device):
    """Every stream wait queued on `device`, as (stream name, event)."""
    waits = []
    original = device.stream_wait

    def spy(stream, event):
        waits.append((stream.name, event))
        original(stream, event)

    monkeypatch.setattr(device, "stream_wait", spy)
    return waits


def _forward_uses(band, step):
    return [u for u in band.usage.uses if u.hazard is Hazard.FORWARD and u.step == step]


# -- frees ------------------------------------------------------------------------------------------


def test_free_unbinds_and_returns_virtual_ids_at_once():
    """LIFE-2: a free unbinds virtual and physical ids and hands the virtual ids (and state slot
    ids) back immediately, even while its pages still pend under a running forward."""
    storage, _ = modeled_storage()
    chain = storage.allocator
    owner, state = chain.owner, chain.state_band
    row, vtok = request(storage, 12)
    vpages = storage.table.pages_of(row)
    physical = owner.ids.v2p[vpages].copy()
    slot = int(storage.table.state_slot[row])
    slot_physical = int(state.ids.v2p[slot])
    rec = launch_forward(storage, np.array([row]), vtok)
    free_virtual, free_slots = len(chain.virtual_free), len(chain.slot_free)
    storage.free_rows(np.array([row]))
    assert (owner.state[physical] == PENDING).all()  # the pages are not reusable yet ...
    assert (owner.ids.v2p[vpages] == UNBOUND).all() and (owner.ids.p2v[physical] == UNBOUND).all()
    assert state.ids.v2p[slot] == UNBOUND and state.ids.p2v[slot_physical] == UNBOUND
    # ... but their virtual ids are free now
    assert len(chain.virtual_free) == free_virtual + len(vpages)
    assert set(vpages.tolist()) <= set(chain.virtual_free.view().tolist())
    assert len(chain.slot_free) == free_slots + 1 and slot in chain.slot_free.view().tolist()
    process(storage, rec)
    storage.check_idle()


# -- the write-after-read barrier --------------------------------------------------------------------


def test_war_barrier_without_a_shared_read_end_waits_the_whole_forward_stream(monkeypatch):
    """LIFE-5: with no shared-read end declared, the schedule stream waits the whole forward stream
    (work queued there after `forward_done` too), not just the forward's done event; with one
    declared, it waits exactly that (LIFE-4)."""
    storage, dev = modeled_storage()
    row, vtok = request(storage, 8)
    rec = launch_forward(storage, np.array([row]), vtok)  # declares no shared-read end
    dev.launch(dev.forward_stream, None, label="forward tail")  # still on the forward stream
    tail = dev._tail["forward"]
    assert tail > rec.event.time
    waits = _spy_waits(monkeypatch, dev)
    storage.apply_war_barrier()
    assert len(waits) == 1
    stream, event = waits[0]
    assert stream == "schedule" and event.stream is dev.forward_stream and event.time >= tail
    assert dev._tail["schedule"] >= tail
    process(storage, rec)
    # a forward that declares its shared-read end: the barrier waits that event only
    rec2 = launch_forward(storage, writes_known=False, shared_read_end=True)
    shared = rec2.shared_read_done
    waits.clear()
    storage.apply_war_barrier()
    assert waits == [("schedule", shared)]
    process(storage, rec2)


def test_overlap_loop_applies_the_barrier_after_each_launch_before_processing(monkeypatch):
    """LIFE-6: the overlap loop (`OverlapDriver.step`) applies the write-after-read barrier after
    each forward it runs and before the previous result is processed."""
    device = ModeledDevice(seed=1, durations={"forward": 6.0})
    storage = overlap_storage(device, chain_kib=12)
    log = []
    for name in ("record_forward", "apply_war_barrier", "forward_processed"):
        original = getattr(storage, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            step = args[0].step if args and isinstance(args[0], LaunchRecord) else None
            log.append((_name, step))
            return _original(*args, **kwargs)

        monkeypatch.setattr(storage, name, wrapped)
    stats = OverlapDriver(storage, seed=1).run(40)
    assert stats.forwards > 20 and stats.mismatches == []
    recorded = [i for i, (name, _) in enumerate(log) if name == "record_forward"]
    assert len(recorded) == stats.forwards
    for i in recorded:  # every launch is followed by the barrier before anything else happens
        assert log[i + 1] == ("apply_war_barrier", None), log[i : i + 3]
    # the previous result is processed only behind the barrier of the forward launched after it
    launched = [step for name, step in log if name == "record_forward"]
    for k, step in enumerate(launched[:-1]):
        nxt = log.index(("record_forward", launched[k + 1]))
        done = log.index(("forward_processed", step))
        assert done > nxt + 1


def _devices():
    yield "modeled", lambda: ModeledDevice(seed=0)
    yield "immediate", ImmediateDevice
    yield "threads", ThreadDevice
    if torch.cuda.is_available():
        from kvchain.device import CudaDevice

        yield "cuda", CudaDevice


@pytest.mark.parametrize("make", [m for _, m in _devices()], ids=[n for n, _ in _devices()])
def test_war_barrier_is_on_for_every_device(make, monkeypatch):
    """LIFE-8: the write-after-read barrier is not gated by the device: on each backend it queues
    the schedule stream's wait on the running forward's shared-read end, or on the whole forward
    stream when none was declared."""
    device = make()
    try:
        storage = overlap_storage(device, chain_kib=12)
        row, vtok = request(storage, 8)
        rec = launch_forward(storage, np.array([row]), vtok)
        waits = _spy_waits(monkeypatch, device)
        storage.apply_war_barrier()
        assert [s for s, _ in waits] == ["schedule"] and waits[0][1].stream is device.forward_stream
        process(storage, rec)
        rec2 = launch_forward(storage, writes_known=False, shared_read_end=True)
        shared = rec2.shared_read_done
        waits.clear()
        storage.apply_war_barrier()
        assert waits == [("schedule", shared)]
        process(storage, rec2)
    finally:
        device.close()


# -- launch records and forward recording -----------------------------------------------------------


def test_forward_launched_opens_the_record_processing_carries():
    """LIFE-21: `forward_launched` opens a launch record, and that same record, carried with the
    step's result, is what processing takes: a stand-in for it is refused."""
    storage, dev = modeled_storage()
    steps = storage.allocator.forward_steps
    row, vtok = request(storage, 4)
    rec = storage.forward_launched()
    assert isinstance(rec, LaunchRecord) and rec.has_forward and not rec.recorded and not rec.processed
    assert list(steps.in_flight) == [rec]
    with pytest.raises(InvariantError, match="between the launch"):  # the record is open
        storage.alloc_extend(np.array([row]), np.array([9]))
    dev.launch(dev.forward_stream, None, label="forward")
    storage.record_forward(rec, dev.record(dev.forward_stream, "done"), storage.iteration_ids(vtok, np.array([row])))
    rec2 = storage.forward_launched()
    assert rec2.step == rec.step + 1 and list(steps.in_flight) == [rec, rec2]
    storage.record_forward(rec2, dev.record(dev.forward_stream, "done2"), None)
    stand_in = LaunchRecord(rec.step, True, rec.event, recorded=True)
    with pytest.raises(InvariantError, match="launch order"):
        storage.forward_processed(stand_in)
    process(storage, rec)
    assert rec.processed and steps.processed_through == rec.step and list(steps.in_flight) == [rec2]
    process(storage, rec2)
    storage.free_rows(np.array([row]))
    storage.check_idle()


def test_record_forward_records_the_event_then_the_writes():
    """LIFE-22: `record_forward` first records the forward (`forward_recorded`: its fresh
    `forward_done` event) and then, in every band's ledger, the ids it writes: token pages per
    attention sub-pool, state slots in the state sub-pool. A record refused for a stale event
    leaves the ledger untouched."""
    storage, dev = modeled_storage()
    chain = storage.allocator
    ps = storage.page_size
    a, va = request(storage, 6)
    b, vb = request(storage, 9)
    rows = np.array([a, b])
    vtok = np.concatenate([va[-1:], vb[-2:]])
    ids = storage.iteration_ids(vtok, rows)
    rec = storage.forward_launched()
    dev.launch(dev.forward_stream, None, label="forward")
    done = dev.record(dev.forward_stream, "done")
    storage.record_forward(rec, done, ids)
    assert rec.recorded and rec.event is done and rec.writes_known
    for band in chain.bands:
        (use,) = _forward_uses(band, rec.step)
        assert use.event is done and use.writes
        want = ids.state_slots if band is chain.state_band else np.unique(ids.locs[band.name] // ps)
        assert sorted(use.pages.tolist()) == sorted(want.tolist())
    rec2 = storage.forward_launched()
    before = [len(band.usage) for band in chain.bands]
    with pytest.raises(InvariantError, match="fresh event"):
        storage.record_forward(rec2, done, ids)
    assert [len(band.usage) for band in chain.bands] == before
    storage.record_forward(rec2, dev.record(dev.forward_stream, "done2"), ids)
    process(storage, rec)
    process(storage, rec2)
    storage.free_rows(rows)
    storage.check_idle()


# -- the ledger ---------------------------------------------------------------------------------------


def test_each_band_ledger_holds_one_use_per_unended_use():
    """LEDG-1: every band keeps a `PageUsage` holding one `PageUse` per use of its pages that has
    not ended (a forward's writes, a backup, a network send, a load reservation), counted per page,
    and each record leaves when its use ends."""
    storage, dev = modeled_storage()
    chain = storage.allocator
    owner = chain.owner
    assert all(isinstance(b.usage, PageUsage) and len(b.usage) == 0 for b in chain.bands)
    row, vtok = request(storage, 8)
    pages = storage.physical_pages(owner.name, storage.table.pages_of(row))
    rec = launch_forward(storage, np.array([row]), vtok)
    backup = storage.record_host_transfer("backup", False, {owner.name: pages},
                                          dev.record(dev.stream("copy"), "backup done"))
    send = NetworkTransfer("send", sends=True, done=dev.record(dev.stream("network"), "send done"))
    storage.record_network_transfer(send, {owner.name: pages[:1]})
    loaded, reservation = storage.alloc_load(owner.name, 2)
    uses = Counter(u.hazard for u in owner.usage.uses)
    assert uses == {Hazard.FORWARD: 1, Hazard.COPY_READ: 1, Hazard.NETWORK: 1, Hazard.FIXED: 1}
    assert owner.usage.count[pages[:1]].tolist() == [3]  # its forward, the backup and the send
    assert owner.usage.count[loaded].tolist() == [1, 1]
    process(storage, rec)
    assert Hazard.FORWARD not in {u.hazard for u in owner.usage.uses}
    storage.end_host_transfer(backup)
    storage.end_network_transfer(send)
    storage.end_load_reservations(owner.name, reservation)
    assert all(len(b.usage) == 0 and not b.usage.count.any() for b in chain.bands)


def test_forward_writes_are_recorded_until_the_forward_retires():
    """LEDG-2, LEDG-7: `record_forward` records each forward's writes with `set_inflight_forward`;
    the record ends when that forward retires, at its processing, which retires every earlier
    forward too, while later forwards keep theirs."""
    storage, _dev = modeled_storage()
    owner = storage.allocator.owner
    a, va = request(storage, 8)
    b, vb = request(storage, 8)
    f1 = launch_forward(storage, np.array([a]), va)
    f2 = launch_forward(storage, np.array([b]), vb)
    assert len(_forward_uses(owner, f1.step)) == 1 and len(_forward_uses(owner, f2.step)) == 1
    process(storage, f1)
    assert _forward_uses(owner, f1.step) == [] and len(_forward_uses(owner, f2.step)) == 1
    process(storage, f2)
    assert _forward_uses(owner, f2.step) == []
    # retirement through a step covers every earlier forward, whose writes were known or not
    usage = PageUsage(8)
    usage.record(PageUse(Hazard.FORWARD, np.array([1]), True, step=3))
    usage.record(PageUse(Hazard.FORWARD, np.array([2]), True, step=5))
    usage.record(PageUse(Hazard.FORWARD, np.array([3]), True, step=6))
    usage.unknown_writer = PageUse(Hazard.FORWARD, np.empty(0, dtype=np.int64), True, step=4)
    ended = usage.end_forwards_through(5)
    assert sorted(u.step for u in ended) == [3, 4, 5]
    assert [u.step for u in usage.uses] == [6] and usage.unknown_writer is None
    assert usage.count.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


def test_forward_hazard_is_for_vacated_sources_and_frees_pend():
    """LEDG-30: a page its owner frees under a running forward gets no ledger record of its own: its
    pending batch covers it until that forward is processed. The FORWARD hazard the ledger records
    for a running forward stands for the old bytes of a page a move vacated, which the next writer
    of that page clears with a stream wait on the forward."""
    storage, dev = modeled_storage(chain_kib=16)
    owner = storage.allocator.owner
    rows = [request(storage, 8) for _ in range(3)]
    (base, _), (middle, vmid), (frontier, _) = rows
    base_pages = owner.ids.v2p[storage.table.pages_of(base)].copy()
    # the forward writes only the middle row; the base row is freed under it
    f1 = launch_forward(storage, np.array([middle]), vmid[-1:])
    storage.free_rows(np.array([base]))
    assert (owner.state[base_pages] == PENDING).all()
    assert [(p.key, p.size) for p in owner.pending] == [(f1.step, len(base_pages))]
    assert owner.usage.on(base_pages) == []
    process(storage, f1)
    assert owner.n_pending == 0 and owner.usage.on(base_pages) == []
    # a move under a running forward vacates its sources with a FORWARD record (kept in the ledger,
    # or as a fence over their bytes once the frontier retreated over them)
    chain = storage.allocator
    f2 = launch_forward(storage, np.array([middle]), np.empty(0, dtype=np.int64))
    assert storage.allocator.flush(owner, max_moves=64) > 0
    vacated = [u for u in owner.usage.uses if u.vacated] + [f.use for f in chain.fences]
    assert vacated and all(u.hazard is Hazard.FORWARD and u.step == f2.step and u.event is f2.event
                           and not u.writes for u in vacated)
    assert CLEARANCE[Consumer.ZERO][Hazard.FORWARD] is Clear.STREAM_WAIT
    waits = []
    original = dev.stream_wait
    dev.stream_wait = lambda stream, event: (waits.append((stream.name, event)), original(stream, event))
    again, _ = request(storage, 8)  # takes those pages (or bytes) back: waits the forward first
    assert ("schedule", f2.event) in waits
    process(storage, f2)
    assert not [u for u in owner.usage.uses if u.vacated] and not chain.fences
    storage.free_rows(np.array([middle, frontier, again]))
    storage.check_idle()


# -- state copies and request-length checks ---------------------------------------------------------------


def _state_copy_after(storage, device, src_slot, dst_slot):
    """Copy one state slot and return the copy's launch on the modeled device."""
    start = len(device.history)
    storage.copy_state(np.array([src_slot]), np.array([dst_slot]))
    return [w for w in device.history[start:] if w.label == "state_copy"]


def test_a_state_copy_waits_the_forward_that_writes_its_source():
    """LEDG-14: a state copy (a checkpoint, a fork) reads a slot the forward in flight writes: it
    runs on the schedule stream after a stream wait on that forward, and the host never blocks."""
    from kvchain.device.modeled import clock_leq

    storage, device = modeled_storage()
    row, vtok = request(storage, 8)
    src = int(storage.table.state_slot[row])
    dst = int(storage.alloc_state_slots(1)[0])
    forward = launch_forward(storage, np.array([row]), vtok[-1:])
    blocked = device.counters.host_waits_blocked
    copies = _state_copy_after(storage, device, src, dst)
    assert len(copies) == 1
    assert copies[0].stream == device.schedule_stream.name
    assert clock_leq(forward.event.clock, copies[0].clock), "the copy may read the slot before the forward wrote it"
    assert device.counters.host_waits_blocked == blocked
    process(storage, forward)


def test_a_state_copy_of_a_slot_no_forward_writes_waits_nothing():
    """LEDG-14: the wait comes from the ledger, not from caution: a slot no unretired forward
    writes is copied without a stream wait."""
    storage, device = modeled_storage()
    row, _vtok = request(storage, 8)
    other, vtok = request(storage, 8)
    src = int(storage.table.state_slot[row])
    dst = int(storage.alloc_state_slots(1)[0])
    forward = launch_forward(storage, np.array([other]), vtok[-1:])
    waits = storage.allocator.state_band.stats["stream_waits"]
    assert len(_state_copy_after(storage, device, src, dst)) == 1
    assert storage.allocator.state_band.stats["stream_waits"] == waits
    process(storage, forward)


def test_request_length_bounds_are_checked_on_every_busy_iteration(monkeypatch):
    """CHK-18: with `KVCHAIN_CHECK_KV_PAGE_INVARIANTS=1` a forward whose rows break their length
    bounds is refused when it is recorded; sound rows pass, and with the switch off nothing is
    checked."""
    monkeypatch.setenv("KVCHAIN_CHECK_KV_PAGE_INVARIANTS", "1")
    storage, _device = modeled_storage()
    row, vtok = request(storage, 8)
    process(storage, launch_forward(storage, np.array([row]), vtok[-1:]))
    storage.table.shared_pages[row] = 5  # more tree-shared pages than 8 tokens span
    with pytest.raises(InvariantError, match="length_bounds"):
        launch_forward(storage, np.array([row]), vtok[-1:])
    monkeypatch.setenv("KVCHAIN_CHECK_KV_PAGE_INVARIANTS", "0")
    storage, _device = modeled_storage()
    row, vtok = request(storage, 8)
    storage.table.shared_pages[row] = 5
    process(storage, launch_forward(storage, np.array([row]), vtok[-1:]))
