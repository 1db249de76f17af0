"""`BandState` alone: what reading a band shows (pricing's snapshot, the frontier scan
compaction plans with) and how its counts move the capacity epoch."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.band import Band
from kvchain.alloc.band_state import LIVE
from kvchain.alloc.pricing import CapacityEpoch, take_layout
from kvchain.memory.arena import arena_layout
from kvchain.plan import Placement, plan_kv_storage
from support.chains import hybrid_decls


def _alone():
    plan = plan_kv_storage(hybrid_decls(), page_size=2)
    layout = arena_layout(plan, 64 * 1024)
    pool = next(p for p in plan.sub_pools if p.placement is Placement.DOWN_END)
    grid = layout.grids[pool.index]
    return Band(pool, grid, CapacityEpoch(), grid.n_grid + 1), layout


def _take(band, layout, n: int) -> np.ndarray:
    after = take_layout(band.snapshot(), n, layout.chain_lo, layout.arena_bytes)
    ids, _grown, _waits = band.hand_out(n, after)
    band.bind(np.arange(1, n + 1) + band.n_live - n, ids)
    return ids


def test_the_snapshot_counts_pages_and_records_no_hole_position():
    """CAP-4: pricing's view of a band is counts and frontiers: two bands with holes in different
    places but the same counts and span snapshot the same."""
    a, layout = _alone()
    b, _ = _alone()
    ids_a, ids_b = _take(a, layout, 6), _take(b, layout, 6)
    a.free(ids_a[1:3], None)
    b.free(ids_b[3:5], None)
    assert a.snapshot() == b.snapshot()


def test_the_frontier_scan_reads_inward_from_the_frontier_and_stops_where_told():
    """The scan compaction plans with: matches nearest the frontier first, as many as wanted, and
    none past the first page `stop` names."""
    band, layout = _alone()
    ids = np.sort(_take(band, layout, 6))  # a down end: its frontier is its lowest id
    band.free(ids[1:2], None)
    live = band.frontier_scan(3, lambda st, _ids: st == LIVE)
    assert live.tolist() == [ids[0], ids[2], ids[3]]
    stopped = band.frontier_scan(6, lambda st, _ids: st == LIVE, stop=lambda _st, i: i == ids[3])
    assert stopped.tolist() == [ids[0], ids[2]]
