"""`kvchain bench moves`: compaction copy bandwidth through the real move path against a plain
contiguous `copy_` of the same bytes, measured in the same run on the same device.

A full-attention band of a real model's page size is filled, every other page of its lower half
is freed, and an urgent flush packs it: every move is a real page copy through the arena,
rebinding the virtual ids of the moved pages."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..build import build_kv_storage
from ..decl import MHA
from ..models.small import small_hybrid
from ..plan import plan_kv_storage
from ..sizing import size_plan


def _storage(page_size: int, heads: int, layers: int, budget: int, device: str):
    plan = plan_kv_storage(small_hybrid(MHA(heads, 64), blocks=layers), page_size=page_size)
    sizing = size_plan(plan, budget, context_len=page_size * 4, max_running_requests=4)
    return build_kv_storage(plan, sizing, device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_moves_bench(page_size: int = 64, heads: int = 8, layers: int = 18, budget: int = 2**30,
                    repeats: int = 7, device: str = "cpu", progress=None) -> dict:
    """Default geometry: gpt-oss-120b's full-attention band (18 layers, 8 KV heads x 64), 64-token
    pages of 2.25 MiB. `progress(1)` after each repeat."""
    best_move = best_copy = float("inf")
    moved_pages = 0
    page_bytes = 0
    for _ in range(repeats):
        storage = _storage(page_size, heads, layers, budget, device)
        band = storage.allocator.owner
        page_bytes = band.page_bytes
        chain = storage.allocator
        n = band.grid.n_grid - band.grid.first_id - 1
        ids = chain.take_alone(band, n)
        band.bind(chain.virtual_free.pop(n), ids)
        # free every other page of the half nearest the band's base: the flush moves the half
        # nearest the frontier into them
        by_position = np.sort(ids)
        victims = by_position[n // 2 :][::2]
        chain.free(band, victims)
        _sync(device)
        t0 = time.perf_counter()
        moved = chain.relief_flush(band)
        _sync(device)
        best_move = min(best_move, time.perf_counter() - t0)
        moved_pages = moved
        nbytes = moved * page_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src.fill_(1)
        dst.copy_(src)
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
        del storage, src, dst
        if progress is not None:
            progress(1)
    nbytes = moved_pages * page_bytes
    move_gbs = nbytes / best_move / 1e9
    copy_gbs = nbytes / best_copy / 1e9
    return {
        "device": device,
        "page_bytes": page_bytes,
        "pages_moved": moved_pages,
        "bytes_moved": nbytes,
        "moves_gb_per_s": round(move_gbs, 2),
        "copy_gb_per_s": round(copy_gbs, 2),
        "ratio": round(move_gbs / copy_gbs, 3),
    }
