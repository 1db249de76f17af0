"""`PageCopier.move_pages`: disjoint pages copied in one launch equal page-by-page copies, through
runs of consecutive pages or the staging buffer, whatever the staging buffer's size."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support.chains import small_storage


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_move_pages_equals_page_by_page_copies(data):
    storage = small_storage(chain_kib=32)
    chain = storage.allocator
    copier = chain.copier
    band = chain.owner
    words = copier.words[band.index]
    n = words.shape[0]
    k = data.draw(st.integers(1, min(20, (n - 1) // 2)))
    pages = data.draw(st.lists(st.integers(1, n - 1), min_size=2 * k, max_size=2 * k, unique=True))
    src, dst = np.array(pages[:k]), np.array(pages[k:])
    if data.draw(st.booleans()):  # runs of consecutive pages
        src, dst = np.sort(src), np.sort(dst)
    # a staging buffer of a few pages forces many chunks
    rows = data.draw(st.integers(1, 8))
    copier.staging = torch.empty(rows * words.shape[1], dtype=torch.int64)
    words.copy_(torch.arange(words.numel(), dtype=torch.int64).view_as(words))
    expect = words.clone()
    for s, d in zip(src, dst):
        expect[d] = expect[s].clone()
    copier.move_pages(band, src, dst)
    chain.device.synchronize()
    assert torch.equal(words, expect)
