"""Paged attention over the pool, registered as the `transformers` attention function "kvchain_paged".

HF's attention modules project, normalise and rotate the packed sequence's queries and keys, then hand
them to this function. It writes the new K/V into the layer's sub-pool at the step's physical write
locations, reads every request's keys back through its page table and attends with the model's own
conventions (GQA head sharing, scaling, Gemma 2 logit softcap, sliding window, gpt-oss sinks).

The pool is the only KV the model sees, so one forward serves several requests at different lengths:
the decode requests share one batched computation (keys padded to the longest and masked), and the
prefill chunks are attended in buckets (`batch.pad_buckets`), each chunk's queries padded at its end
with copies of its last query, whose outputs are dropped. Keys are selected by position, never by multiplying with a mask, so the
bytes of pages a request does not own (a retired window row reads its sub-pool's sink page) cannot
leak into the result even when they hold NaN or inf; a request whose keys are padded to the longest
reads its own last page again there, masked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..decl import WindowLifetime
from ..errors import InputError
from .batch import ForwardBatch, pad_buckets

NAME = "kvchain_paged"
#: the `ForwardBatch` entry listing the layers a forward has attended (each once: `ModelRunner`
#: checks that every layer the pool keeps K/V for is among them)
ATTENDED = "attended"
#: set on a module whose keys and values reach the attention function already gathered from its
#: pages (`latent.py`: MLA expands its pooled latents itself)
LATENT_ATTR = "_kvchain_latent"


@dataclass(frozen=True)
class _Group:
    """Requests attended in one computation, each with `n` query tokens (a shorter chunk's last
    query repeated to `n`); built once per step for a (sub-pool, window) and shared by all its
    layers, so per-layer work is only gathers and the kernel.

    - `rows`: their query rows in the packed sequence, request-major (a slice when contiguous);
    - `real` (or None when no request is padded): the positions of the real queries among the
      group's `b * n`, and `real_rows` their rows in the packed sequence;
    - `pages` (`[b*C]`): the physical pages read for each request, flattened request-major: its
      page-table columns from the first one the window needs. A request with fewer columns than the
      group's widest pads with its own last page again: its keys there are masked by position, and a
      page the request holds is finite (hand-out zeroing, ALLOC-20, keeps the slots past its length
      zero), so a pad reads no page the request does not own and nothing is zeroed per layer. A stale
      NaN in a request's own page would reach its output, as in any paged kernel that reads whole
      pages;
    - `zero` (`[b]` or None): with `sink_col`, the flat columns of the sink column, zeroed after the
      gather;
    - `bias` (`[b, 1, n, C*page_size]`): 0 where query i may attend key slot j (causal, window,
      live), -inf elsewhere: the additive mask the kernel takes as is. With `sink_col` set, the
      last column's first slot is the sink slot (its key and value are zeroed, so its score is
      exactly the layer's sink logit, added per head) and its other slots are masked;
    - `visible` (host, `[b, n, C*page_size]`): the same as a boolean, for the explicit path."""

    rows: slice | torch.Tensor
    real: torch.Tensor | None
    real_rows: torch.Tensor | None
    b: int
    n: int
    cols: int
    pages: torch.Tensor
    zero: torch.Tensor | None
    bias: torch.Tensor
    visible: np.ndarray
    sink_col: bool


def _rows(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Contiguous rows as a slice (a view of the packed sequence), others as an index tensor."""
    lo = int(rows[0])
    if int(rows[-1]) - lo + 1 == len(rows) and (len(rows) < 3 or bool((np.diff(rows) == 1).all())):
        return slice(lo, lo + len(rows))
    return torch.from_numpy(rows).to(device)


