"""The per-band page ledger and CLEARANCE, on the modeled device: take clearance, host-tier copies,
network transfers, receive holds, fixed pages, and the opportunistic flush's gates."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.band import VACATED, allocator_operation
from kvchain.alloc.page_usage import CLEARANCE, Consumer, Hazard
from kvchain.alloc.signals import NetworkTransfer
from kvchain.errors import CapacityError, InvariantError, TransferTimeoutError
from support.modeled import full_pages, launch_forward, modeled_storage, network_transfer, process, request

C, H = Consumer, Hazard


def test_clearance_table_is_the_spec():
    """LEDG-9: the one table the code reads is the design's, cell for cell. Each cell's behaviour
    (the wait really happening on the device) is held in `test_clearance_behaviour.py`."""
    expected = {
        C.FORWARD: ("none", "stream wait", "stream wait", "host wait", "excluded"),
        C.SCHEDULE_COPY: ("stream wait", "stream wait", "stream wait", "host wait", "excluded"),
        C.ZERO: ("stream wait", "stream wait", "stream wait", "host wait", "excluded"),
        C.HOST_LOAD: ("none", "stream wait", "stream wait", "host wait", "excluded"),
        C.NETWORK_RECEIVE: ("after retire", "stream wait", "stream wait", "host wait", "excluded"),
    }
    hazards = (H.FORWARD, H.COPY_READ, H.COPY_WRITE, H.NETWORK, H.FIXED)
    for consumer, row in expected.items():
        assert tuple(CLEARANCE[consumer][h].value for h in hazards) == row, consumer


def _labels(storage, kind):
    return [d for d in storage.allocator.decisions if d[0] == kind]


def test_take_prefers_holes_that_need_no_wait_and_clears_the_rest():
    """LEDG-31, LEDG-32, HIC-2/3: holes a backup still reads come last; when taken, the schedule
    stream waits the backup before zeroing them."""
    storage, dev = modeled_storage(chain_kib=8)
    storage.allocator.decisions = []
    owner = storage.allocator.owner
    (r1, _), (r2, _) = request(storage, 8), request(storage, 8)
    backed = storage.table.pages_of(r1)
    done = dev.record(dev.stream("copy"), "backup done")
    storage.record_host_transfer("backup", False, {"full": storage.physical_pages("full", backed)}, done)
    storage.free_rows(np.array([r1, r2]))
    busy = owner.usage.busy(owner.holes.view())
    assert busy.sum() == 2 and (~busy).sum() == 2
    clean = owner._take_holes(2, None)
    assert not owner.usage.busy(clean).any()
    owner.holes.push(clean)
    owner.n_holes += 2
    _r3, _ = request(storage, 16)  # needs all four holes: two of them wait the backup
    waits = [d for d in _labels(storage, "stream_wait") if d[1] == "full"]
    assert waits and waits[-1][3] == "backup done"


def _base_and_frontier(storage, rows):
    """The rows whose pages lie nearest the owner's base (top of the arena) and its frontier."""
    owner = storage.allocator.owner
    pages = {r: owner.ids.v2p[storage.table.pages_of(r)] for r in rows}
    return max(rows, key=lambda r: pages[r].max()), min(rows, key=lambda r: pages[r].min())


def _three_requests():
    """A 16 KiB chain recording its decisions, holding three 8-token requests: the storage, its
    device, each row's virtual tokens, and the rows nearest the owner's base and its frontier."""
    storage, dev = modeled_storage(chain_kib=16)
    storage.allocator.decisions = []
    vtok = dict(request(storage, 8) for _ in range(3))
    base, frontier = _base_and_frontier(storage, list(vtok))
    return storage, dev, vtok, base, frontier


