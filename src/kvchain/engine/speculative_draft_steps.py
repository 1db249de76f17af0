"""The draft's steps inside a speculative forward: what each one reads, writes and samples.

Draft step 0 runs over the whole step (prefill chunks as the target runs them, a round's last
accepted token), then step `i` over the rounds with at least `i` proposals, one token each, and one
more over the last proposal, so the draft's KV and state cover every token verify may accept. Each
step's batch gathers its ids from the uploaded metadata buffers, so it is built on the forward
stream (a callable), never on the host ahead of the upload."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..storage import KVStorage
from .batch import ForwardBatch
from .speculative_round import host_tensor
from .speculative_state import ForwardStateSlots, StepChain

#: one draft step: (batch maker, packed rows it reads, sample rows, which rounds it samples)
DraftStep = tuple[Callable[[], ForwardBatch], torch.Tensor, torch.Tensor, torch.Tensor]


def draft_steps(storage: KVStorage, layer_pool, views, q_starts: np.ndarray, starts: np.ndarray,
                counts: np.ndarray, ks: np.ndarray, spec_idx: np.ndarray, slots: ForwardStateSlots | None,
                device: torch.device) -> list[DraftStep]:
    """The draft's steps: step 0 over every request (a round's last accepted token only), then
    step i over the rounds with at least i proposals."""
    n = len(counts)
    is_spec = ks > 0
    counts0 = np.where(is_spec, 1, counts)
    q0 = np.zeros(n + 1, np.int64)
    np.cumsum(counts0, out=q0[1:])
    rows0 = np.concatenate([np.arange(q_starts[b], q_starts[b] + counts0[b]) for b in range(n)])
    rows0_t = host_tensor(rows0, device)
    r = len(spec_idx)
    chain0 = None
    if slots is not None:
        chain0 = StepChain(spec_idx, slots.own, slots.chain[:, :1], np.ones(r, np.int64))
    pool_views, ps = storage.views, storage.page_size

    def batch0() -> ForwardBatch:  # gathers from the uploaded buffers: run on the forward stream
        return ForwardBatch(
            q_starts=q0, prefix_lens=starts, seq_lens=starts + counts0, page_size=ps, views=pool_views,
            layer_pool=layer_pool, page_tables=views.page_tables,
            write_locs={k: v[rows0_t] for k, v in views.write_locs.items()},
            state_slots=views.state_slots, state_fresh=views.state_fresh, verify=chain0)

    every = host_tensor(np.arange(r), device)
    out: list[DraftStep] = [(batch0, rows0_t, host_tensor(q0[spec_idx], device), every)]
    kmax = int(ks.max()) if r else 0
    for i in range(1, kmax + 1):
        live = np.flatnonzero(ks[spec_idx] >= i)
        reqs = spec_idx[live]
        rows_i = host_tensor(q_starts[reqs] + i, device)
        reqs_t = host_tensor(reqs, device)
        live_t = host_tensor(live, device)
        step_slots, chain_i = None, None
        if slots is not None:
            step_slots = slots.chain[live_t, i]
            chain_i = StepChain(np.arange(len(live)), slots.chain[live_t, i - 1], slots.chain[live_t, i:i + 1],
                                np.ones(len(live), np.int64))
        make = _step_batch(storage, layer_pool, views, starts[reqs] + i, reqs_t, rows_i, step_slots, chain_i)
        out.append((make, rows_i, host_tensor(np.arange(len(live)), device), live_t))
    return out


def _step_batch(storage: KVStorage, layer_pool, views, prefix: np.ndarray, reqs_t: torch.Tensor,
                rows_t: torch.Tensor, slots: torch.Tensor | None, chain: StepChain | None
                ) -> Callable[[], ForwardBatch]:
    """A draft step after the first: one token for each of `reqs_t`, at packed rows `rows_t`; the
    batch is built on the forward stream, since it gathers from the uploaded buffers."""
    pool_views, ps = storage.views, storage.page_size
    n = len(prefix)

    def make() -> ForwardBatch:
        return ForwardBatch(
            q_starts=np.arange(n + 1, dtype=np.int64), prefix_lens=prefix, seq_lens=prefix + 1,
            page_size=ps, views=pool_views, layer_pool=layer_pool,
            page_tables={k: v[reqs_t] for k, v in views.page_tables.items()},
            write_locs={k: v[rows_t] for k, v in views.write_locs.items()},
            state_slots=slots, state_fresh=None, verify=chain)

    return make
