"""`PageCopier.shift_pages`: an overlapping, order-keeping copy reads every source before it is
overwritten, in one launch, whatever the staging buffer's size."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chains import small_storage


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_shift_pages_equals_page_by_page_copies(data):
    storage = small_storage(chain_kib=32)
    chain = storage.allocator
    copier = chain.copier
    band = chain.owner
    words = copier.words[band.index]
    n = words.shape[0]
    k = data.draw(st.integers(1, min(40, n - 2)))
    src = np.sort(np.array(data.draw(st.lists(st.integers(1, n - 1), min_size=k, max_size=k, unique=True))))
    shift = data.draw(st.integers(-(int(src[0]) - 1), 0) if data.draw(st.booleans()) else
                      st.integers(0, n - 1 - int(src[-1])))
    dst = src + shift
    # a staging buffer of a few pages forces many chunks
    rows = data.draw(st.integers(1, 8))
    copier.staging = torch.empty(rows * words.shape[1], dtype=torch.int64)
    words.copy_(torch.arange(words.numel(), dtype=torch.int64).view_as(words))
    expect = words.clone()
    order = np.arange(k) if shift <= 0 else np.arange(k)[::-1]
    for i in order:
        expect[dst[i]] = expect[src[i]].clone()
    copier.shift_pages(band, src[order], dst[order])
    chain.device.synchronize()
    assert torch.equal(words, expect)
