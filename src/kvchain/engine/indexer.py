"""A sparse-attention indexer's keys through the pool (DeepSeek-V3.2's and GLM-5's DSA).

An indexed MLA layer picks, per query, the `index_topk` earlier tokens its attention reads: a light
indexer scores every earlier token against the query with keys of its own, one 128-dim head per
token. Those keys live exactly as long as the latent, so the pool keeps them beside it, in the
layer's `index_k` component, stored as serving engines store them and as `decl.MLA` prices them:
fp8 (e4m3) values, one float32 scale per `INDEX_QUANT_BLOCK` dims (amax / 448), 132 bytes for 128
dims. transformers' indexer module (projections, norm, rotary, the scores' weighting and top-k) is
called as is; what kvchain writes is what touches the keys and the positions:

- `PagedLatent.update_indexer` quantises the step's new keys into the pool and returns, for the
  pages the step's attention groups read (the same pages, in the same order, as the latent), the
  dequantised keys laid end to end;
- `key_mask`: which of those key slots each query of the packed sequence may score (its own
  request's, causally), handed to the attention module as its mask, so the indexer's top-k never
  picks another request's token;
- the attention function, given the top-k as `indices` (positions in the same end-to-end layout),
  narrows its groups' masks to the picked slots (`attention.restrict`)."""

from __future__ import annotations

import numpy as np
import torch

from ..decl import INDEX_QUANT_BLOCK
from .attention import attention_groups, query_rows, slot_columns
from .batch import ForwardBatch

#: the largest finite float8 e4m3 value: a block's scale maps its largest magnitude onto it
FP8_MAX = 448.0
#: the least amax a scale is taken from, so a block of zeros scales by a finite number
MIN_AMAX = 1e-4


def quantize(keys: torch.Tensor) -> torch.Tensor:
    """`keys` `[T, D]` as the pool stores them: `[T, D + 4 * D / 128]` bytes, the fp8 values then the
    float32 scales of each 128-dim block."""
    t, d = keys.shape
    blocks = keys.float().reshape(t, d // INDEX_QUANT_BLOCK, INDEX_QUANT_BLOCK)
    scale = blocks.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX  # [T, blocks]
    values = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(t, d)
    return torch.cat([values.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize(raw: torch.Tensor, dim: int) -> torch.Tensor:
    """The float32 keys `[..., dim]` of stored bytes `[..., dim + 4 * dim / 128]`."""
    lead = raw.shape[:-1]
    values = raw[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = raw[..., dim:].contiguous().view(torch.float32)  # [..., blocks]
    return (values.view(*lead, -1, INDEX_QUANT_BLOCK) * scale[..., None]).view(*lead, dim)


def key_mask(batch: ForwardBatch, pool: str) -> torch.Tensor:
    """`[1, 1, T, L]` bool: whether query t of the packed sequence may see gathered key slot l (its own
    request's slot, at or before its position). Built once per step for each sub-pool and shared by
    every indexed layer that reads it, since they read the same pages."""
    cache: dict[str, torch.Tensor] = batch.__dict__.setdefault("_index_key_mask", {})
    found = cache.get(pool)
    if found is None:
        groups, _tiled = attention_groups(batch, pool, None, False)
        columns = slot_columns(groups, batch.page_size)
        n_slots = sum(int(c.size) for c in columns)
        mask = np.zeros((int(batch.q_starts[-1]), n_slots), dtype=bool)
        for g, cols in zip(groups, columns, strict=True):
            mask[query_rows(g)[:, :, None], cols[:, None, :]] = g.visible
        found = cache[pool] = torch.from_numpy(mask).to(batch.page_tables[pool].device)[None, None]
    return found
