"""The pricing snapshot is memoised per capacity epoch; every capacity field rebind moves it."""

from __future__ import annotations

import numpy as np

from support.chains import small_storage


def test_snapshot_reused_until_the_epoch_moves():
    """CAP-6."""
    storage = small_storage()
    chain = storage.allocator
    a = chain.pricing_snapshot()
    assert chain.pricing_snapshot() is a
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([9]))
    b = chain.pricing_snapshot()
    assert b is not a and b.epoch > a.epoch
    assert b.bands[chain.owner.index].live == chain.owner.n_live


def test_every_capacity_field_rebind_moves_the_epoch():
    """CAP-7."""
    storage = small_storage()
    band = storage.allocator.owner
    for name in ("lo", "hi", "parked", "n_live", "n_holes", "n_pending", "n_fixed"):
        before = band.epoch.value
        setattr(band, name, getattr(band, name))
        assert band.epoch.value == before + 1, name


def test_snapshot_records_counts_and_frontiers_never_hole_positions():
    """CAP-4: a snapshot is the same for two layouts that differ only in where the holes are."""
    from kvchain.alloc.pricing import BandSnap

    assert "holes" in BandSnap._fields and not any("position" in f or "ids" in f for f in BandSnap._fields)
    s1, s2 = small_storage(), small_storage()
    for storage, victim in ((s1, 0), (s2, 1)):
        rows = [storage.alloc_row() for _ in range(3)]
        storage.alloc_extend(np.array(rows), np.array([8, 8, 8]))
        storage.free_rows(np.array([rows[victim]]))
    snap = lambda s: [b._replace() for b in s.allocator.snapshot().bands]  # noqa: E731
    assert snap(s1) == snap(s2)
    assert not np.array_equal(s1.allocator.owner.holes.view(), s2.allocator.owner.holes.view())
