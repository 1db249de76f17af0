"""`PageCopier.move_pages` on a CPU arena (one numpy slice copy per run of consecutive pages): every
destination page ends up holding its source's bytes and no other page changes, for any disjoint
pattern of runs, at small pages and at pages past the size where runs copy whole."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chains import small_storage


@settings(max_examples=30, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([2, 64]))
def test_move_pages_lands_every_source_on_its_destination(data, page_size):
    storage = small_storage(page_size=page_size, chain_kib=32 if page_size == 2 else 512)
    chain = storage.allocator
    copier = chain.copier
    band = chain.owner
    words = copier.words[band.index]
    n = words.shape[0]
    assert copier.host_words is not None
    k = data.draw(st.integers(1, min(24, (n - 1) // 2)))
    picked = data.draw(st.permutations(list(range(1, n))))[: 2 * k]
    src = np.array(picked[:k], dtype=np.int64)
    dst = np.array(picked[k:], dtype=np.int64)
    if data.draw(st.booleans()):  # runs consecutive in both, as a flush of a packed tail makes
        base_s, base_d = 1, 1 + k + data.draw(st.integers(0, n - 1 - 2 * k))
        src, dst = np.arange(base_s, base_s + k), np.arange(base_d, base_d + k)
    words.copy_(torch.arange(words.numel(), dtype=torch.int64).view_as(words))
    expect = words.clone()
    expect[torch.from_numpy(dst)] = expect[torch.from_numpy(src)].clone()
    copier.move_pages(band.grid, src, dst)
    chain.device.synchronize()
    assert torch.equal(words, expect)
