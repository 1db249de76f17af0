"""Page lifecycle under the overlap scheduler, on the modeled device: pending pages, settling,
release after forward, the ForwardSteps assertions, row resets, frees and takes without host sync."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.errors import CapacityError, InvariantError
from support.modeled import launch_forward, modeled_storage, process, request


def test_free_under_a_forward_pends_and_is_released_when_processed():
    """LIFE-23, LIFE-24, LIFE-26, LIFE-27: a page freed under a recorded forward pends, counts as
    free, and returns to the holes when that forward is processed."""
    storage, _dev = modeled_storage()
    row, vtok = request(storage, 12)
    owner = storage.allocator.owner
    rec = launch_forward(storage, np.array([row]), vtok)
    storage.free_rows(np.array([row]))
    assert owner.n_pending == 3 and owner.n_holes == 0
    assert storage.allocator.pricing_snapshot().bands[owner.index].free == 3
    process(storage, rec)
    assert owner.n_pending == 0 and owner.n_holes == 3
    storage.check_idle()


def test_free_with_nothing_in_flight_is_a_hole():
    """LIFE-25, LIFE-37."""
    storage, _ = modeled_storage()
    row, _ = request(storage, 8)
    storage.free_rows(np.array([row]))
    assert storage.allocator.owner.n_pending == 0 and storage.allocator.owner.n_holes == 2


def test_pending_batches_are_keyed_by_the_newest_forward_and_settle_oldest_first():
    """LIFE-24, LIFE-29, LIFE-30, ALLOC-3: batches keyed by the newest unprocessed forward; a take
    that needs them settles whole batches oldest first with stream waits, no host wait, and the
    forwards stay unprocessed."""
    storage, dev = modeled_storage(chain_kib=4)
    owner = storage.allocator.owner
    r1, v1 = request(storage, 8)
    r2, v2 = request(storage, 8)
    f1 = launch_forward(storage, np.array([r1]), v1)
    storage.free_rows(np.array([r1]))
    f2 = launch_forward(storage, np.array([r2]), v2)
    storage.free_rows(np.array([r2]))
    assert [(b.key, b.size) for b in owner.pending] == [(f1.step, 2), (f2.step, 2)]
    storage.allocator.flush(owner, 0)  # absorb nothing: pending pages keep the frontier
    waits, host = dev.counters.stream_waits, dev.counters.host_waits
    # fill the arena until a take must settle pending pages
    rows = []
    while owner.n_pending == 4:
        rows.append(request(storage, 4)[0])
    assert dev.counters.host_waits == host, "settling must not block the host"
    assert dev.counters.stream_waits > waits
    assert [b.key for b in owner.pending] == [f2.step]  # the oldest batch settled first, whole
    assert not f1.processed and not f2.processed  # LIFE-30
    process(storage, f1)
    process(storage, f2)
    storage.free_rows(np.array(rows))
    storage.check_idle()


def test_forward_steps_assertions():
    """LIFE-31..35 (CHK-14: always on)."""
    storage, dev = modeled_storage()
    row, vtok = request(storage, 4)
    steps = storage.allocator.forward_steps
    rec = storage.forward_launched()
    with pytest.raises(InvariantError, match="between the launch"):
        storage.free_rows(np.array([row]))
    with pytest.raises(InvariantError, match="between the launch"):
        storage.alloc_extend(np.array([row]), np.array([9]))
    done = dev.record(dev.forward_stream, "done")
    storage.record_forward(rec, done, storage.iteration_ids(vtok, np.array([row])))
    rec2 = storage.forward_launched()
    with pytest.raises(InvariantError, match="fresh event"):
        storage.record_forward(rec2, done, None)  # the same event again
    storage.record_forward(rec2, dev.record(dev.forward_stream, "done2"), None)
    with pytest.raises(InvariantError, match="launch order"):
        storage.forward_processed(rec2)
    process(storage, rec)
    process(storage, rec2)
    # a step without a forward records no event and advances nothing
    prebuilt = storage.forward_launched(has_forward=False)
    storage.free_rows(np.array([row]))  # allowed: nothing was launched to record
    before = steps.processed_through
    storage.forward_processed(prebuilt)
    assert steps.processed_through == before
    storage.check_idle()


def test_check_idle_catches_pending_pages_without_a_forward():
    """LIFE-34."""
    storage, _ = modeled_storage()
    row, vtok = request(storage, 4)
    rec = launch_forward(storage, np.array([row]), vtok)
    storage.free_rows(np.array([row]))
    storage.allocator.forward_steps.in_flight.clear()  # forget the forward: its pages are orphaned
    with pytest.raises(InvariantError, match="idle_pending"):
        storage.allocator.check_idle()
    assert not rec.processed


def test_row_resets():
    """LIFE-16..18, LIFE-20: handing a row out marks it; the next forward takes the marks; a row
    restored whole from a backup is not reset."""
    storage, _ = modeled_storage()
    a, b = storage.alloc_row(), storage.alloc_row()
    storage.table.resets.unmark(b)
    assert storage.reset_new_rows().tolist() == [a]
    assert storage.reset_new_rows().tolist() == []


def test_free_and_take_never_wait_on_the_host():
    """LIFE-3, LIFE-29: frees issue no stream wait; takes that settle queue stream waits; neither
    host-waits while forwards run."""
    storage, dev = modeled_storage(chain_kib=4)
    rows = [request(storage, 8) for _ in range(3)]
    recs = [launch_forward(storage, np.array([r]), v) for r, v in rows]
    waits = dev.counters.stream_waits
    storage.free_rows(np.array([r for r, _ in rows]))
    assert dev.counters.stream_waits == waits
    blocked = dev.counters.host_waits_blocked
    more = []
    with pytest.raises(CapacityError):
        while True:
            more.append(request(storage, 4)[0])
    storage.table.free_row(max(r for r in range(storage.table.rows) if storage.table.active[r]
                               and storage.table.seq_lens[r] == 0))
    storage.allocator.flush_opportunistic(64)
    assert dev.counters.host_waits_blocked == blocked
    for rec in recs:
        process(storage, rec)
    storage.free_rows(np.array(more))
    storage.check_idle()
