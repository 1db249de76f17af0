"""PD, host-tier and check rules held one by one: receive takes behind running forwards, relief
around held receive rows, load reservations named by the tree, host layouts, and the idle and
compaction-stats switches."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvchain import env
from kvchain.alloc.band import PENDING, SnapshotMode
from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from kvchain.device.modeled import clock_leq
from kvchain.errors import CapacityError, InvariantError
from kvchain.layout.host import host_layout
from kvchain.plan import Placement, page_envelope_pair, plan_kv_storage
from support.chains import hybrid_decls, small_storage
from support.modeled import launch_forward, modeled_storage, process, request

# -- PD: receive takes behind running forwards ---------------------------------------------------------


def _receive(storage, length):
    """A decode node's receive take: a row, its pages, held until publication."""
    row = storage.alloc_row()
    try:
        storage.alloc_extend(np.array([row]), np.array([length]))
    except CapacityError:
        storage.table.free_row(row)
        raise
    pages = {b.name: storage.physical_pages(b.name, storage.table.pages_of(row))
             for b in storage.allocator.token_bands}
    return row, pages, storage.hold_receive_rows(f"recv{row}", pages)


def test_receive_take_is_ordered_after_forwards_still_using_its_pages():
    """PD-10, PD-11, PD-14, PD-15: pages freed under running forwards stay pending until a take
    needs them; a receive take that does queues waits on those forwards on the schedule stream
    first, its zeroing runs behind them, and a readback of the ids on that stream (publication)
    follows every earlier use of the pages. The host never blocks."""
    storage, dev = modeled_storage(chain_kib=4)
    owner = storage.allocator.owner
    r1, _ = request(storage, 8)
    r2, _ = request(storage, 8)
    nothing = np.empty(0, dtype=np.int64)
    # each forward reads a row (its writes lie elsewhere) and the row is freed while it runs
    f1 = launch_forward(storage, None, nothing)
    freed = {f1.step: owner.ids.v2p[storage.table.pages_of(r1)].copy()}
    storage.free_rows(np.array([r1]))
    f2 = launch_forward(storage, None, nothing)
    freed[f2.step] = owner.ids.v2p[storage.table.pages_of(r2)].copy()
    storage.free_rows(np.array([r2]))
    storage.allocator.flush(owner, 0)
    events = {f1.step: f1.event, f2.step: f2.event}
    pending = np.concatenate(list(freed.values()))
    assert owner.n_pending == len(pending) and (owner.state[pending] == PENDING).all()
    blocked = dev.counters.host_waits_blocked
    first_item = len(dev.history)
    received = []
    while owner.n_pending:
        received.append(_receive(storage, 4))
    assert dev.counters.host_waits_blocked == blocked and not f1.processed and not f2.processed
    readback = dev.record(dev.schedule_stream, "read the ids back for publication")
    zeroes = [item for item in dev.history[first_item:] if item.stream == "schedule" and item.label == "zero"]
    handed = np.concatenate([pages[owner.name] for _, pages, _ in received])
    for step, pages in freed.items():
        reused = np.intersect1d(pages, handed)
        assert len(reused), "the take needed the pages pending under every running forward"
        assert clock_leq(events[step].clock, readback.clock)  # PD-10, PD-11
        writers = [z for z in zeroes for a in z.writes if a.band == owner.index and np.isin(reused, a.ids).any()]
        assert writers and all(clock_leq(events[step].clock, z.clock) for z in writers)  # PD-15
    for _, _, hold in received:
        storage.published(hold)
    process(storage, f1)
    process(storage, f2)
    storage.free_rows(np.array([row for row, _, _ in received]))
    storage.check_idle()


def _fill(storage, length):
    rows = []
    while True:
        row = storage.alloc_row()
        try:
            storage.alloc_extend(np.array([row]), np.array([length]))
        except CapacityError:
            storage.table.free_row(row)
            return rows
        rows.append(row)