def test_backup_does_not_hold_a_move_but_fences_its_source():
    """HIC-3, COMP-19, LEDG-3, LEDG-5: a move of a page a backup reads does not wait it; the
    vacated source stays a hole its next writer waits the copy for, fenced until the backup's
    record ends."""
    storage, dev, _vtok, base, frontier = _three_requests()
    chain = storage.allocator
    owner = chain.owner
    phys = full_pages(storage, frontier)
    done = dev.record(dev.stream("copy"), "backup done")
    transfer = storage.record_host_transfer("backup", False, {"full": phys}, done)
    storage.free_rows(np.array([base]))
    waits_before = dev.counters.stream_waits
    assert storage.allocator.flush(owner, max_moves=64) > 0
    assert not [d for d in _labels(storage, "stream_wait") if d[3] == "backup done"]
    assert dev.counters.stream_waits == waits_before
    fenced = owner.usage.on(phys) + [f.use for f in chain.fences]
    assert fenced and fenced[0].hazard is Hazard.COPY_READ  # the sources still carry the backup
    storage.end_host_transfer(transfer)
    assert not owner.usage.uses and not chain.fences


def test_a_load_is_fixed_until_its_reservation_ends_and_moves_wait_its_copy():
    """HIC-4/5/8, COMP-11, COMP-17, LEDG-6: load pages are fixed (never moved) until the reservation
    ends; a later move of them waits the load's copy."""
    storage, dev = modeled_storage(chain_kib=16)
    chain = storage.allocator
    chain.decisions = []
    owner = chain.owner
    filler = request(storage, 16)[0]
    pages, reservation = storage.alloc_load("full", 3)
    assert owner.n_fixed == 3 and owner.fixed_mask[pages].all()
    done = dev.record(dev.stream("copy"), "load done")
    transfer = storage.record_host_transfer("load", True, {"full": pages}, done)
    storage.end_load_reservations("full", reservation)
    assert owner.n_fixed == 0
    # bind the loaded pages to a row, as the tree would, then make them the band's frontier pages
    vpages = chain.virtual_free.pop(3)
    owner.bind(vpages, pages)
    row = storage.alloc_row()
    storage.table.page_table[row, :3] = vpages
    storage.table.seq_lens[row] = 3 * storage.page_size
    for band in chain.window_bands:
        band.bind(vpages, storage.allocator.take_from(band, 3))
    storage.free_rows(np.array([filler]))
    storage.allocator.relief_flush(owner)
    assert [d for d in _labels(storage, "stream_wait") if d[3] == "load done"]
    storage.end_host_transfer(transfer)
    storage.free_rows(np.array([row]))
    storage.check_idle()


def test_load_reservation_excludes_frees(monkeypatch):
    """CHK-6: an owner free never names a page reserved for a host-tier load."""
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    storage, _ = modeled_storage()
    pages, _reservation = storage.alloc_load("full", 2)
    storage.allocator.owner.bind(storage.allocator.virtual_free.pop(2), pages)
    with pytest.raises(InvariantError, match=r"band\.free_outside_reservation"):
        storage.allocator.free(storage.allocator.owner, pages)


def test_network_send_vacates_freed_pages_until_released():
    """PD-1, COMP-18, LEDG-4: pages a send reads leave use when freed, and return when released."""
    storage, dev = modeled_storage()
    owner = storage.allocator.owner
    row, _ = request(storage, 8)
    phys = full_pages(storage, row)
    send = network_transfer(dev)
    storage.record_network_transfer(send, {"full": phys})
    storage.free_rows(np.array([row]))
    assert (owner.state[phys] == VACATED).all() and owner.n_vacated == 2 and owner.n_holes == 0
    assert storage.allocator.snapshot().bands[owner.index].fixed == 2
    storage.end_network_transfer(send)
    assert owner.n_vacated == 0 and owner.n_holes == 2
    storage.check_idle()


def _fill(storage, length):
    rows = []
    while storage.table.free_rows:
        row = storage.alloc_row()
        try:
            storage.alloc_extend(np.array([row]), np.array([length]))
        except CapacityError:
            storage.table.free_row(row)
            break
        rows.append(row)
    return rows


