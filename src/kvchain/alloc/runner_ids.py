"""`RunnerIds`: the ids a forward reads, translated once (IDS-9): per attention sub-pool, a
physical page table for the batch's rows; for the state sub-pool, physical slots. A window page
its band never bound (or already retired) reads as the sink, so kernels never see a tombstone."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..plan import PoolKind


@dataclass(frozen=True)
class RunnerIds:
    page_tables: dict[str, np.ndarray]  # [batch, max_pages] physical page ids per sub-pool
    state_slots: np.ndarray | None

    @classmethod
    def translate(cls, chain, table, rows: np.ndarray) -> RunnerIds:
        rows = np.asarray(rows, dtype=np.int64)
        n_pages = int(((table.seq_lens[rows] + table.page_size - 1) // table.page_size).max()) if len(rows) else 0
        vpages = table.page_table[rows, :n_pages]
        tables = {}
        for band in chain.bands:
            if band.pool.kind is PoolKind.STATE:
                continue
            tables[band.name] = band.translate(vpages)
        slots = None
        if chain.state_band is not None:
            virtual = table.state_slot[rows]
            slots = np.where(virtual >= 0, chain.state_band.ids.v2p[np.maximum(virtual, 0)], -1)
        return cls(tables, slots)

    def to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        out = {name: torch.from_numpy(v).to(device, non_blocking=True) for name, v in self.page_tables.items()}
        if self.state_slots is not None:
            out["state"] = torch.from_numpy(self.state_slots).to(device, non_blocking=True)
        return out
