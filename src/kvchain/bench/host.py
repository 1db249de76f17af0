"""`kvchain bench host`: host-tier copy bandwidth of real page batches, backup and load, against a
plain contiguous `copy_` of the same bytes between the same memories, measured in the same run.

Each cell is one page size (16-token pages of 1 to 16 layers of a hybrid block: full attention, a
64-token window and a recurrent state). A prefix of `BATCH_PAGES` pages is prefilled in a row that
grows in turn with another one, so its pages alternate in the arena as decodes leave them, and is
handed to a `HiRadixCache` with a state checkpoint at its end. The backup is the tree's eviction of
it (a copy of its full pages, its window rows and its state to host pools), timed until the copy
has ended; the load is the next match of it (device pages taken, bound, copied back from the host),
timed the same way. Everything the host tier does is inside the time: eviction planning, digests,
ledger records, the copy stream's waits. Each repeat runs the four (backup, its contiguous copy,
load, its contiguous copy) in turn; a ratio is the median of the per-repeat quotients (path
bandwidth over contiguous bandwidth); the headline is the worst of them."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..build import build_kv_storage
from ..cache.hicache import HiRadixCache
from ..decl import MHA, State, StateTensor
from ..device.base import Device
from ..device.cuda import CudaDevice
from ..device.threads import ThreadDevice
from ..errors import InputError
from ..memory.host import HostPools
from ..models.small import small_hybrid
from ..plan import PoolKind, plan_kv_storage
from ..sizing import size_plan

PAGE_TOKENS = 16
HEADS, HEAD_DIM = 8, 64
WINDOW = 64
#: pages in one backed-up prefix (a 512-token prompt)
BATCH_PAGES = 32
#: layers per sweep cell: 32 KiB, 128 KiB and 512 KiB full-attention pages
SWEEP_LAYERS = (1, 4, 16)
STATE = State((StateTensor("conv", (4, 256)), StateTensor("ssm", (8, 64, 16), "float32")))


def _decls(layers: int):
    return small_hybrid(MHA(HEADS, HEAD_DIM), (WINDOW,), state=STATE, blocks=layers)


def _backend(device: str) -> tuple[Device, torch.device]:
    if device == "cpu":
        return ThreadDevice(), torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine")
        return CudaDevice(device), torch.device(device)
    raise InputError(f"--device must be cpu or cuda, not {device!r}")


class _Cell:
    """One page size: a storage, its host pools and tree, and the contiguous buffers."""

    def __init__(self, layers: int, device: str, batch_pages: int) -> None:
        self.backend, self.torch_device = _backend(device)
        plan = plan_kv_storage(_decls(layers), page_size=PAGE_TOKENS)
        self.plan = plan
        token_bytes = sum(p.page_bytes for p in plan.sub_pools if p.kind is not PoolKind.STATE)
        context = batch_pages * PAGE_TOKENS * 2
        chain = 3 * batch_pages * token_bytes + 8 * plan.state.page_bytes
        fixed = size_plan(plan, 2**34, context_len=context, max_running_requests=4).fixed.total
        sizing = size_plan(plan, fixed + chain, context_len=context, max_running_requests=4)
        self.storage = build_kv_storage(plan, sizing, self.torch_device, backend=self.backend)
        interval = batch_pages * PAGE_TOKENS
        host = HostPools(plan, 2 * (batch_pages * token_bytes + plan.state.page_bytes), pages_per_state=batch_pages)
        self.tree = HiRadixCache(self.storage, host, checkpoint_interval=interval)
        self.batch_pages = batch_pages
        self.page_bytes = plan.owner.page_bytes
        self._round = 0

    def sync(self) -> None:
        self.backend.synchronize()
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    def cache_prefix(self) -> tuple[np.ndarray, int]:
        """A prefix cached in the tree with its pages alternating with another row's; returns its
        tokens and the bytes a backup of it copies."""
        storage, n = self.storage, self.batch_pages
        self._round += 1
        tokens = (np.arange(n * PAGE_TOKENS, dtype=np.int32) + self._round * 7919) % 50000
        rows = [storage.alloc_row(), storage.alloc_row()]
        for p in range(1, n + 1):
            for row in rows:
                storage.alloc_extend(np.array([row]), np.array([p * PAGE_TOKENS]))
        table = storage.table
        slot = int(storage.alloc_state_slots(1)[0])
        result = self.tree.insert(tokens, table.page_table[rows[0], :n].copy(), table.window_lo[rows[0]], slot)
        storage.release_to_tree(rows[0], n, result.duplicates)
        storage.free_rows(np.array(rows))
        node = result.node
        nbytes = node.n_pages * self.plan.owner.page_bytes + self.plan.state.page_bytes
        for w, pool in enumerate(self.tree.windows):
            nbytes += (node.n_pages - int(node.window_lo[w])) * pool.page_bytes
        return tokens, nbytes

    def backup(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.tree.evict_all()
        self.tree.hicache.collect(wait=True)
        self.sync()
        return time.perf_counter() - t0

    def load(self, tokens: np.ndarray) -> tuple[float, int]:
        hicache = self.tree.hicache
        pages0 = hicache.stats["load_pages"]
        self.sync()
        t0 = time.perf_counter()
        match = self.tree.match_prefix(tokens)
        hicache.collect(wait=True)
        self.sync()
        seconds = time.perf_counter() - t0
        if match.length != len(tokens) or hicache.stats["load_pages"] - pages0 != self.batch_pages:
            raise InputError(f"the host tier did not load the prefix back ({match.length} of {len(tokens)} tokens)")
        node = match.node
        nbytes = node.n_pages * self.plan.owner.page_bytes + self.plan.state.page_bytes
        for w, pool in enumerate(self.tree.windows):
            nbytes += (node.n_pages - int(node.window_lo[w])) * pool.page_bytes
        return seconds, nbytes

    def reset(self) -> None:
        """Empty the tree (its nodes are on the host already: nothing is copied) and the host."""
        self.tree.evict_all()
        self.tree.hicache.collect(wait=True)
        self.tree.hicache.drop_host()

    def contiguous(self, nbytes: int, to_host: bool) -> float:
        pin = self.torch_device.type == "cuda"
        dev = torch.ones(nbytes, dtype=torch.uint8, device=self.torch_device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        (host.copy_(dev) if to_host else dev.copy_(host))  # touch both once, as the pools were
        self.sync()
        t0 = time.perf_counter()
        if to_host:
            host.copy_(dev, non_blocking=pin)
        else:
            dev.copy_(host, non_blocking=pin)
        self.sync()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.backend.close()


def run_cell(layers: int, repeats: int, device: str, batch_pages: int = BATCH_PAGES) -> dict:
    """One page size: `repeats` interleaved rounds of backup, its contiguous copy, load, its
    contiguous copy."""
    cell = _Cell(layers, device, batch_pages)
    rounds = []
    try:
        for _ in range(repeats):
            tokens, backup_bytes = cell.cache_prefix()
            backup_s = cell.backup()
            d2h_s = cell.contiguous(backup_bytes, to_host=True)
            load_s, load_bytes = cell.load(tokens)
            h2d_s = cell.contiguous(load_bytes, to_host=False)
            cell.reset()
            rounds.append((backup_bytes, backup_s, d2h_s, load_bytes, load_s, h2d_s))
    finally:
        cell.close()
    return summarize(cell.page_bytes, layers, rounds, cell.tree.hicache.host.pinned)


def summarize(page_bytes: int, layers: int, rounds: list[tuple[int, float, float, int, float, float]],
              pinned: bool) -> dict:
    """A cell's figures from its rounds (bytes, path seconds, contiguous seconds, for backup then
    load): medians of the seconds, medians of the per-round quotients."""
    backup_bytes, load_bytes = rounds[0][0], rounds[0][3]

    def gbps(nbytes: int, seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 3)

    return {
        "page_bytes": page_bytes,
        "layers": layers,
        "pinned": pinned,
        "backup_bytes": backup_bytes,
        "backup_gb_per_s": gbps(backup_bytes, statistics.median(r[1] for r in rounds)),
        "backup_copy_gb_per_s": gbps(backup_bytes, statistics.median(r[2] for r in rounds)),
        "backup_ratio": round(statistics.median(r[2] / r[1] for r in rounds), 3),
        "load_bytes": load_bytes,
        "load_gb_per_s": gbps(load_bytes, statistics.median(r[4] for r in rounds)),
        "load_copy_gb_per_s": gbps(load_bytes, statistics.median(r[5] for r in rounds)),
        "load_ratio": round(statistics.median(r[5] / r[4] for r in rounds), 3),
    }


def headline(cells: list[dict]) -> dict:
    """The worst ratio of any cell and direction."""
    worst = min((c[f"{d}_ratio"], d, c["page_bytes"]) for c in cells for d in ("backup", "load"))
    return {"worst_ratio": worst[0], "direction": worst[1], "page_bytes": worst[2]}


def run_host_bench(layers: tuple[int, ...] = SWEEP_LAYERS, repeats: int = 5, device: str = "cpu",
                   batch_pages: int = BATCH_PAGES, progress=None) -> dict:
    cells = []
    for n in layers:
        cells.append(run_cell(n, repeats, device, batch_pages))
        if progress is not None:
            progress(1)
    return {"headline": headline(cells), "device": device, "repeats": repeats, "batch_pages": batch_pages,
            "cells": cells}


def host_title(result: dict) -> str:
    head = result["headline"]
    return (f"kvchain bench host on {result['device']}: {result['batch_pages']}-page prefixes, medians of "
            f"{result['repeats']}; worst ratio {head['worst_ratio']} ({head['direction']}, "
            f"{head['page_bytes'] // 1024} KiB pages)")


def host_table(result: dict):
    """A row per page size (the title is `host_title`)."""
    from rich.table import Table

    table = Table()
    for label in ("page KiB", "backup MiB", "backup GB/s", "copy_ GB/s", "backup ratio", "load MiB", "load GB/s",
                  "copy_ GB/s", "load ratio"):
        table.add_column(label, justify="right")
    for c in result["cells"]:
        table.add_row(str(c["page_bytes"] // 1024), f"{c['backup_bytes'] / 2**20:.1f}", str(c["backup_gb_per_s"]),
                      str(c["backup_copy_gb_per_s"]), str(c["backup_ratio"]), f"{c['load_bytes'] / 2**20:.1f}",
                      str(c["load_gb_per_s"]), str(c["load_copy_gb_per_s"]), str(c["load_ratio"]))
    return table