def _relief_setup(send_at_frontier: bool):
    """A window end and the full-attention end, full of requests; every request freed but one,
    whose full-attention pages a network send reads: at the owner's frontier, or at its base."""
    storage, dev = modeled_storage(chain_kib=4, windows=(16,), state=False, rows=64)
    chain = storage.allocator
    chain.decisions = []
    rows = _fill(storage, 8)
    base, frontier = _base_and_frontier(storage, rows)
    kept = frontier if send_at_frontier else base
    dev.launch(dev.stream("network"), None, label="the transfer engine sends")
    send = network_transfer(dev)
    storage.record_network_transfer(send, {"full": full_pages(storage, kept)})
    storage.free_rows(np.array([r for r in rows if r != kept]))
    window = chain.window_bands[0]
    storage.allocator.flush(window, 0)
    # every free page, in the window's page size: the owner must pack its live pages to its base
    free = chain.layout.chain_bytes - sum(b.n_live * b.page_bytes for b in chain.bands)
    demand = [0, 0]
    demand[window.index] = free // window.page_bytes - 2
    return storage, dev, send, demand


def test_relief_keeps_network_rows_in_place_then_waits_the_host():
    """ALLOC-14/15, PD-6/7: relief plans first with network-held rows fixed; only when no such
    layout serves does it wait the transfers on the host and plan with every byte."""
    storage, dev, send, demand = _relief_setup(send_at_frontier=True)
    chain = storage.allocator
    blocked = dev.counters.host_waits_blocked
    assert chain.units_fit(demand) and not chain.in_place(demand)
    chain.take(demand)
    assert _labels(storage, "host_wait") == [("host_wait", ["send"])]
    assert dev.counters.host_waits_blocked == blocked + 1 and send.released
    # with the send's pages already at the base, the same relief keeps them in place: no wait
    storage, dev, send, demand = _relief_setup(send_at_frontier=False)
    storage.allocator.take(demand)
    assert _labels(storage, "host_wait") == [] and not send.released


def test_transfer_wait_deadline_names_the_transfers(monkeypatch):
    """PD-4: a host wait that outlives KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT raises naming the transfers."""
    storage, dev = modeled_storage()
    dev.delay_next("stuck", 10_000.0)
    dev.launch(dev.stream("network"), None, label="stuck send")
    send = NetworkTransfer("stuck-send", sends=True, done=dev.record(dev.stream("network"), "send done"))
    monkeypatch.setenv("KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT", "5")
    with pytest.raises(TransferTimeoutError, match="stuck-send"):
        storage.allocator.wait_transfers([send])
    assert not send.released


def test_receive_holds_keep_opportunistic_compaction_away():
    """PD-8, COMP-10: a band holding receive rows awaiting publication is left alone."""
    storage, _, vtok, base, frontier = _three_requests()
    owner = storage.allocator.owner
    receive = next(r for r in vtok if r not in (base, frontier))
    hold = storage.hold_receive_rows("rx", {"full": full_pages(storage, receive)})
    storage.free_rows(np.array([base]))
    assert storage.allocator.flush(owner, max_moves=64) == 0
    storage.published(hold)
    assert storage.allocator.flush(owner, max_moves=64) > 0
    storage.free_rows(np.array([receive, frontier]))
    storage.check_idle()


def test_opportunistic_flush_never_waits_an_unretired_forward():
    """COMP-5, COMP-9: it stops at a source an unfinished forward writes instead of waiting."""
    storage, dev, vtok, base, frontier = _three_requests()
    owner = storage.allocator.owner
    storage.free_rows(np.array([base]))
    rec = launch_forward(storage, np.array([frontier]), vtok[frontier])  # writes the frontier pages
    waits = dev.counters.stream_waits
    assert storage.allocator.flush(owner, max_moves=64) == 0  # the first source is written by the running forward
    assert dev.counters.stream_waits == waits
    process(storage, rec)
    assert storage.allocator.flush(owner, max_moves=64) > 0


