"""The `HostTier` contract of `KVStorage`: a load's pages are fixed until its reservation ends, and a
host-tier copy stays in the ledger until it ends, ordering the next writer on a stream, never the
host."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.stage_capacity import shared_counts
from kvchain.errors import CapacityError, InputError
from kvchain.storage_roles import HostTier
from support.contracts import assert_unchanged
from support.modeled import modeled_storage, request


def test_the_storage_plays_the_role():
    assert isinstance(modeled_storage()[0], HostTier)


def test_a_load_is_fixed_until_its_reservation_ends():
    storage, _ = modeled_storage(chain_kib=16)
    owner = storage.allocator.owner
    rows = [request(storage, 8)[0] for _ in range(2)]
    pages, reservation = storage.alloc_load("full", 3)
    assert len(pages) == 3 and owner.fixed_mask[pages].all()
    storage.free_rows(np.array(rows))
    storage.flush_opportunistic()
    assert owner.fixed_mask[pages].all()  # nothing moved them
    storage.end_load_reservations("full", reservation)
    assert not owner.fixed_mask.any() and owner.n_fixed == 0


def test_a_loads_pages_count_once_in_pricing_and_in_the_stages_shared_counts():
    """A load's pages are live pages held in place: every snapshot counts each once (as fixed), so
    the rest of the band is still offered. Counted twice (live and fixed), half a band reserved for a
    load refused the take of the other half, and pipeline stages, whose simulated snapshots read the
    shared counts, refused the next sub-pool's take inside a load-back's own take scope."""
    storage, _ = modeled_storage(chain_kib=16)
    chain, owner = storage.allocator, storage.allocator.owner
    half = owner.grid.n_grid // 2
    _pages, reservation = storage.alloc_load("full", half)
    snap = owner.snapshot()
    assert (snap.live, snap.fixed) == (0, half) and owner.n_live == half
    assert shared_counts(chain).held[owner.index] == half
    rest = [0] * len(chain.bands)
    rest[owner.index] = owner.grid.n_grid - half - owner.grid.first_id
    assert chain.units_fit(rest) and chain.ensure_capacity(rest)
    storage.end_load_reservations("full", reservation)


def test_a_page_two_reservations_cover_stays_fixed_until_both_end():
    storage, _ = modeled_storage(chain_kib=16)
    owner = storage.allocator.owner
    pages, first = storage.alloc_load("full", 2)
    second = owner.fix(pages[:1], "second reservation")  # a reservation over a page already fixed
    storage.end_load_reservations("full", first)
    assert owner.fixed_mask[pages].tolist() == [True, False]
    storage.end_load_reservations("full", second)
    assert not owner.fixed_mask.any()


def test_a_load_the_arena_cannot_serve_raises_and_changes_nothing():
    storage, _ = modeled_storage(chain_kib=16)
    most = storage.allocator.owner.grid.n_grid
    assert_unchanged(storage, lambda: storage.alloc_load("full", most + 1), CapacityError, f"{most + 1}")
    assert_unchanged(storage, lambda: storage.alloc_load("full", -1), InputError, "load of -1 pages")
    assert_unchanged(storage, lambda: storage.alloc_load("nope", 1), InputError, "nope")


def test_a_recorded_copy_orders_the_next_writer_on_a_stream_until_it_ends():
    storage, device = modeled_storage(chain_kib=16)
    owner = storage.allocator.owner
    row, _ = request(storage, 8)
    physical = storage.physical_pages("full", storage.table.pages_of(row))
    done = device.record(device.stream("copy"), "backup done")
    transfer = storage.record_host_transfer("backup", False, {"full": physical}, done)
    assert [u.transfer for u in owner.usage.on(physical)] == [transfer]
    host = device.counters.host_waits
    storage.free_rows(np.array([row]))
    storage.allocator.decisions = []
    request(storage, 8)  # takes the backed pages again: the zeroing waits the copy on a stream
    waits = [d for d in storage.allocator.decisions if d[0] == "stream_wait"]
    assert any(d[3] == "backup done" for d in waits)
    assert device.counters.host_waits == host
    storage.end_host_transfer(transfer)
    assert not owner.usage.uses


def test_a_load_copy_writes_its_pages_and_a_backup_reads_them():
    storage, device = modeled_storage()
    owner = storage.allocator.owner
    pages, reservation = storage.alloc_load("full", 2)
    load = storage.record_host_transfer("load", True, {"full": pages}, device.record(device.stream("copy"), "l"))
    row, _ = request(storage, 8)
    backed = storage.physical_pages("full", storage.table.pages_of(row))
    backup = storage.record_host_transfer("backup", False, {"full": backed}, device.record(device.stream("copy"), "b"))
    assert [(u.writes, u.hazard.name) for u in owner.usage.on(pages)] == [(False, "FIXED"), (True, "COPY_WRITE")]
    assert [(u.writes, u.hazard.name) for u in owner.usage.on(backed)] == [(False, "COPY_READ")]
    assert_unchanged(storage, lambda: storage.record_host_transfer("x", False, {"nope": backed}, None), InputError, "nope")
    for t in (load, backup):
        storage.end_host_transfer(t)
    storage.end_load_reservations("full", reservation)
    assert not owner.usage.uses
