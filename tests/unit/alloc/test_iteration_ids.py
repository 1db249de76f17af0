"""`IterationIds.translate` on a small chain: each token band's physical token ids, and the rows'
physical state slots, from one gather over the bands' read maps."""

from __future__ import annotations

import numpy as np
import torch

from kvchain.alloc.iteration_ids import IterationIds
from support.chains import small_storage


def test_translated_writes_are_each_bands_page_times_page_size_plus_offset():
    storage = small_storage(page_size=2, chain_kib=16)
    chain = storage.allocator
    rows = np.array([storage.alloc_row() for _ in range(2)])
    vtok = storage.alloc_extend(rows, np.array([5, 3]))
    slots = storage.table.state_slot[rows]
    ids = IterationIds.translate(chain, vtok, slots)
    ps = storage.page_size
    for band in chain.token_bands:
        want = band.ids.read_map[vtok // ps] * ps + vtok % ps
        assert np.array_equal(ids.locs[band.name], want), band.name
        assert (band.ids.v2p[vtok // ps] >= 0).all()  # fresh tokens are bound in every token band
    assert np.array_equal(ids.state_slots, chain.state_band.ids.v2p[slots])
    tensors = ids.to("cpu")
    assert torch.equal(tensors["state"], torch.from_numpy(ids.state_slots))
    assert all(torch.equal(tensors[b.name], torch.from_numpy(ids.locs[b.name])) for b in chain.token_bands)
