"""Recurrent state under speculative decoding: each verified token's state in a slot of its own, and
the commit of the accepted prefix's state after verify (LIFE-11, LIFE-12).

A speculative round feeds a request `n` tokens (the last accepted one and the draft's proposals)
whose recurrent state must advance only through the tokens the target accepts, which are known only
after the forward has run. So the round's recurrent layers step its tokens one at a time, each from
the state the one before it left, into a chain of scratch slots (`chain[r, i]` holds the state after
token `i`) and never into the request's own slot; the post-verify commit then copies
`chain[r, accepted[r]]` into the own slot. Stepping one token at a time is the decode kernel itself,
so the committed state is the state plain decoding of the same tokens leaves.

Both ends of that are resolved once, while the forward's metadata is prepared: `ForwardStateSlots`
holds the physical own and chain slots, and every later reader (the commit, which runs after the
forward's shared-read end) takes them from it. By then the write-after-read barrier has released the
schedule stream, and the request row may already name another request (LIFE-10)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..layout.views import SubPoolView
from ..plan import KVStoragePlan
from .batch import ForwardBatch


@dataclass(frozen=True)
class ForwardStateSlots:
    """A speculative forward's state slots, resolved at metadata time (LIFE-11).

    `own[r]`: the physical slot holding request r's committed state; `chain[r, i]`: the physical
    scratch slot its state after round token i goes to (`[R, K+1]`; columns past a request's
    tokens repeat its last chain slot and are never written). Host-built tensors owned by the
    forward, not the shared metadata buffers, which the next step's upload may overwrite once the
    shared reads ended."""

    own: torch.Tensor
    chain: torch.Tensor

    def __len__(self) -> int:
        return int(self.own.shape[0])


@dataclass(frozen=True)
class StepChain:
    """What one forward's recurrent layers step token by token: batch indices `requests`, each with
    `lengths[r]` new tokens; token 0 starts from slot `source[r]`, token i from `chain[r, i-1]`, and
    token i's state is left in `chain[r, i]`."""

    requests: np.ndarray
    source: torch.Tensor
    chain: torch.Tensor
    lengths: np.ndarray


def state_stores(views: dict[str, SubPoolView], plan: KVStoragePlan) -> list[torch.Tensor]:
    """Every recurrent tensor of the plan's state band, target and draft layers alike, each
    `[slots, ...]`: what a commit copies from a chain slot into the own slot."""
    pool = plan.state
    if pool is None:
        return []
    view = views[pool.name]
    names = [t.name for t in pool.geometry.tensors]
    return [view.state(layer, name) for layer in pool.layer_ids for name in names]


def _layer_stores(batch: ForwardBatch, layer: int) -> list[torch.Tensor]:
    view = batch.state_pool_of(layer)
    return [view.state(layer, t.name) for t in view.pool.geometry.tensors]


def _sub_batch(batch: ForwardBatch, reqs: np.ndarray, counts: np.ndarray, prefix: np.ndarray,
               slots: torch.Tensor | None, fresh: torch.Tensor | None) -> ForwardBatch:
    q_starts = np.zeros(len(reqs) + 1, np.int64)
    np.cumsum(counts, out=q_starts[1:])
    return ForwardBatch(q_starts=q_starts, prefix_lens=prefix, seq_lens=prefix + counts, page_size=batch.page_size,
                        views=batch.views, layer_pool=batch.layer_pool, state_slots=slots, state_fresh=fresh)


def _index(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long, device=like.device)


def stepped_mixer_forward(forward: Callable[..., torch.Tensor], module: torch.nn.Module,
                          hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`forward` (a recurrent mixer's kvchain forward) over a batch with a `StepChain`: the other
    requests as one call, then the chained requests one token at a time, each step a decode from
    the slot the step before it wrote (`StepChain`), so no request's own slot is written."""
    chain: StepChain = batch.verify
    layer = module.layer_idx
    stores = _layer_stores(batch, layer)
    x = hidden_states
    out: torch.Tensor | None = None

    def put(rows: np.ndarray, y: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = y.new_empty((1, x.shape[1], y.shape[-1]))
        out[0, _index(rows, y)] = y[0]

    chained = set(int(b) for b in chain.requests)
    others = np.array([b for b in range(batch.batch_size) if b not in chained], dtype=np.int64)
    if len(others):
        counts = batch.new_lens[others]
        rows = np.concatenate([np.arange(batch.q_starts[b], batch.q_starts[b + 1]) for b in others])
        idx = _index(others, batch.state_slots)
        fresh = None if batch.state_fresh is None else batch.state_fresh[idx]
        sub = _sub_batch(batch, others, counts, batch.prefix_lens[others], batch.state_slots[idx], fresh)
        put(rows, forward(module, x[:, _index(rows, x)], sub))
    for i in range(int(chain.lengths.max()) if len(chain.lengths) else 0):
        live = np.flatnonzero(chain.lengths > i)
        live_t = _index(live, chain.chain)
        reqs = chain.requests[live]
        src = chain.source[live_t] if i == 0 else chain.chain[live_t, i - 1]
        dst = chain.chain[live_t, i]
        for store in stores:  # this layer's state only: other layers keep what they hold in `dst`
            store[dst] = store[src]
        rows = np.asarray(batch.q_starts, np.int64)[reqs] + i
        ones = np.ones(len(reqs), np.int64)
        fresh = torch.zeros(len(reqs), dtype=torch.bool, device=dst.device)
        sub = _sub_batch(batch, reqs, ones, batch.prefix_lens[reqs] + i, dst, fresh)
        put(rows, forward(module, x[:, _index(rows, x)], sub))
    assert out is not None
    return out


def commit_states_after_verify(stores: list[torch.Tensor], slots: ForwardStateSlots,
                               accepted: torch.Tensor) -> None:
    """The post-verify state commit (LIFE-12): request r's own slot takes the state after its
    accepted prefix, `chain[r, accepted[r]]`, in every recurrent tensor (target and draft layers).
    `slots` are the ones resolved at metadata time; nothing here looks up a request row."""
    if not len(slots):
        return
    pick = torch.arange(len(slots), device=slots.chain.device)
    src = slots.chain[pick, accepted.to(slots.chain.device).long()]
    for store in stores:
        store[slots.own] = store[src]
