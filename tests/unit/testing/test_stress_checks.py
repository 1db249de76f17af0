"""The stress harness's checks on their own: each sees what it must and nothing else."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.signals import NetworkTransfer
from kvchain.device import ModeledDevice
from kvchain.device.base import PageAccess
from kvchain.memory.arena import ArenaLayout, BandGrid
from kvchain.testing import checks
from kvchain.testing.checks import ByteShadow, Granules, HostReadTracker, OverlapTracker
from support.modeled import launch_forward, modeled_storage, process, request

#: two bands: 32-byte pages from byte 0, 64-byte pages aligned to the top of a 1 KiB arena
LAYOUT = ArenaLayout(1024, 64, (BandGrid(0, 32, 0, 32, None, 2), BandGrid(1, 64, 0, 16, 0, 1)))


def _tracker() -> tuple[ModeledDevice, OverlapTracker]:
    return ModeledDevice(seed=0), OverlapTracker(Granules(LAYOUT, meta_rows=4))


def test_granules_cover_each_page_once():
    """HARN-8: byte ranges come from each band's grid (origin + id * page_bytes) in gcd-sized granules."""
    g = Granules(LAYOUT, meta_rows=4)
    assert g.size == 32 and g.n == 1024 // 32 + 4
    assert g.of(0, np.array([3])).tolist() == [3]
    assert g.of(1, np.array([2])).tolist() == [4, 5]  # bytes 128..191
    assert g.of(checks.META_BAND, np.array([1])).tolist() == [33]


def test_unordered_write_after_read_is_flagged_and_a_wait_orders_it():
    """HARN-8: a write on one stream over bytes another stream reads, with no happens-before between
    them, is a conflict; a stream wait (or the same stream) orders them."""
    dev, tracker = _tracker()
    fwd, sched = dev.forward_stream, dev.schedule_stream
    dev.launch(fwd, None, reads=[PageAccess(1, np.array([2]))], label="read")
    dev.launch(sched, None, writes=[PageAccess(0, np.array([4, 5]))], label="zero")  # bytes 128..191
    problems = tracker.consume(dev.history)
    assert len(problems) == 1 and "zero@schedule writes byte 128" in problems[0] and "read@forward" in problems[0]

    dev, tracker = _tracker()
    dev.launch(dev.forward_stream, None, reads=[PageAccess(1, np.array([2]))], label="read")
    dev.stream_wait(dev.schedule_stream, dev.record(dev.forward_stream, "read done"))
    dev.launch(dev.schedule_stream, None, writes=[PageAccess(0, np.array([4, 5]))], label="zero")
    dev.launch(dev.schedule_stream, None, reads=[PageAccess(0, np.array([4]))], label="same stream")
    assert tracker.consume(dev.history) == []


def test_host_wait_orders_later_work_and_disjoint_bytes_never_conflict():
    """HARN-8: the host's clock carries a host wait into everything launched after it."""
    dev, tracker = _tracker()
    dev.launch(dev.forward_stream, None, writes=[PageAccess(0, np.array([7]))], label="write")
    dev.launch(dev.stream("copy"), None, reads=[PageAccess(0, np.array([8]))], label="other bytes")
    done = dev.record(dev.forward_stream, "done")
    dev.host_wait(done)
    dev.launch(dev.stream("copy"), None, reads=[PageAccess(0, np.array([7]))], label="after host wait")
    assert tracker.consume(dev.history) == []
    dev.history.clear()
    dev.launch(dev.stream("network"), None, writes=[PageAccess(0, np.array([7]))], label="late writer")
    dev.launch(dev.forward_stream, None, writes=[PageAccess(0, np.array([7]))], label="racing writer")
    assert any("racing writer" in p and "late writer" in p for p in tracker.consume(dev.history))


def test_byte_shadow_carries_tags_through_copies():
    """HARN-11: a copy carries its source's tags; only bytes last written as state count."""
    shadow = ByteShadow(Granules(LAYOUT), state_band=0)
    shadow.landed((), [PageAccess(0, np.array([4, 5]))])  # state slots over bytes 128..191
    assert shadow.state_bytes_in(1, np.array([2, 3])).tolist() == [2]
    shadow.landed([PageAccess(1, np.array([2]))], [PageAccess(1, np.array([3]))])  # a move 2 -> 3
    assert shadow.state_bytes_in(1, np.array([3])).tolist() == [3]
    shadow.landed((), [PageAccess(1, np.array([2, 3]))], partial=True)  # forward token rows: tags stay
    assert shadow.state_bytes_in(1, np.array([2, 3])).tolist() == [2, 3]
    shadow.landed((), [PageAccess(1, np.array([2, 3]))])  # zeroing on hand-out
    assert shadow.state_bytes_in(1, np.array([2, 3])).tolist() == []


def test_host_read_after_an_unfinished_wait_is_flagged_per_step():
    """HARN-9: within a step, a host read after a stream wait on unfinished work; reads first, waits
    on finished work and a new step are fine."""
    reads = HostReadTracker()
    reads.host_read("ids")
    reads.stream_wait("schedule", "finished", unfinished=False)
    reads.host_read("free list")
    assert reads.found == []
    reads.stream_wait("schedule", "forward_done:3", unfinished=True)
    reads.host_read("free list")
    assert len(reads.found) == 1 and "forward_done:3" in reads.found[0]
    reads.begin_step()
    reads.host_read("free list")
    assert len(reads.found) == 1


def test_divergence_names_the_first_difference():
    """HARN-10."""
    assert checks.divergence([("take", "full", [1])], [("take", "full", [1])]) is None
    diff = checks.divergence([("take", "full", [1]), ("move",)], [("take", "full", [2])])
    assert diff is not None and diff.startswith("entry 0")
    assert "logged 2 entries" in checks.divergence([1, 2], [1])


def test_ledger_problems_list_what_a_quiet_pool_still_records():
    """HARN-12: a transfer never ended leaves its use (and vacated pages) in the ledger."""
    storage, dev = modeled_storage()
    row, vtok = request(storage, 8)
    rec = launch_forward(storage, np.array([row]), vtok)
    process(storage, rec)
    send = NetworkTransfer("s", sends=True, done=dev.record(dev.stream("network"), "s"))
    storage.record_network_transfer(send, {"full": storage.physical_pages("full", storage.table.pages_of(row))})
    storage.free_rows(np.array([row]))
    problems = checks.ledger_problems(storage)
    assert any("ledger keeps" in p for p in problems) and any("vacated pages" in p for p in problems)
    storage.end_network_transfer(send)
    assert checks.ledger_problems(storage) == []