def test_relief_keeps_held_receive_rows_in_place():
    """PD-9: when a layout exists that keeps a request's held receive rows where they are, relief
    uses it: the rows' physical ids, which the peer may already be writing, do not change."""
    storage, _dev = modeled_storage(chain_kib=4, windows=(16,), state=False, rows=64)
    chain = storage.allocator
    owner, window = chain.owner, chain.window_bands[0]
    rows = _fill(storage, 8)
    by_position = sorted(rows, key=lambda r: owner.ids.v2p[storage.table.pages_of(r)].min())
    held_row = by_position[len(by_position) // 2]
    before = owner.ids.v2p[storage.table.pages_of(held_row)].copy()
    hold = storage.hold_receive_rows("rx", {owner.name: before})
    storage.free_rows(np.array([r for r in rows if r != held_row]))
    storage.allocator.flush(window, 0)
    # room for the window up to the held rows, and no further: more than it has without relief
    room = owner.grid.origin + int(before.min()) * owner.page_bytes - window.top
    demand = [0, 0]
    demand[window.index] = window.n_holes + room // window.page_bytes - 1
    assert chain.units_fit(demand) and not chain.in_place(demand)
    assert chain.pricing_snapshot(SnapshotMode.HOLD_NETWORK).bands[owner.index].fixed == len(before)
    chain.decisions = []
    chain.take(demand)
    assert [d[0] for d in chain.decisions if d[0] in ("relief", "move")][:1] == ["relief"]
    assert np.array_equal(owner.ids.v2p[storage.table.pages_of(held_row)], before)
    storage.published(hold)


# -- host tier ------------------------------------------------------------------------------------------


def test_tree_naming_loaded_window_rows_ends_their_reservation():
    """HIC-6: once the tree binds a window load's rows, `name_loaded_window_rows_by_owner` names them
    by owner ids and ends that sub-pool's reservation: the rows are no longer fixed and may move."""
    storage = small_storage(windows=(8,), state=False)
    chain = storage.allocator
    window = chain.window_bands[0]
    tree = UnifiedRadixCache(storage, CheckpointStrategy.NO_BUFFER, None)
    owner_pages, owner_res = storage.alloc_load(chain.owner.name, 2)
    window_pages, window_res = storage.alloc_load(window.name, 2)
    assert window.fixed_mask[window_pages].all() and window.n_fixed == 2
    vpages = chain.virtual_free.pop(2)
    chain.owner.bind(vpages, owner_pages)
    storage.end_load_reservations(chain.owner.name, owner_res)
    tree.name_loaded_window_rows_by_owner(window.name, window_res, vpages)
    assert np.array_equal(window.ids.v2p[vpages], window_pages)
    assert window.n_fixed == 0 and not window.fixed_mask.any() and len(window.usage) == 0
    assert not np.isin(window_pages, window._immovable(SnapshotMode.TAKE)).any()
    storage.free_virtual_pages(vpages)
    storage.check_idle()


def test_host_pools_per_sub_pool_and_the_shared_end_backing():
    """HIC-10, HIC-11, HIC-12: each sub-pool's host pool is laid out like its device view; the two
    ends share one page-envelope backing only when both hold MHA pages; a float never shares."""
    plans = {
        "mha ends": plan_kv_storage(hybrid_decls(windows=(32, 8), state=False), page_size=2),
        "mla owner": plan_kv_storage(hybrid_decls(windows=(32, 8), state=False, mla=True), page_size=2),
        "state end": plan_kv_storage(hybrid_decls(windows=(32, 8), state=True), page_size=2),
    }
    for plan in plans.values():
        for pool in plan.sub_pools:
            layout = host_layout(pool, 5)
            assert layout.sub_pools == (pool.name,) and layout.envelope is pool.envelope
            assert layout.page_bytes == pool.page_bytes and layout.nbytes == 5 * pool.page_bytes
            assert layout.allocate(pin=False).shape == (5, pool.page_bytes)
    plan = plans["mha ends"]
    pair = page_envelope_pair(plan)
    assert pair == (plan.up_end, plan.down_end)
    assert [p.placement for p in pair] == [Placement.UP_END, Placement.DOWN_END]
    assert plan.floats and not set(plan.floats) & set(pair)
    assert page_envelope_pair(plans["mla owner"]) is None
    assert page_envelope_pair(plans["state end"]) is None


# -- checks ---------------------------------------------------------------------------------------------


_PHANTOM = {"full": 1}  # a holder claims a page the pool does not have: live counts disagree


def test_idle_leak_raises_by_default(monkeypatch):
    """CHK-17: `KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE` is on by default, and an idle leak
    then raises."""
    monkeypatch.delenv("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", raising=False)
    assert env.get("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE") is True
    storage = small_storage()
    with pytest.raises(InvariantError, match="idle_leak"):
        storage.check_idle(held=_PHANTOM)


def test_idle_leak_only_warns_when_strict_idle_check_is_off(monkeypatch, caplog):
    """CHK-17: with the switch off, an idle leak is logged instead of raised."""
    monkeypatch.setenv("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "0")
    storage = small_storage()
    with caplog.at_level(logging.WARNING):
        storage.check_idle(held=_PHANTOM)
    assert "idle_leak" in caplog.text


def test_compaction_stats_are_logged_per_sub_pool(monkeypatch, caplog):
    """CHK-19: `KVCHAIN_LOG_LAZY_COMPACTION_STATS=1` logs each sub-pool's compaction counters on
    every opportunistic flush; unset, it logs none."""
    storage = small_storage()
    with caplog.at_level(logging.INFO, logger="kvchain"):
        storage.flush_opportunistic()
    assert "compaction" not in caplog.text
    monkeypatch.setenv("KVCHAIN_LOG_LAZY_COMPACTION_STATS", "1")
    storage = small_storage()
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([12]))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvchain"):
        storage.flush_opportunistic()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compaction ")]
    assert sorted(line.split(":")[0] for line in lines) == sorted(f"compaction {b.name}"
                                                                 for b in storage.allocator.bands)
    assert all("'moves'" in line and "'flushes'" in line for line in lines)
