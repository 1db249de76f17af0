"""The `PDTransfers` contract of `KVStorage`: network uses stay until their transfer is released, and
receive holds keep pages in place until published, nesting."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.band import VACATED
from kvchain.errors import InputError
from kvchain.storage_roles import PDTransfers
from support.chains import allocator_state, same_state
from support.contracts import compaction_always_pressed  # noqa: F401 (an autouse fixture)
from support.modeled import full_pages, modeled_storage, network_transfer, request


def test_the_storage_plays_the_role():
    assert isinstance(modeled_storage()[0], PDTransfers)


def test_a_send_holds_its_pages_until_released_and_a_second_end_changes_nothing():
    storage, device = modeled_storage()
    owner = storage.allocator.owner
    row, _ = request(storage, 8)
    physical = full_pages(storage, row)
    epoch = storage.allocator.epoch.value
    send = network_transfer(device)
    storage.record_network_transfer(send, {"full": physical})
    assert storage.allocator.epoch.value != epoch  # capacity answers may change
    assert [u.writes for u in owner.usage.on(physical)] == [False]
    storage.free_rows(np.array([row]))
    assert (owner.state[physical] == VACATED).all()
    storage.end_network_transfer(send)
    assert not owner.usage.uses and not (owner.state == VACATED).any()
    before = allocator_state(storage)
    storage.end_network_transfer(send)
    assert same_state(before, allocator_state(storage))
    storage.check_idle()


def test_a_receive_writes_its_pages():
    storage, device = modeled_storage()
    owner = storage.allocator.owner
    row, _ = request(storage, 4)
    physical = full_pages(storage, row)
    receive = network_transfer(device, "rx", sends=False)
    storage.record_network_transfer(receive, {"full": physical})
    assert [u.writes for u in owner.usage.on(physical)] == [True]
    storage.end_network_transfer(receive)


def test_receive_holds_nest_and_publishing_twice_changes_nothing():
    storage, _ = modeled_storage(chain_kib=16)
    owner = storage.allocator.owner
    rows = [request(storage, 8)[0] for _ in range(4)]
    vpages = storage.table.pages_of(rows[-1])  # the frontier row: the first a compaction moves
    held = storage.physical_pages("full", vpages)
    first = storage.hold_receive_rows("rx", {"full": held})
    second = storage.hold_receive_rows("rx again", {"full": held})
    storage.free_rows(np.array(rows[1:3]))
    assert owner.held[held].tolist() == [2] * len(held)
    storage.published(first)
    assert owner.held[held].tolist() == [1] * len(held)
    storage.flush_opportunistic()
    assert np.array_equal(storage.physical_pages("full", vpages), held)  # the second hold keeps them
    before = allocator_state(storage)
    storage.published(first)
    assert same_state(before, allocator_state(storage))
    storage.published(second)
    assert not owner.held.any() and owner.n_held == 0
    storage.flush_opportunistic()
    assert not np.array_equal(storage.physical_pages("full", vpages), held)


def test_unknown_sub_pools_raise_and_change_nothing():
    storage, device = modeled_storage()
    row, _ = request(storage, 4)
    physical = full_pages(storage, row)
    for call in (lambda: storage.record_network_transfer(network_transfer(device), {"nope": physical}),
                 lambda: storage.hold_receive_rows("rx", {"nope": physical})):
        before = allocator_state(storage)
        with pytest.raises(InputError, match="nope"):
            call()
        assert same_state(before, allocator_state(storage))
