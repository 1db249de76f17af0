"""`MetadataBuffers`: the fixed device buffers a forward reads its ids from.

Engines that capture their forward (CUDA graphs) read every step's inputs from buffers allocated
once: token ids, positions, per sub-pool the page tables and write locations, the state slots. The
host fills them for each step with one upload on the schedule stream (`MetadataUpload`), and the
forward stream is ordered after it. Under an overlap scheduler the next step's upload is queued
while the previous forward may still read these very buffers: the write-after-read barrier (the
schedule stream waiting the running forward, LIFE-4/5) is what keeps that upload from overwriting
a running forward's page tables."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from ..units import zeros


@dataclass(frozen=True)
class StepMetadata:
    """One step's host-side ids, ready to upload: packed token ids and positions `[T]`, per attention
    sub-pool the page tables `[B, P]` and write locations `[T]`, the state slots and whether each
    request's state starts fresh `[B]`, and the packed rows to sample `[S]`."""

    input_ids: np.ndarray
    positions: np.ndarray
    page_tables: dict[str, np.ndarray]
    write_locs: dict[str, np.ndarray]
    state_slots: np.ndarray | None
    state_fresh: np.ndarray
    sample_at: np.ndarray


@dataclass(frozen=True)
class StepViews:
    """What a forward reads: views of the buffers, sliced to its step's sizes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    page_tables: dict[str, torch.Tensor]
    write_locs: dict[str, torch.Tensor]
    state_slots: torch.Tensor | None
    state_fresh: torch.Tensor
    sample_at: torch.Tensor


class MetadataBuffers:
    """Buffers for up to `max_tokens` tokens and `max_requests` requests of up to `max_pages` pages."""

    def __init__(self, pools: list[str], has_state: bool, *, max_tokens: int, max_requests: int, max_pages: int,
                 device: torch.device) -> None:
        def buf(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return zeros(shape, dtype, device, what="the forward's metadata buffers")

        self.max_tokens, self.max_requests, self.max_pages = max_tokens, max_requests, max_pages
        self.input_ids = buf(max_tokens)
        self.positions = buf(max_tokens)
        self.page_tables = {p: buf(max_requests, max_pages) for p in pools}
        self.write_locs = {p: buf(max_tokens) for p in pools}
        self.state_slots = buf(max_requests) if has_state else None
        self.state_fresh = buf(max_requests, dtype=torch.bool)
        self.sample_at = buf(max_requests)

    def views(self, meta: StepMetadata) -> StepViews:
        """The buffers sliced to `meta`'s sizes (no copy: the forward reads what was uploaded)."""
        t, b, s = len(meta.input_ids), len(meta.state_fresh), len(meta.sample_at)
        if t > self.max_tokens or b > self.max_requests:
            raise InputError(f"a step of {t} tokens and {b} requests exceeds the metadata buffers "
                             f"({self.max_tokens} tokens, {self.max_requests} requests)")
        p = max((v.shape[1] for v in meta.page_tables.values()), default=0)
        if p > self.max_pages:
            raise InputError(f"a step reads {p} pages per request, beyond the buffers' {self.max_pages}")
        return StepViews(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            page_tables={name: buf[:b, :p] for name, buf in self.page_tables.items()},
            write_locs={name: buf[:t] for name, buf in self.write_locs.items()},
            state_slots=None if self.state_slots is None else self.state_slots[:b],
            state_fresh=self.state_fresh[:b], sample_at=self.sample_at[:s])

    @staticmethod
    def upload(views: StepViews, meta: StepMetadata) -> None:
        """Copy `meta` into the buffers (run on the schedule stream)."""
        views.input_ids.copy_(torch.from_numpy(meta.input_ids))
        views.positions.copy_(torch.from_numpy(meta.positions))
        for name, table in meta.page_tables.items():
            views.page_tables[name].copy_(torch.from_numpy(table))
        for name, locs in meta.write_locs.items():
            views.write_locs[name].copy_(torch.from_numpy(locs))
        if views.state_slots is not None and meta.state_slots is not None:
            views.state_slots.copy_(torch.from_numpy(meta.state_slots))
        views.state_fresh.copy_(torch.from_numpy(meta.state_fresh))
        views.sample_at.copy_(torch.from_numpy(meta.sample_at))