def _group(batch: ForwardBatch, pool: str, window: int | None, reqs: np.ndarray, lens: np.ndarray,
           sinks: bool, chunk: int | None = None) -> _Group:
    """The positions and pages for requests `reqs` (with `lens` new tokens each) in sub-pool `pool`;
    `chunk`: attention within aligned chunks of that many tokens (Llama 4), instead of a window."""
    table = batch.page_tables[pool]
    device = table.device
    ps = batch.page_size
    b, n = len(reqs), int(lens.max())
    prefix = batch.prefix_lens[reqs]
    last_col = (batch.seq_lens[reqs] - 1) // ps
    # the lowest position any of the request's queries sees: its first query's window start
    if window is not None:
        first_col = np.maximum(prefix - window + 1, 0) // ps
    elif chunk is not None:
        first_col = prefix // chunk * chunk // ps
    else:
        first_col = np.zeros_like(prefix)
    n_cols = int((last_col - first_col).max()) + 1 + sinks  # a sink reads one more (zeroed) column
    span = n_cols * ps
    cols = np.minimum(first_col[:, None] + np.arange(n_cols), last_col[:, None])  # [b, C]; pads: own last page
    flat = (reqs[:, None] * table.shape[1] + cols).reshape(-1)
    # key slot j of a request sits at position first_col*ps + j; query i at prefix + min(i, its last)
    step = np.minimum(np.arange(n), lens[:, None] - 1)  # [b, n]: a pad repeats the last query
    q_pos = prefix[:, None] + step
    rel = (first_col * ps)[:, None, None] + np.arange(span) - q_pos[:, :, None]  # key - query, [b, n, L]
    visible = rel <= 0  # causal; positions past the request's length are past every query
    if window is not None:
        visible &= rel > -window  # HF: kv_idx > q_idx - window
    if chunk is not None:  # HF: kv_idx // chunk == q_idx // chunk (with kv_idx <= q_idx)
        key_pos = (first_col * ps)[:, None, None] + np.arange(span)
        visible &= key_pos >= (q_pos // chunk * chunk)[:, :, None]
    bias = np.where(visible, np.float32(0.0), np.float32(-np.inf))
    zero = None
    if sinks:
        bias[:, :, (n_cols - 1) * ps] = 0.0
        zero = torch.from_numpy(np.arange(b, dtype=np.int64) * n_cols + n_cols - 1).to(device)
    rows = (batch.q_starts[reqs][:, None] + step).reshape(-1)
    real = real_rows = None
    if (lens != n).any():
        keep = np.flatnonzero((np.arange(n) < lens[:, None]).reshape(-1))
        real, real_rows = torch.from_numpy(keep).to(device), torch.from_numpy(rows[keep]).to(device)
    pages = torch.take(table, torch.from_numpy(flat).to(device))  # the page table's [req, col] entries
    return _Group(rows=_rows(rows, device), real=real, real_rows=real_rows, b=b, n=n, cols=n_cols, pages=pages,
                  zero=zero, bias=torch.from_numpy(bias[:, None]).to(device), visible=visible, sink_col=sinks)


def attention_groups(batch: ForwardBatch, pool: str, window: int | None, sinks: bool,
                     chunk: int | None = None) -> tuple[list[_Group], bool]:
    """This step's groups for one (sub-pool, window or chunk, sinks), and whether their rows are slices that
    tile the packed sequence in order (their outputs then concatenate): computed once per forward
    and shared by every layer that reads the same sub-pool, since they see the same page tables and
    positions."""
    cache: dict[tuple, tuple[list[_Group], bool]] = batch.__dict__.setdefault("_attention_groups", {})
    key = (pool, window, sinks, chunk)
    found = cache.get(key)
    if found is None:
        new = batch.seq_lens - batch.prefix_lens
        groups = []
        decode = np.flatnonzero(new == 1)
        if len(decode):
            groups.append(_group(batch, pool, window, decode, new[decode], sinks, chunk))
        chunks = np.flatnonzero(new > 1)
        for bucket in pad_buckets(new[chunks]):
            groups.append(_group(batch, pool, window, chunks[bucket], new[chunks[bucket]], sinks, chunk))
        end = 0
        for g in groups:
            if not isinstance(g.rows, slice) or g.real is not None or g.rows.start != end:
                end = -1
                break
            end = g.rows.stop
        found = cache[key] = (groups, end == int(batch.q_starts[-1]))
    return found


def query_rows(g: _Group) -> np.ndarray:
    """The group's `[b, n]` query rows in the packed sequence (a padded query repeats its last)."""
    if isinstance(g.rows, slice):
        rows = np.arange(g.rows.start, g.rows.stop)
    else:
        rows = g.rows.cpu().numpy()
    return rows.reshape(g.b, g.n)


def slot_columns(groups: list[_Group], page_size: int) -> list[np.ndarray]:
    """Per group, `[b, C * page_size]`: where each request's key slots lie in the end-to-end layout."""
    out, start = [], 0
    for g in groups:
        span = g.cols * page_size
        out.append(start + np.arange(g.b)[:, None] * span + np.arange(span))
        start += g.b * span
    return out


def restrict(groups: list[_Group], indices: torch.Tensor, page_size: int) -> list[_Group]:
    """The groups with each query's keys narrowed to the slots the indexer picked (`indices`
    `[1, T, topk]`, positions in the end-to-end layout `PagedLatent` returned). A pick among slots the
    query may not see (a request with fewer keys than the top-k) stays masked."""
    picked = torch.zeros(indices.shape[1], sum(g.b * g.cols * page_size for g in groups), dtype=torch.bool,
                         device=indices.device)
    picked.scatter_(1, indices[0].long(), True)
    out = []
    for g, cols in zip(groups, slot_columns(groups, page_size), strict=True):
        rows = torch.from_numpy(query_rows(g)).to(picked.device)
        seen = picked[rows[:, :, None], torch.from_numpy(cols).to(picked.device)[:, None, :]]  # [b, n, span]
        out.append(dataclasses.replace(g, bias=g.bias.masked_fill(~seen[:, None], float("-inf")),
                                       visible=g.visible & seen.cpu().numpy()))
    return out


def write_index(batch: ForwardBatch, pool: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of each new token's physical id in `pool`, split once per step for all layers."""
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = batch.__dict__.setdefault("_write_index", {})
    index = cache.get(pool)
    if index is None:
        locs = batch.write_locs[pool]
        index = cache[pool] = (locs // batch.page_size, locs % batch.page_size)
    return index


def write_tokens(cache: torch.Tensor, new: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Store `new` (`[T, KVH, D]`) at the (page, offset) pairs `index`. A page holds several layers'
    components, so one layer's K is strided by page and has no flat token view: index the page grid
    by (page, offset) in one vectorised put instead."""
    cache.index_put_(index, new if new.dtype == cache.dtype else new.to(cache.dtype))


def _gather(cache: torch.Tensor, g: _Group, dtype: torch.dtype) -> torch.Tensor:
    """The group's pages of one layer's K or V as `[b, KVH, C*page_size, D]`, a sink column zeroed."""
    pages = cache.index_select(0, g.pages)  # [b*C, page_size, KVH, D], a copy
    if pages.dtype != dtype:  # an 8-bit KV is widened first: fp8 has no index_fill on every device
        pages = pages.to(dtype)
    if g.zero is not None:
        pages.index_fill_(0, g.zero, 0.0)
    return pages.view(g.b, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def _split_gathered(key: torch.Tensor, value: torch.Tensor, groups: list[_Group], page_size: int,
                    dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each group's keys and values `[b, H, C*page_size, D]` out of the `[1, H, L, D]` a latent module
    expanded from the groups' pages laid end to end."""
    out, start = [], 0
    for g in groups:
        span = len(g.pages) * page_size
        k, v = (x[0, :, start : start + span] for x in (key, value))
        out.append(tuple(x.to(dtype).view(x.shape[0], g.b, -1, x.shape[-1]).transpose(0, 1) for x in (k, v)))
        start += span
    if start != key.shape[2]:
        raise InputError(f"latent attention got {key.shape[2]} gathered keys, its groups read {start}")
    return out


def _queries(query: torch.Tensor, g: _Group, dtype: torch.dtype) -> torch.Tensor:
    """The group's queries `[b, H, n, D]` from HF's `[1, H, T, D]`."""
    q = query[0, :, g.rows] if isinstance(g.rows, slice) else query[0].index_select(1, g.rows)
    if q.dtype != dtype:
        q = q.to(dtype)
    return q.view(q.shape[0], g.b, g.n, q.shape[2]).transpose(0, 1)


def _attend(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: _Group,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one group's queries over its keys `k` and values `v` (`[b, KVH, C*page_size, D]`,
    gathered in the group's dtype): `[b, n, H, Dv]` in float32 or wider.

    Head h reads kv head h // (H // KVH), as `repeat_kv` does; the grouped heads are a broadcast axis
    rather than repeated keys. A sink is one more key whose score is the head's sink logit and whose
    value is zero: the softmax over the keys and the sink, with the sink's mass then dropped. The
    fused kernel reads it from the group's zeroed sink column; a group gathered without one (a
    latent module's, whose keys it expands itself) takes the explicit path, the sink a logit column."""
    dtype = k.dtype
    n_heads, kv_heads = query.shape[1], k.shape[1]
    groups = n_heads // kv_heads
    q = _queries(query, g, dtype)  # [b, H, n, D]
    if softcap is None and (sinks is None or g.sink_col):  # the fused kernel: scores, mask, softmax, values
        bias = g.bias
        if sinks is not None:
            page_size = k.shape[2] // g.cols
            per_head = sinks.to(dtype).view(1, n_heads, 1, 1)
            bias = bias + F.pad(per_head, ((g.cols - 1) * page_size, page_size - 1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling, enable_gqa=groups > 1)
        return out.transpose(1, 2)  # [b, n, H, Dv]
    b, n, d = g.b, g.n, q.shape[-1]
    qg = q.view(b, kv_heads, groups, n, d)  # [b, KVH, G, n, D]
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scaling  # [b, KVH, G, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    hidden = torch.from_numpy(~g.visible).to(scores.device)[:, None, None]  # the sink slot included
    if sinks is not None:
        sink = sinks.to(dtype).view(1, kv_heads, groups, 1, 1).expand(b, -1, -1, n, 1)
        scores = torch.cat([scores.masked_fill(hidden, float("-inf")), sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]  # the sink takes mass, then is dropped
    else:
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    out = torch.matmul(probs, v.unsqueeze(2))  # [b, KVH, G, n, Dv]
    return out.view(b, n_heads, n, -1).transpose(1, 2)


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
    kvchain_layer: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function: `query` `[1, H, T, D]`, `key`/`value` `[1, KVH, T, D]` for the packed
    sequence described by `kvchain_batch`; returns (`[1, T, H, Dv]` in the query's dtype, None).

    `attention_mask` is ignored (the batch's positions define the mask). `softcap` is taken as HF's
    module passes it (Gemma 2 passes its config's value; Gemma 3's modules pass none). The layer is
    the module's `layer_idx`, or `kvchain_layer` for a block run at several layers (`shared_attention.py`)."""
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

    layer = module.layer_idx if kvchain_layer is None else kvchain_layer
    attended = batch.__dict__.setdefault(ATTENDED, set())
    if layer in attended:  # its second call would write its tokens' K/V again over the first's
        raise InputError(f"layer {layer} ({type(module).__name__}) calls the attention function twice in one "
                         "forward: kvchain's pool keeps one K and V per token and layer, so it cannot serve it")
    attended.add(layer)
    pool = batch.layer_pool[layer]
    sliding_window, chunk = _reach(batch, pool, layer, sliding_window)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    dtype = torch.promote_types(query.dtype, torch.float32)
    if getattr(module, LATENT_ATTR, False):
        # MLA: `latent.PagedLatent` wrote the latents and returned the groups' pages, which the
        # module expanded into these keys and values, group after group
        if sliding_window is not None:
            raise InputError(f"layer {layer}: latent attention with a window is not served")
        groups, tiled = attention_groups(batch, pool, None, False)
        kv = _split_gathered(key, value, groups, batch.page_size, dtype)
        if kwargs.get("indices") is not None:  # a sparse-attention indexer's picks (`indexer.py`)
            groups = restrict(groups, kwargs["indices"], batch.page_size)
    else:
        view = batch.views[pool]
        k_cache, v_cache = view.k(layer), view.v(layer)
        got = ((key.shape[1], key.shape[3]), (value.shape[1], value.shape[3]))  # (heads, dims) per token
        kept = (tuple(k_cache.shape[2:]), tuple(v_cache.shape[2:]))
        if got != kept:
            raise InputError(f"layer {layer} ({type(module).__name__}) hands the attention function keys {got[0]} "
                             f"and values {got[1]} (heads, dims) per token, where the pool planned from its config "
                             f"keeps {kept[0]} and {kept[1]}: kvchain cannot serve it")
        index = write_index(batch, pool)
        write_tokens(k_cache, key[0].transpose(0, 1), index)
        write_tokens(v_cache, value[0].transpose(0, 1), index)
        groups, tiled = attention_groups(batch, pool, sliding_window, s_aux is not None, chunk)
        kv = ((_gather(k_cache, g, dtype), _gather(v_cache, g, dtype)) for g in groups)
    parts = [_attend(query, k, v, g, scaling, softcap, s_aux) for g, (k, v) in zip(groups, kv)]  # [b, n, H, Dv]
    if tiled:  # the groups' rows follow each other from the first: their outputs concatenate in order
        out = parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1, n_heads, p.shape[-1]) for p in parts])
        return out.reshape(1, n_tokens, n_heads, -1).to(query.dtype), None
    out = query.new_empty((n_tokens, n_heads, value.shape[-1]), dtype=dtype)
    for g, part in zip(groups, parts, strict=True):
        if g.real is not None:
            out.index_copy_(0, g.real_rows, part.reshape(-1, n_heads, part.shape[-1]).index_select(0, g.real))
        elif isinstance(g.rows, slice):
            out[g.rows].view(part.shape).copy_(part)
        else:
            out.index_copy_(0, g.rows, part.reshape(-1, n_heads, part.shape[-1]))
    return out.to(query.dtype).unsqueeze(0), None


def _reach(batch: ForwardBatch, pool: str, layer: int, sliding_window: int | None) -> tuple[int | None, int | None]:
    """The (window, chunk) a layer's queries see, from its sub-pool's lifetime, which is what the pool
    retires by: a layer planned chunked attends within aligned chunks (Llama 4 passes no window; the
    mask transformers would build says so, and the batch's positions are the mask here), one planned
    with a window attends over it where the module passes none, and a module whose window reaches
    past the plan's is refused rather than read over pages the pool has retired."""
    lifetime = batch.views[pool].pool.lifetime
    if not isinstance(lifetime, WindowLifetime):
        return sliding_window, None
    if lifetime.chunked:
        if sliding_window is not None:
            raise InputError(f"layer {layer}: planned as attention in chunks of {lifetime.window}, but its module "
                             f"passes a sliding window of {sliding_window}")
        return None, lifetime.window
    if sliding_window is None:
        return lifetime.window, None
    if sliding_window > lifetime.window:
        raise InputError(f"layer {layer}: its module attends over a window of {sliding_window} tokens, the pool "
                         f"keeps {lifetime.window}: plan from this checkpoint's own config")
    return sliding_window, None


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
