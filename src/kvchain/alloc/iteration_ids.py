"""`IterationIds`: the ids a forward writes, translated once per sub-pool per iteration (IDS-8).

The scheduler hands out virtual token ids; each attention sub-pool's kernels write physical token
ids (`physical_page * page_size + offset`), and the state sub-pool's kernels physical slots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class IterationIds:
    """Physical write locations per sub-pool name (attention: token ids; state: slot ids)."""

    locs: dict[str, np.ndarray]
    state_slots: np.ndarray | None

    @classmethod
    def translate(cls, chain, virtual_tokens: np.ndarray, virtual_slots: np.ndarray | None = None) -> IterationIds:
        ps = chain.plan.page_size
        virtual_tokens = np.asarray(virtual_tokens, dtype=np.int64)
        vpages, offsets = np.divmod(virtual_tokens, ps)  # one pass for both
        every = chain.token_read_maps.take(vpages, axis=0)  # [tokens, token bands]
        every *= ps
        every += offsets[:, None]
        locs = {band.name: every[:, k] for k, band in enumerate(chain.token_bands)}
        slots = None
        if virtual_slots is not None and chain.state_band is not None:
            slots = chain.state_band.ids.read_map[np.asarray(virtual_slots, dtype=np.int64)]
        return cls(locs, slots)

    def to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        out = {name: torch.from_numpy(v).to(device, non_blocking=True) for name, v in self.locs.items()}
        if self.state_slots is not None:
            out["state"] = torch.from_numpy(self.state_slots).to(device, non_blocking=True)
        return out
