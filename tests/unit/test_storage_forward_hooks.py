"""The `ForwardHooks` contract of `KVStorage`: steps open, record and process in launch order, frees
pend under the newest recorded forward until it is processed, and the stream orderings queue waits
without ever blocking the host."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.errors import InvariantError
from kvchain.storage_roles import ForwardHooks
from support.contracts import assert_unchanged
from support.modeled import launch_forward, modeled_storage, process, request


def test_the_storage_plays_the_role():
    assert isinstance(modeled_storage()[0], ForwardHooks)


def test_a_free_pends_under_the_recorded_forward_until_it_is_processed():
    storage, _ = modeled_storage()
    row, vtok = request(storage, 8)
    record = launch_forward(storage, np.array([row]), vtok)
    storage.free_rows(np.array([row]))
    stats = storage.stats()
    assert stats.pending_pages["full"] == 2 and stats.live_pages["full"] == 0
    process(storage, record)
    stats = storage.stats()
    assert stats.pending_pages["full"] == 0 and stats.hole_pages["full"] + stats.span_pages["full"] >= 2
    storage.check_idle()


def test_a_recorded_forward_s_writes_are_hazards_until_it_is_processed():
    storage, _ = modeled_storage()
    row, vtok = request(storage, 8)
    record = launch_forward(storage, np.array([row]), vtok)
    for pool in storage.plan.sub_pools:
        band = storage.allocator.bands[pool.index]
        if pool.name == "state":
            written = storage.physical_pages("state", storage.table.state_slot[[row]])
        else:
            written = storage.physical_pages(pool.name, storage.table.pages_of(row))
        uses = band.usage.on(written)
        assert [(u.hazard.name, u.step, u.writes) for u in uses] == [("FORWARD", record.step, True)], pool.name
    process(storage, record)
    assert not any(b.usage.uses for b in storage.allocator.bands)


def test_unknown_writes_are_a_writer_everywhere_until_processed():
    storage, _ = modeled_storage()
    record = launch_forward(storage, writes_known=False)
    assert all(b.usage.unknown_writer.step == record.step for b in storage.allocator.bands)
    process(storage, record)
    assert all(b.usage.unknown_writer is None for b in storage.allocator.bands)


def test_a_second_launch_before_the_first_is_recorded_raises():
    storage, device = modeled_storage()
    record = storage.forward_launched()
    assert_unchanged(storage, storage.forward_launched, InvariantError, r"forward_steps\.launch_open")
    storage.record_forward(record, device.record(device.forward_stream, "done"), None)


def test_records_take_the_open_launch_and_a_fresh_event():
    storage, device = modeled_storage()
    first = storage.forward_launched()
    done = device.record(device.forward_stream, "done")
    storage.record_forward(first, done, None)
    second = storage.forward_launched()
    assert_unchanged(storage, lambda: storage.record_forward(first, device.record(device.forward_stream, "x"), None),
                     InvariantError, r"forward_steps\.record_order")
    assert_unchanged(storage, lambda: storage.record_forward(second, done, None), InvariantError,
                     r"forward_steps\.fresh_event")
    storage.record_forward(second, device.record(device.forward_stream, "done 2"), None)


def test_steps_are_processed_in_launch_order_and_only_once_recorded():
    storage, device = modeled_storage()
    first = launch_forward(storage)
    second = launch_forward(storage)
    assert_unchanged(storage, lambda: storage.forward_processed(second), InvariantError,
                     r"forward_steps\.process_order")
    process(storage, first)
    process(storage, second)
    third = storage.forward_launched()
    assert_unchanged(storage, lambda: storage.forward_processed(third), InvariantError, r"forward_steps\.unrecorded")
    storage.record_forward(third, device.record(device.forward_stream, "done"), None)
    process(storage, third)
    storage.check_idle()


def test_a_step_without_a_forward_records_nothing():
    storage, _ = modeled_storage()
    row, _ = request(storage, 4)
    record = storage.forward_launched(has_forward=False)
    storage.free_rows(np.array([row]))  # nothing was launched to record: the free is allowed, nothing pends
    assert storage.stats().pending_pages["full"] == 0
    storage.forward_processed(record)
    storage.check_idle()


@pytest.mark.parametrize("hook", ["order_forward_after_schedule", "apply_war_barrier"])
def test_stream_orderings_queue_one_wait_and_never_block_the_host(hook):
    storage, device = modeled_storage()
    record = launch_forward(storage)
    waits, host = device.counters.stream_waits, device.counters.host_waits
    getattr(storage, hook)()
    assert device.counters.stream_waits == waits + 1 and device.counters.host_waits == host
    process(storage, record)


def test_the_war_barrier_waits_the_declared_shared_read_end():
    storage, device = modeled_storage()
    record = storage.forward_launched()
    shared = device.record(device.forward_stream, "shared reads over")
    storage.record_forward(record, device.record(device.forward_stream, "done"), None, shared_read_done=shared)
    seen = []
    original = device.stream_wait

    def spy(stream, event):
        seen.append(event)
        return original(stream, event)

    device.stream_wait = spy
    storage.apply_war_barrier()
    assert seen == [shared]


def test_reset_new_rows_hands_each_row_out_once():
    storage, _ = modeled_storage()
    storage.reset_new_rows()
    rows = [storage.alloc_row(), storage.alloc_row()]
    assert sorted(storage.reset_new_rows().tolist()) == sorted(rows)
    assert storage.reset_new_rows().tolist() == []


def test_opportunistic_flush_moves_pages_not_rows():
    storage, _ = modeled_storage(chain_kib=16)
    rows = [request(storage, 8)[0] for _ in range(4)]
    table = storage.table.page_table.copy()
    storage.free_rows(np.array(rows[1:3]))
    table[rows[1:3]] = 0
    epoch = storage.move_epoch
    moved = storage.flush_opportunistic()
    assert (storage.move_epoch != epoch) == (moved > 0)
    assert np.array_equal(storage.table.page_table, table)
    storage.check_idle()


def test_request_length_bounds_are_checked_at_each_record(monkeypatch):
    monkeypatch.setenv("KVCHAIN_CHECK_KV_PAGE_INVARIANTS", "1")
    storage, device = modeled_storage()
    row, _ = request(storage, 4)
    storage.table.seq_lens[row] = storage.table.context_len + 1  # a length no row may have
    record = storage.forward_launched()
    with pytest.raises(InvariantError, match=r"requests\.length_bounds"):
        storage.record_forward(record, device.record(device.forward_stream, "done"), None)
