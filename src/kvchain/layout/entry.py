"""Page-major entry geometry: one page of a sub-pool holds every layer of that sub-pool.

A page envelope is `page_size` tokens (or one state slot) of every layer in the sub-pool, laid out
as components (layer, name) at fixed byte offsets. A page move therefore copies one contiguous
envelope, and a kernel reaches one layer's K of page p at `p * page_bytes + offset`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..decl import MHA, MLA, Geometry, State
from ..errors import DeclarationError, LayoutError
from ..units import dtype_size, zeros

#: Components start on this many bytes, and page envelopes are a multiple of it, so every typed
#: view is aligned and page copies can run through a wide (int64) view of the arena.
ENVELOPE_ALIGN = 16


@dataclass(frozen=True)
class Component:
    """One tensor inside a page envelope: `shape` is per page (tokens first for attention)."""

    layer_id: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class PageEnvelope:
    """The byte layout of one page of a sub-pool."""

    components: tuple[Component, ...]
    page_bytes: int
    payload_bytes: int

    def component(self, layer_id: int, name: str) -> Component:
        for c in self.components:
            if c.layer_id == layer_id and c.name == name:
                return c
        layers = sorted({c.layer_id for c in self.components})
        names = sorted({c.name for c in self.components})
        raise LayoutError(f"no component {name!r} for layer {layer_id} in this page envelope "
                          f"(layers {layers}, components {names})")


def _align(n: int, a: int = ENVELOPE_ALIGN) -> int:
    return -(-n // a) * a


def _layer_tensors(geometry: Geometry, tokens: int) -> list[tuple[str, str, tuple[int, ...]]]:
    if isinstance(geometry, MHA):
        return [
            ("k", geometry.dtype, (tokens, geometry.kv_heads, geometry.head_dim)),
            ("v", geometry.dtype, (tokens, geometry.kv_heads, geometry.v_dim)),
        ]
    if isinstance(geometry, MLA):
        latent = [("kv", geometry.dtype, (tokens, geometry.kv_lora_rank + geometry.rope_dim))]
        if geometry.index_head_dim:  # the indexer key's fp8 values and float32 scales, as bytes
            latent.append(("index_k", "uint8", (tokens, geometry.index_bytes())))
        return latent
    if isinstance(geometry, State):
        return [(t.name, t.dtype, t.shape) for t in geometry.tensors]
    raise DeclarationError(f"unknown geometry {type(geometry).__name__} {geometry!r} "
                           "(a layer part is MHA, MLA or State)")


def page_envelope(geometry: Geometry, layer_ids: Sequence[int], page_size: int) -> PageEnvelope:
    """Lay out one page: for each layer in order, its tensors, each aligned to ENVELOPE_ALIGN.

    Attention pages hold `page_size` tokens; state pages hold one slot."""
    tokens = 1 if isinstance(geometry, State) else page_size
    offset = 0
    payload = 0
    components: list[Component] = []
    for layer_id in layer_ids:
        for name, dtype, shape in _layer_tensors(geometry, tokens):
            offset = _align(offset)
            comp = Component(layer_id, name, dtype, shape, offset)
            components.append(comp)
            offset += comp.nbytes
            payload += comp.nbytes
    return PageEnvelope(tuple(components), _align(offset), payload)


@dataclass(frozen=True)
class HostLayout:
    """A host backing: `n_pages` envelopes of one size, for one sub-pool or, when the two end
    sub-pools share an envelope backing, both. Here beside `PageEnvelope`, below the host layouts
    (`layout/host.py`) and the host pools (`memory/host.py`), which both build it."""

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
        """A `[n_pages, page_bytes]` uint8 host tensor, pinned when CUDA is present."""
        if pin is None:
            pin = torch.cuda.is_available()
        return zeros((self.n_pages, self.page_bytes), torch.uint8, what="a host pool", pin_memory=bool(pin and self.n_pages))
