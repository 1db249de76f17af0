"""Typed, strided torch views over a sub-pool's page grid, indexed by physical page id.

Kernels index these with physical ids only (translation happened once per iteration before the
kernel). Each view aliases the arena's bytes: writing through a view writes the arena."""

from __future__ import annotations

import torch

from ..errors import InputError, LayoutError
from ..plan import PoolKind, SubPool
from ..units import torch_dtype


class SubPoolView:
    """Every component of one sub-pool as a tensor of shape [n_grid, *component.shape]."""

    def __init__(self, pool: SubPool, pages: torch.Tensor) -> None:
        if pages.dim() != 2 or pages.shape[1] != pool.page_bytes or pages.dtype != torch.uint8:
            raise InputError(f"sub-pool {pool.name!r} needs a [n, {pool.page_bytes}] uint8 page view, "
                             f"got {tuple(pages.shape)} {pages.dtype}")
        self.pool = pool
        self.pages = pages
        self._tensors: dict[tuple[int, str], torch.Tensor] = {}
        n = pages.shape[0]
        for comp in pool.envelope.components:
            raw = pages[:, comp.offset : comp.offset + comp.nbytes]
            self._tensors[(comp.layer_id, comp.name)] = raw.view(torch_dtype(comp.dtype)).view(n, *comp.shape)

    @property
    def n_pages(self) -> int:
        return self.pages.shape[0]

    def tensor(self, layer_id: int, name: str) -> torch.Tensor:
        """The component `name` of `layer_id` (`k`, `v`, `kv`, or a state tensor's name)."""
        try:
            return self._tensors[(layer_id, name)]
        except KeyError:
            names = sorted({n for (_l, n) in self._tensors})
            raise LayoutError(
                f"sub-pool {self.pool.name!r} has no {name!r} for layer {layer_id} "
                f"(layers {list(self.pool.layer_ids)}, components {names})"
            ) from None

    def k(self, layer_id: int) -> torch.Tensor:
        return self.tensor(layer_id, "k")

    def v(self, layer_id: int) -> torch.Tensor:
        return self.tensor(layer_id, "v")

    def kv(self, layer_id: int) -> torch.Tensor:
        """MLA: latent and rope key, concatenated per token."""
        return self.tensor(layer_id, "kv")

    def index_k(self, layer_id: int) -> torch.Tensor:
        """MLA with a sparse-attention indexer: its key per token, fp8 values then float32 scales,
        as raw bytes."""
        return self.tensor(layer_id, "index_k")

    def state(self, layer_id: int, name: str) -> torch.Tensor:
        if self.pool.kind is not PoolKind.STATE:
            raise LayoutError(f"sub-pool {self.pool.name!r} holds {self.pool.kind.value} pages, no recurrent "
                              f"state (asked for {name!r} of layer {layer_id})")
        return self.tensor(layer_id, name)