def test_speculative_forward_freezes_compaction_until_it_retires():
    """LIFE-36, COMP-14, COMP-15: unknown writes: nothing moves opportunistically; urgent waits it."""
    storage, _, _vtok, base, _frontier = _three_requests()
    owner = storage.allocator.owner
    storage.free_rows(np.array([base]))
    rec = launch_forward(storage, writes_known=False)
    assert storage.allocator.flush(owner, max_moves=64) == 0
    assert storage.allocator.relief_flush(owner) > 0
    assert [d for d in _labels(storage, "stream_wait") if d[3] == f"forward_done:{rec.step}"]
    process(storage, rec)


def test_host_read_after_a_stream_wait_is_flagged(monkeypatch):
    """CHK-10, LIFE-41: within one operation every host read of device state precedes the first
    stream wait."""
    storage, dev = modeled_storage()
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    chain = storage.allocator
    with allocator_operation():
        chain._read_ahead()  # the read-ahead first: fine
        chain._stream_wait(chain.owner, dev.record(dev.forward_stream, "x"), "test")
        with pytest.raises(InvariantError, match=r"band\.host_read_before_wait"):
            chain._read_ahead()
    with allocator_operation():  # a new operation starts clean
        chain._read_ahead()


def test_ledger_is_empty_at_quiescence():
    """HARN-12's condition on a full cycle of uses, LEDG-3/4: forwards retire, a host copy's record
    ends with `end_host_transfer`, a network transfer's with `end_network_transfer`."""
    storage, dev = modeled_storage()
    row, vtok = request(storage, 8)
    rec = launch_forward(storage, np.array([row]), vtok)
    phys = full_pages(storage, row)
    backup = storage.record_host_transfer("b", False, {"full": phys}, dev.record(dev.stream("copy"), "b"))
    send = NetworkTransfer("s", sends=True, done=dev.record(dev.stream("network"), "s"))
    storage.record_network_transfer(send, {"full": phys})
    assert any(len(b.usage) for b in storage.allocator.bands)
    process(storage, rec)
    storage.end_host_transfer(backup)
    storage.end_network_transfer(send)
    assert not any(len(b.usage) for b in storage.allocator.bands) and not storage.allocator.fences


def test_a_load_beyond_the_holes_settles_pending_pages_first():
    """HIC-5, LIFE-29: a band with pending pages whose holes do not cover a load settles before it
    takes: the load gets pages pending under the forward in flight instead of growing the band,
    and its zeroing of them runs behind a schedule-stream wait on that forward; the host never
    blocks."""
    from kvchain.device.modeled import clock_leq

    storage, dev = modeled_storage(chain_kib=16)
    owner = storage.allocator.owner
    idle, _ = request(storage, 8)
    busy, _ = request(storage, 8)
    storage.free_rows(np.array([idle]))  # two holes
    forward = launch_forward(storage, None, np.empty(0, dtype=np.int64))
    pending = full_pages(storage, busy)
    storage.free_rows(np.array([busy]))  # two pages pending under the forward
    assert owner.n_holes == 2 and owner.n_pending == 2
    span, blocked, start = owner.span, dev.counters.host_waits_blocked, len(dev.history)
    pages, reservation = storage.alloc_load("full", 3)
    settled = pages[np.isin(pages, pending)]
    assert len(settled) and owner.span == span, "the load grew the band instead of settling"
    zeroes = [w for w in dev.history[start:] if w.label == "zero"
              and any(a.band == owner.index and np.isin(settled, a.ids).any() for a in w.writes)]
    assert zeroes and all(clock_leq(forward.event.clock, w.clock) for w in zeroes)
    assert dev.counters.host_waits_blocked == blocked and not forward.processed
    storage.end_load_reservations("full", reservation)
    process(storage, forward)
