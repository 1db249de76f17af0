"""Multi-head latent attention (MLA) through the pool: one compressed latent and one rope key per
token and layer, whatever the head count.

transformers' MLA modules (DeepSeek-V2/V3, Kimi K2, Kimi Linear, GLM-4.7-Flash, LongCat-Flash,
MiniCPM3, ...) normalise and rotate the new tokens' latent and rope key, hand both to
`cache.update(latent, rope_key, layer_idx)`, expand what it returns through their own `kv_b_proj`
into per-head keys and values, and call the attention function. kvchain gives each such module a
`PagedLatent` as that cache (a forward pre-hook swaps it in): its `update` writes the step's new
latents into the layer's sub-pool (component `kv`, latent then rope key) at the step's write
locations and returns, instead of the whole sequence a contiguous cache returns, the latents of the
pages each attention group reads (`attention.attention_groups`), laid end to end. The module
expands them with its own weights, and `attention.paged_attention`, seeing a latent module, attends over those
gathered keys group by group instead of writing and reading a K/V cache.

A sparse-attention indexer's keys (DeepSeek-V3.2, GLM-5) go through the same cache's
`update_indexer`, into the layer's `index_k` component beside the latent (`indexer.py`).

The pool holds the latent only (what `decl.MLA` prices); the per-head keys exist for one layer of
one step. Expanding every gathered page is the plain form of MLA, the one transformers computes; an
engine's absorbed decode kernel (queries multiplied into `kv_b_proj` instead) reads the same pool
layout."""

from __future__ import annotations

import torch

from ..decl import INDEX_QUANT_BLOCK
from ..errors import InputError
from .attention import LATENT_ATTR, attention_groups, write_index, write_tokens
from .batch import ForwardBatch
from .indexer import dequantize, key_mask, quantize


def latent_module(module: torch.nn.Module) -> bool:
    """A transformers MLA attention: it expands a cached latent through `kv_b_proj` (`expand_kv`)."""
    return callable(getattr(module, "expand_kv", None)) and hasattr(module, "kv_b_proj")


class PagedLatent:
    """The cache one MLA layer sees for one forward: writes the new latents into the pool, returns
    the gathered latents of the pages the step's attention groups read."""

    def __init__(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def update(self, latent: torch.Tensor, rope_key: torch.Tensor, layer_idx: int,
               kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`latent` `[1, 1, T, rank]` and `rope_key` `[1, 1, T, rope]` of the packed sequence's new
        tokens; returns both for every gathered key slot, `[1, 1, L, rank]` and `[1, 1, L, rope]`."""
        batch = self.batch
        if latent.shape[0] != 1 or latent.shape[2] != int(batch.q_starts[-1]):
            raise InputError(f"layer {layer_idx}: a latent of shape {tuple(latent.shape)} for a packed sequence "
                             f"of {int(batch.q_starts[-1])} tokens")
        pool = batch.layer_pool[layer_idx]
        cache = batch.views[pool].kv(layer_idx)  # [pages, page_size, rank + rope]
        rank = latent.shape[-1]
        if cache.shape[-1] != rank + rope_key.shape[-1]:
            raise InputError(f"layer {layer_idx}: the pool keeps {cache.shape[-1]} latent dims per token, the "
                             f"model's latent and rope key have {rank} + {rope_key.shape[-1]}: plan from this "
                             "checkpoint's own config")
        write_tokens(cache, torch.cat([latent[0, 0], rope_key[0, 0]], dim=-1), write_index(batch, pool))
        gathered = cache.index_select(0, self._pages(pool)).reshape(1, 1, -1, cache.shape[-1])
        if gathered.dtype != latent.dtype:
            gathered = gathered.to(latent.dtype)
        return gathered[..., :rank], gathered[..., rank:]

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A sparse-attention indexer's new keys `[1, T, D]`: stored quantised beside the latents
        (`indexer.quantize`); returns the keys of the same gathered slots as `update`, `[1, L, D]`."""
        batch = self.batch
        pool = batch.layer_pool[layer_idx]
        cache = batch.views[pool].index_k(layer_idx)  # [pages, page_size, bytes]
        dim = keys.shape[-1]
        if cache.shape[-1] != dim + 4 * (dim // INDEX_QUANT_BLOCK) or dim % INDEX_QUANT_BLOCK:
            raise InputError(f"layer {layer_idx}: the pool keeps {cache.shape[-1]} indexer key bytes per token, "
                             f"the model's indexer key has {dim} dims: plan from this checkpoint's own config")
        write_tokens(cache, quantize(keys[0]), write_index(batch, pool))
        return dequantize(cache.index_select(0, self._pages(pool)), dim).reshape(1, -1, dim).to(keys.dtype)

    def _pages(self, pool: str) -> torch.Tensor:
        """The pages the step's attention groups of `pool` read, laid end to end: the latents and the
        indexer keys are gathered alike, so the indexer's picks index the attention's key slots."""
        groups, _tiled = attention_groups(self.batch, pool, None, False)
        return groups[0].pages if len(groups) == 1 else torch.cat([g.pages for g in groups])


def install_latent_caches(model: torch.nn.Module) -> int:
    """Hand every MLA attention module of `model` a `PagedLatent` for the step in its call's
    `kvchain_batch`, and mark it for the attention function. Returns how many; installing twice
    keeps one hook per module."""
    found = [module for module in model.modules() if latent_module(module)]
    for module in found:
        if not getattr(module, LATENT_ATTR, False):
            module.register_forward_pre_hook(_swap_cache, with_kwargs=True)
            setattr(module, LATENT_ATTR, True)
    return len(found)


def _swap_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    batch = kwargs.get("kvchain_batch")
    if not isinstance(batch, ForwardBatch):
        raise InputError(f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) keeps its latent "
                         "in kvchain's pool and needs kvchain_batch=<ForwardBatch> in the forward's kwargs")
    kwargs.pop("past_key_values", None)
    kwargs["cache"] = PagedLatent(batch)
    if hasattr(module, "indexer"):  # the indexer scores the gathered keys its query may see
        kwargs["attention_mask"] = key_mask(batch, batch.layer_pool[module.layer_idx])
    return args, kwargs
