"""`kvchain bench moves`: compaction copy bandwidth through the real move path against a plain
contiguous `copy_` of the same bytes, measured in the same run on the same device.

A full-attention band is filled, every other page of the half nearest its base is freed, and a
relief flush packs it: every move is a real page copy through the arena, rebinding the virtual ids
of the moved pages. The sweep covers page sizes from 32 KiB to 2 MiB (16-token pages of 1 to 64
layers of 8 KV heads x 64) and torch thread counts (one, and every core); the headline is the
worst cell, since a compaction may meet any of them. Each cell runs the move and the copy in
alternation, `repeats` times, and reports medians; its ratio is the median of the per-repeat
quotients."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from ..build import build_kv_storage
from ..decl import MHA
from ..models.small import small_hybrid
from ..plan import plan_kv_storage
from ..sizing import size_plan

#: tokens per page across the sweep; layers set the page's bytes
PAGE_TOKENS = 16
HEADS, HEAD_DIM = 8, 64
#: layers per sweep cell: 32 KiB, 128 KiB, 512 KiB and 2 MiB pages
SWEEP_LAYERS = (1, 4, 16, 64)


def page_bytes_for(layers: int, heads: int = HEADS, page_tokens: int = PAGE_TOKENS) -> int:
    """K and V, bf16: tokens x layers x 2 x heads x head_dim x 2 bytes."""
    return page_tokens * layers * 2 * heads * HEAD_DIM * 2


def default_threads() -> tuple[int, ...]:
    cores = os.cpu_count() or 1
    return (1,) if cores == 1 else (1, cores)


def _storage(page_tokens: int, heads: int, layers: int, budget: int, device: str):
    plan = plan_kv_storage(small_hybrid(MHA(heads, HEAD_DIM), blocks=layers), page_size=page_tokens)
    sizing = size_plan(plan, budget, context_len=page_tokens * 4, max_running_requests=4)
    return build_kv_storage(plan, sizing, device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _one_move(page_tokens: int, heads: int, layers: int, budget: int, device: str) -> tuple[int, int, float, float]:
    """One repeat: (pages moved, page bytes, move seconds, copy_ seconds of the same bytes)."""
    storage = _storage(page_tokens, heads, layers, budget, device)
    chain = storage.allocator
    band = chain.owner
    n = band.grid.n_grid - band.grid.first_id - 1
    ids = chain.take_alone(band, n)
    band.bind(chain.virtual_free.pop(n), ids)
    # free every other page of the half nearest the band's base: the flush moves the half
    # nearest the frontier into them
    chain.free(band, np.sort(ids)[n // 2 :][::2])
    _sync(device)
    t0 = time.perf_counter()
    moved = chain.relief_flush(band)
    _sync(device)
    move_s = time.perf_counter() - t0
    nbytes = moved * band.page_bytes
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # touch the pages once, as the arena's were when it was filled
    _sync(device)
    t0 = time.perf_counter()
    dst.copy_(src)
    _sync(device)
    copy_s = time.perf_counter() - t0
    return moved, band.page_bytes, move_s, copy_s


def run_cell(layers: int, threads: int, repeats: int, budget: int, device: str,
             heads: int = HEADS, page_tokens: int = PAGE_TOKENS) -> dict:
    """One page size at one torch thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = [_one_move(page_tokens, heads, layers, budget, device) for _ in range(repeats)]
    finally:
        torch.set_num_threads(before)
    moved, page_bytes = runs[0][0], runs[0][1]
    nbytes = moved * page_bytes
    move_s = statistics.median(r[2] for r in runs)
    copy_s = statistics.median(r[3] for r in runs)
    return {
        "page_bytes": page_bytes,
        "threads": threads,
        "pages_moved": moved,
        "bytes_moved": nbytes,
        # three significant figures: a loaded machine's bandwidths can be hundredths of a GB/s
        "moves_gb_per_s": float(f"{nbytes / move_s / 1e9:.3g}"),
        "copy_gb_per_s": float(f"{nbytes / copy_s / 1e9:.3g}"),
        "ratio": round(statistics.median(r[3] / r[2] for r in runs), 3),
    }


def run_moves_bench(layers: tuple[int, ...] = SWEEP_LAYERS, threads: tuple[int, ...] | None = None,
                    budget: int = 2**29, repeats: int = 5, device: str = "cpu", progress=None) -> dict:
    """The sweep, cells in order of page size then threads; the headline is the worst ratio."""
    cells = []
    for n_layers in layers:
        for n_threads in threads or default_threads():
            cells.append(run_cell(n_layers, n_threads, repeats, budget, device))
            if progress is not None:
                progress(1)
    worst = min(cells, key=lambda c: c["ratio"])
    return {
        "headline": {"worst_ratio": worst["ratio"], "page_bytes": worst["page_bytes"], "threads": worst["threads"]},
        "device": device,
        "repeats": repeats,
        "cells": cells,
    }
