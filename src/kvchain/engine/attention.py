"""Paged attention over the pool, registered as the `transformers` attention function "kvchain_paged".

HF's attention modules project, normalise and rotate the packed sequence's queries and keys, then hand
them to this function. It writes the new K/V into the layer's sub-pool at the step's physical write
locations, reads every request's keys back through its page table and attends with the model's own
conventions (GQA head sharing, scaling, Gemma 2 logit softcap, sliding window, gpt-oss sinks).

The pool is the only KV the model sees, so one forward serves several requests at different lengths:
the decode requests share one batched computation (keys padded to the longest and masked), and each
prefill chunk gets its own. Keys are selected by position, never by multiplying with a mask, so the
bytes of pages a request does not own (a retired window row reads its sub-pool's sink page, and a
padded page-table column any page) cannot leak into the result even when they hold NaN or inf."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .batch import ForwardBatch

NAME = "kvchain_paged"


@dataclass(frozen=True)
class _Group:
    """Requests attended in one computation, each with `n` query tokens.

    - `rows` (`[b*n]`): their query rows in the packed sequence, request-major;
    - `pages` (`[b, C]`): the physical pages read for each request (its page-table columns from the
      first one the window needs; columns past its last page read page 0 and are masked);
    - `key_ok` (`[b, C*page_size]`): the key slot holds one of the request's live tokens;
    - `page_ok` (`[b, C*page_size]`): the key slot lies in one of the request's own pages. Slots of
      its own pages past its length are read as the pool left them: hand-out zeroing (ALLOC-20)
      keeps them zero, so a stale NaN there would reach the output, as in any paged kernel that
      reads whole pages; columns past its last page (padding) are zeroed here;
    - `visible` (`[b, n, C*page_size]`): query i may attend key slot j (causal, window, live)."""

    rows: torch.Tensor
    n: int
    pages: torch.Tensor
    key_ok: torch.Tensor
    page_ok: torch.Tensor
    visible: torch.Tensor
    padded: bool = True


def _group(batch: ForwardBatch, pool: str, window: int | None, reqs: np.ndarray, n: int) -> _Group:
    """The positions and pages for requests `reqs` (each with `n` new tokens) in sub-pool `pool`."""
    table = batch.page_tables[pool]
    device = table.device
    ps = batch.page_size
    prefix = batch.prefix_lens[reqs].astype(np.int64)
    seq = batch.seq_lens[reqs].astype(np.int64)
    starts = batch.q_starts[reqs].astype(np.int64)
    # the lowest position any of the request's queries sees: its first query's window start
    lo = np.maximum(prefix - window + 1, 0) if window is not None else np.zeros_like(prefix)
    first_col = lo // ps
    last_col = (seq - 1) // ps
    n_cols = int((last_col - first_col).max()) + 1
    cols = first_col[:, None] + np.arange(n_cols)[None, :]  # [b, C]
    col_ok = cols <= last_col[:, None]
    key_pos = (cols[:, :, None] * ps + np.arange(ps)[None, None, :]).reshape(len(reqs), -1)  # [b, L]
    key_ok = (key_pos >= lo[:, None]) & (key_pos < seq[:, None])
    q_pos = prefix[:, None] + np.arange(n)[None, :]  # [b, n]
    visible = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        visible &= q_pos[:, :, None] - key_pos[:, None, :] < window  # HF: kv_idx > q_idx - window
    rows = (starts[:, None] + np.arange(n)[None, :]).reshape(-1)

    cols_t = torch.from_numpy(np.minimum(cols, table.shape[1] - 1)).to(device)
    req_t = torch.from_numpy(reqs.astype(np.int64)).to(device)
    pages = torch.where(torch.from_numpy(col_ok).to(device), table[req_t[:, None], cols_t], 0)
    return _Group(
        rows=torch.from_numpy(rows).to(device),
        n=n,
        pages=pages,
        key_ok=torch.from_numpy(key_ok).to(device),
        page_ok=torch.from_numpy(np.repeat(col_ok, ps, axis=1)).to(device),
        padded=not bool(col_ok.all()),
        visible=torch.from_numpy(visible).to(device),
    )


def _groups(batch: ForwardBatch, pool: str, window: int | None) -> list[_Group]:
    """This step's groups for one (sub-pool, window): computed once per forward and shared by every
    layer that reads the same sub-pool, since they see the same page tables and positions."""
    cache: dict[tuple[str, int | None], list[_Group]] = batch.__dict__.setdefault("_attention_groups", {})
    key = (pool, window)
    if key not in cache:
        new = batch.new_lens
        groups = []
        decode = np.flatnonzero(new == 1)
        if len(decode):
            groups.append(_group(batch, pool, window, decode, 1))
        for b in np.flatnonzero(new > 1):
            groups.append(_group(batch, pool, window, np.array([b]), int(new[b])))
        cache[key] = groups
    return cache[key]


def _write(cache: torch.Tensor, new: torch.Tensor, locs: torch.Tensor, page_size: int) -> None:
    """Store `new` (`[T, KVH, D]`) at physical token ids `locs`. A page holds several layers'
    components, so one layer's K is strided by page and has no flat token view: index the page grid
    by (page, offset) in one vectorised put instead."""
    cache.index_put_((locs // page_size, locs % page_size), new.to(cache.dtype))


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: _Group,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one group's queries over its pages: `[b*n, H, Dv]` in `q`'s dtype (float32 or wider).

    Head h reads kv head h // (H // KVH), as `repeat_kv` does; the grouped heads are a broadcast axis
    rather than repeated keys."""
    b, n = g.pages.shape[0], g.n
    n_heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    groups = n_heads // kv_heads
    dtype = q.dtype
    k = k_cache[g.pages].flatten(1, 2).to(dtype)  # [b, L, KVH, D]
    v = v_cache[g.pages].flatten(1, 2).to(dtype)
    if g.padded:
        dead = ~g.page_ok[:, :, None, None]
        k = k.masked_fill(dead, 0.0)
        v = v.masked_fill(dead, 0.0)
    if softcap is None and sinks is None:  # the fused kernel: one call for scores, mask, softmax, values
        out = F.scaled_dot_product_attention(
            q[g.rows].view(b, n, n_heads, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=g.visible[:, None], scale=scaling, enable_gqa=groups > 1)  # [b, H, n, Dv]
        return out.transpose(1, 2).reshape(b * n, n_heads, out.shape[-1])
    k = k.permute(0, 2, 1, 3).unsqueeze(2)  # [b, KVH, 1, L, D]
    v = v.permute(0, 2, 1, 3).unsqueeze(2)
    qg = q[g.rows].view(b, n, kv_heads, groups, d).permute(0, 2, 3, 1, 4)  # [b, KVH, G, n, D]

    scores = torch.matmul(qg, k.transpose(-1, -2)) * scaling  # [b, KVH, G, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~g.visible[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).view(1, kv_heads, groups, 1, 1).expand(b, -1, -1, n, 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]  # the sink takes mass, then is dropped
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [b, KVH, G, n, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(b * n, n_heads, out.shape[-1])


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    kvchain_batch: ForwardBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function: `query` `[1, H, T, D]`, `key`/`value` `[1, KVH, T, D]` for the packed
    sequence described by `kvchain_batch`; returns (`[1, T, H, Dv]` in the query's dtype, None).

    `attention_mask` is ignored (the batch's positions define the mask). `softcap` is taken as HF's
    module passes it (Gemma 2 passes its config's value; Gemma 3's modules pass none)."""
    batch = kvchain_batch
    if batch is None:
        raise InputError(f"attention {NAME!r} needs kvchain_batch=ForwardBatch in the model call")
    if dropout and module.training:
        raise InputError(f"attention {NAME!r} serves inference only (dropout {dropout} in training mode)")
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise InputError(f"attention {NAME!r} takes one packed sequence, got batch {query.shape[0]}")
    n_tokens = query.shape[2]
    if n_tokens != int(batch.q_starts[-1]):
        raise InputError(f"the packed sequence has {n_tokens} tokens, the batch describes {batch.q_starts[-1]}")
    n_heads, kv_heads = query.shape[1], key.shape[1]
    if n_heads % kv_heads:
        raise InputError(f"{n_heads} query heads do not share {kv_heads} kv heads evenly")

    layer = module.layer_idx
    pool = batch.layer_pool[layer]
    view = batch.views[pool]
    k_cache, v_cache = view.k(layer), view.v(layer)
    locs = batch.write_locs[pool]
    _write(k_cache, key[0].transpose(0, 1), locs, batch.page_size)
    _write(v_cache, value[0].transpose(0, 1), locs, batch.page_size)

    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = query[0].transpose(0, 1).to(dtype)  # [T, H, D]
    out = query.new_empty((n_tokens, n_heads, value.shape[-1]), dtype=dtype)
    for g in _groups(batch, pool, sliding_window):
        out.index_copy_(0, g.rows, _attend(q, k_cache, v_cache, g, scaling, softcap, s_aux))
    return out.to(query.dtype).unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The mask HF would build: none, since the batch's positions define it."""
    return None


def register() -> None:
    """Register "kvchain_paged" with `transformers` (attention function and mask); safe to repeat."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if AttentionInterface._global_mapping.get(NAME) is not paged_attention:
        AttentionInterface.register(NAME, paged_attention)
    if AttentionMaskInterface._global_mapping.get(NAME) is not _no_mask:
        AttentionMaskInterface.register(NAME, _no_mask)
