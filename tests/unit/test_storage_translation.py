"""The `Translation` contract of `KVStorage`: virtual ids become the physical ids kernels use, an
unbound page reads (and writes) the sink, nothing here changes the pool, and a physical id holds
until `move_epoch` changes."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.errors import InputError, InvariantError
from kvchain.storage_roles import Translation
from support.chains import allocator_state, same_state, small_storage
from support.contracts import compaction_always_pressed  # noqa: F401 (an autouse fixture)
from support.modeled import request


def test_the_storage_plays_the_role():
    assert isinstance(small_storage(), Translation)


def test_iteration_ids_are_physical_tokens_per_sub_pool():
    storage = small_storage(page_size=2)
    row, vtok = request(storage, 5)
    before = allocator_state(storage)
    ids = storage.iteration_ids(vtok, np.array([row]))
    assert same_state(before, allocator_state(storage))
    for pool in storage.plan.sub_pools:
        if pool.name == "state":
            continue
        physical = storage.physical_pages(pool.name, vtok // 2)
        assert ids.locs[pool.name].tolist() == (physical * 2 + vtok % 2).tolist(), pool.name
    assert ids.state_slots.tolist() == storage.physical_pages("state", storage.table.state_slot[[row]]).tolist()
    assert storage.iteration_ids(vtok).state_slots is None


def test_an_unbound_page_reads_the_sink():
    storage = small_storage(page_size=2, windows=(4,))
    row, _ = request(storage, 12)
    assert storage.advance(np.array([row])) > 0
    band = storage.allocator.bands[storage.plan.by_name("window4").index]
    retired = storage.table.window_lo[row, 0]
    table = storage.runner_ids(np.array([row])).page_tables["window4"][0]
    assert (table[:retired] == band.grid.sink_id).all() and (table[retired:] != band.grid.sink_id).all()
    assert (storage.runner_ids(np.array([row])).page_tables["full"][0] != storage.allocator.owner.grid.sink_id).all()


def test_runner_ids_give_minus_one_for_a_row_without_a_slot():
    storage = small_storage()
    row = storage.alloc_row()
    assert storage.runner_ids(np.array([row])).state_slots.tolist() == [-1]


def test_physical_ids_hold_until_the_move_epoch_changes():
    storage = small_storage(page_size=2, chain_kib=24)
    rows = [request(storage, 8)[0] for _ in range(4)]
    pages = storage.table.pages_of(rows[-1])
    physical, epoch = storage.physical_pages("full", pages), storage.move_epoch
    storage.free_rows(np.array(rows[:1]))  # a free moves nothing
    assert storage.move_epoch == epoch and np.array_equal(storage.physical_pages("full", pages), physical)
    storage.free_rows(np.array(rows[1:3]))
    assert storage.flush_opportunistic() > 0
    assert storage.move_epoch != epoch and not np.array_equal(storage.physical_pages("full", pages), physical)


def test_translating_an_unbound_id_or_an_unknown_sub_pool_raises():
    storage = small_storage()
    _, vtok = request(storage, 4)
    free_page = storage.allocator.virtual_free.view()[-1:]
    with pytest.raises(InvariantError, match=r"band\.free_of_bound_page"):
        storage.physical_pages("full", free_page)
    with pytest.raises(InputError, match="nope"):
        storage.physical_pages("nope", vtok // storage.page_size)
    with pytest.raises(InputError, match=r"no sub-pool 'nope'.*'full'"):
        storage.view("nope")
    assert storage.view("full").pool.name == "full"
