"""`PageCopier`: the one place that writes page bytes for the allocator (moves, state copies,
hand-out zeroing), as work launched on the schedule stream.

Copies run through an int64 view of each band's grid (several times faster than uint8 on CPU). On
a CPU arena every run of consecutive pages is one numpy slice copy: a single pass over the bytes on
one thread, where a torch op per run would enter an OpenMP parallel region each time (on a busy
machine each region waits for every one of its threads to be scheduled: a few hundred page copies
took 50 times as long as one contiguous copy at two threads) and a gather and scatter through a
buffer would pass over the bytes twice. On an accelerator, runs of large pages are one copy each and
anything else a gather and scatter through a preallocated staging buffer, so no move allocates
memory outside the pools. A copy names the band's grid (`BandGrid`: its index and page size), never
the band: memory knows nothing of the allocator above it."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from .. import faults
from ..device.base import Device, PageAccess
from .arena import BandGrid, KVArena

#: Pages at least this large are copied one contiguous copy each, which beats a gather and a
#: scatter through the staging buffer (two passes over the bytes).
RUN_COPY_MIN_PAGE_BYTES = 64 * 1024


class PageCopier:
    def __init__(self, arena: KVArena, device: Device, scratch_bytes: int) -> None:
        self.arena = arena
        self.device = device
        self.meta = arena.is_meta
        self.words = [arena.page_words_view(g.index) for g in arena.layout.grids]
        #: numpy views of the same words on a CPU arena (the host copy path), else None
        self.host_words = ([w.numpy() for w in self.words]
                           if arena.device.type == "cpu" and not self.meta else None)
        n_words = max(scratch_bytes // 8, max(g.page_bytes // 8 for g in arena.layout.grids))
        self.staging = torch.empty(n_words, dtype=torch.int64, device=arena.device)
        self.bytes_moved = 0

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        return t if self.arena.device.type == "cpu" else t.to(self.arena.device, non_blocking=True)

    def move_pages(self, grid: BandGrid, src: np.ndarray, dst: np.ndarray, label: str = "move") -> None:
        """Copy pages `src` onto pages `dst` of one band's grid (the two sets must be disjoint)."""
        self._launch_copy(grid, src, dst, label, self._copy)

    def _launch_copy(self, grid: BandGrid, src: np.ndarray, dst: np.ndarray, label: str, copy) -> None:
        """Launch `copy(words, src, dst)` on the schedule stream, declaring what it reads and writes
        (a meta arena launches the declaration alone)."""
        if not len(src):
            return
        words = self.words[grid.index]
        if self.host_words is not None:
            words, copy = self.host_words[grid.index], _copy_runs_host
        src, dst = src.copy(), dst.copy()
        if faults.ACTIVE and label == "move" and faults.active(faults.LOSE_MOVE_COPY):
            fn = None  # the copy is declared but never lands
        else:
            self.bytes_moved += len(src) * grid.page_bytes
            fn = None if self.meta else (lambda: copy(words, src, dst))
        self.device.launch(
            self.device.schedule_stream,
            fn,
            reads=(PageAccess(grid.index, src),),
            writes=(PageAccess(grid.index, dst),),
            label=label,
        )

    def _copy_in_order(self, words: torch.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
        """Chunks through the staging buffer in order, each gathered whole before it is scattered:
        a chunk's writes land only on sources already read (its own, or earlier chunks')."""
        per_page = words.shape[1]
        rows = self.staging.numel() // per_page
        stage = self.staging[: rows * per_page].view(rows, per_page)
        for start in range(0, len(src), rows):
            s = self._index(src[start : start + rows])
            d = self._index(dst[start : start + rows])
            k = len(s)
            torch.index_select(words, 0, s, out=stage[:k])
            words.index_copy_(0, d, stage[:k])

    def _copy(self, words: torch.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
        """One pass per run of consecutive pages when runs are long or pages are large (contiguous
        copies at full bandwidth); otherwise gather into the staging buffer and scatter."""
        per_page = words.shape[1]
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        if len(starts) * 4 <= len(src) or per_page * 8 >= RUN_COPY_MIN_PAGE_BYTES:
            ends = np.concatenate((breaks, [len(src)]))
            for a, b in zip(starts.tolist(), ends.tolist()):
                s0, d0, k = int(src[a]), int(dst[a]), b - a
                words[d0 : d0 + k].copy_(words[s0 : s0 + k])
            return
        self._copy_in_order(words, src, dst)  # disjoint pages: the in-order staging pass is exact too

    def zero_pages(self, grid: BandGrid, ids: np.ndarray) -> None:
        if self.meta or not len(ids):  # a meta arena holds no bytes to zero
            return
        words = self.words[grid.index]
        ids = ids.copy()
        fn = None if self.meta else (lambda: words.index_fill_(0, self._index(ids), 0))
        self.device.launch(
            self.device.schedule_stream, fn, writes=(PageAccess(grid.index, ids),), label="zero"
        )


def _copy_runs_host(words: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Pairs in the order given, a run of pairs consecutive in both source and destination as one
    slice copy. A run copies as if page by page in order: numpy copies overlapping slices through a
    buffer, and a caller's order keeps a run from overwriting a source it reads later (a shift
    down ascends, a shift up descends, where runs are single pages)."""
    if len(src) == 1:
        s0, d0 = int(src[0]), int(dst[0])
        words[d0] = words[s0]
        return
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    bounds = np.concatenate(([0], breaks, [len(src)])).tolist()
    s_list, d_list = src.tolist(), dst.tolist()
    for a, b in itertools.pairwise(bounds):
        s0, d0, k = s_list[a], d_list[a], b - a
        words[d0 : d0 + k] = words[s0 : s0 + k]
