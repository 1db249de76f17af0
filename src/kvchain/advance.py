"""`retire_window_rows`: as requests advance, free the window rows that fell out of each window.

The free is logical like any other (WIN-1): pages pend under a forward in flight. A row never
retires past its retention floor (the window behind its latest state checkpoint, WIN-11), nor the
page that holds its last token."""

from __future__ import annotations

import numpy as np

from .alloc.chain import ChainAllocator
from .alloc.npfast import count_true
from .requests import RequestTable, expand_runs


def window_keep_from(seq_lens: np.ndarray, window: int, chunked: bool) -> np.ndarray:
    """First token position the next forward may read in the window: the last `window` tokens
    (the next token makes `window + 1`), or for chunked attention the start of the current chunk."""
    if chunked:
        return (seq_lens // window) * window
    return np.maximum(seq_lens - window, 0)


def window_first_page(seq_lens: np.ndarray, window: int, chunked: bool, page_size: int) -> np.ndarray:
    """The first page a row of each length keeps in a window once `retire_window_rows` ran with no
    checkpoint: the page of `window_keep_from`, never past the page of its last token."""
    lo = window_keep_from(seq_lens, window, chunked) // page_size
    return np.minimum(lo, (seq_lens - 1) // page_size) if chunked else lo


def retire_window_rows(table: RequestTable, chain: ChainAllocator, page_size: int, rows: np.ndarray,
                       checkpoints: np.ndarray | None = None) -> int:
    """Free, in every window band, the pages of `rows` wholly before the window. With prefix
    sharing, `checkpoints` (token positions per row) keep each window behind the row's latest
    checkpoint (WIN-11). Pages of a tree-shared prefix are the tree's: the row stops reading them but
    never frees them. Returns pages freed."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows) or not chain.window_bands:
        return 0
    ps = page_size
    seq = table.seq_lens[rows]
    last_page = None
    # with no tree-shared prefix in the table, a row's first bound page is its window's
    shared = table.shared_pages[rows] if count_true(table.shared_pages) else None
    freed = 0
    for k, band in enumerate(chain.window_bands):
        keep = window_keep_from(seq, band.pool.window, band.pool.lifetime.chunked)
        if checkpoints is not None:
            keep = np.minimum(keep, np.maximum(checkpoints - band.pool.window, 0))
        new_lo = keep // ps
        if band.pool.lifetime.chunked:
            # a chunk starts at the length itself when the length is whole chunks: keep the page of
            # the last token (a sliding window always keeps it: it starts before the last token)
            if last_page is None:
                last_page = (seq - 1) // ps  # -1 for an empty row: it retires nothing
            np.minimum(new_lo, last_page, out=new_lo)
        window_lo = table.window_lo[:, k]  # a column view: a 1-D gather is 3x faster than a 2-D one
        lo = window_lo[rows]
        old_lo = lo if shared is None else np.maximum(lo, shared)
        counts = new_lo - old_lo
        if not count_true(counts > 0):  # the common step: nothing left a window
            if shared is not None:  # the window starts past a shared prefix it never bound
                window_lo[rows] = np.maximum(lo, new_lo)
            continue
        np.maximum(counts, 0, out=counts)
        n = int(counts.sum())
        vpages = table.page_table[expand_runs(rows, old_lo, counts)]
        chain.free_virtual(band, vpages)
        freed += n
        window_lo[rows] = np.maximum(old_lo, new_lo)
    return freed
