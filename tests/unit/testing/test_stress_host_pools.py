"""The stress harness's host tier on real host pools: backups copy into host pages and their bytes
are checked once they end; loads copy a finished backup's host pages back, and the payload checks
read them on the device."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.testing import harness, harness_hostpool
from kvchain.testing.harness import Rank, seed_case
from support.tree import patched


def _run(seed: int, n_ops: int, device: str = "modeled") -> Rank:
    case = seed_case(seed, n_ops)
    rank = Rank(case.config, 0, device=device)
    try:
        for op in [*case.ops, harness.FINAL]:
            rank.step(op)
            assert rank.take_findings() == [], op
    finally:
        rank.close()
    return rank


@pytest.mark.parametrize(("device", "seeds"), [("modeled", range(8)), ("threads", (4, 6))])
def test_backups_and_loads_move_real_bytes_through_the_host_pools(device, seeds):
    totals = {"backups": 0, "checked_pages": 0, "loads_from_backups": 0, "loads_staged": 0}
    for seed in seeds:
        rank = _run(seed, 300, device)
        if rank._host is not None:
            for k, v in rank.host_stats.items():
                totals[k] += v
            assert rank._host.nbytes > 0
    assert totals["backups"] and totals["checked_pages"] and totals["loads_from_backups"], totals


def test_a_host_copy_of_the_wrong_pages_is_found():
    """The check can fail: a backup that copies each page's neighbour reaches the host with bytes
    its pages never held, and the harness reports a lost write."""
    def shifted(original):
        def copy(dst, dst_ids, src, src_ids):
            return original(dst, dst_ids, src, (np.asarray(src_ids) + 1) % src.shape[0])
        return copy

    found = []
    with patched(harness_hostpool, "copy_pages", shifted):
        for seed in (3, 4):
            case = seed_case(seed, 300)
            rank = Rank(case.config, 0)
            for op in [*case.ops, harness.FINAL]:
                rank.step(op)
                found += [f for f in rank.take_findings() if "host copy" in f.message]
            rank.close()
    assert found and all(f.check == "lost_write" for f in found)
