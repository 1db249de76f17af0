"""Host layouts: host-tier pools laid out page by page like their device views, so a host copy
moves whole page envelopes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from ..plan import SubPool
from .entry import PageEnvelope


@dataclass(frozen=True)
class HostLayout:
    """A host pool for one sub-pool (or, for a shared envelope backing, both end sub-pools)."""

    sub_pools: tuple[str, ...]
    envelope: PageEnvelope
    n_pages: int

    @property
    def page_bytes(self) -> int:
        return self.envelope.page_bytes

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.envelope.page_bytes

    def allocate(self, pin: bool | None = None) -> torch.Tensor:
        """A [n_pages, page_bytes] uint8 host tensor, pinned when CUDA is present."""
        if pin is None:
            pin = torch.cuda.is_available()
        return torch.zeros((self.n_pages, self.page_bytes), dtype=torch.uint8, pin_memory=pin)


def host_layout(pool: SubPool, n_pages: int) -> HostLayout:
    if n_pages < 0:
        raise InputError(f"host pages for sub-pool {pool.name!r} must be >= 0, got {n_pages}")
    return HostLayout((pool.name,), pool.envelope, n_pages)

