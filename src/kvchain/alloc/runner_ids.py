"""`RunnerIds`: the ids a forward reads, translated once (IDS-9).

Per attention sub-pool, a physical page table `[batch, pages]` over each row's virtual pages: a
page the sub-pool does not bind (a retired window row, the null page) reads as that sub-pool's
sink, never a tombstone. For the state sub-pool, each row's physical slot (-1 for none).
The token bands' tables come from one gather, as strided views of one array."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RunnerIds:
    page_tables: dict[str, np.ndarray]
    state_slots: np.ndarray | None

    @classmethod
    def translate(cls, chain, table, rows: np.ndarray) -> RunnerIds:
        rows = np.asarray(rows, dtype=np.int64)
        ps = table.page_size
        n_pages = (int(table.seq_lens.take(rows).max()) + ps - 1) // ps if len(rows) else 0
        # rows of the leading columns, taken whole: a row-wise take copies each row's slice in one
        # run, where `page_table[rows, :n]` indexes element by element (about 3x slower)
        vpages = table.page_table[:, :n_pages].take(rows, axis=0)
        every = chain.token_read_maps.take(vpages, axis=0)  # [batch, pages, token bands]
        tables = {band.name: every[..., k] for k, band in enumerate(chain.token_bands)}
        slots = None
        if chain.state_band is not None:
            slots = chain.state_band.ids.read_map[table.state_slot[rows]]  # no slot (-1) reads -1
        return cls(tables, slots)

    def to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        out = {name: torch.from_numpy(v).to(device, non_blocking=True) for name, v in self.page_tables.items()}
        if self.state_slots is not None:
            out["state"] = torch.from_numpy(self.state_slots).to(device, non_blocking=True)
        return out
