"""`ForwardBatch`: what one batched forward reads and writes in the pool, already translated.

A step serves every scheduled request in one forward: its new tokens are packed end to end into one
sequence (`[1, T]`, request b's tokens at `q_starts[b]:q_starts[b+1]`), as ragged engines pack
prefill chunks and decodes together. The page tables and write locations are physical ids that the
host translated once for the step (`KVStorage.runner_ids`, `KVStorage.iteration_ids`, IDS-8/9); the
kernels only index the sub-pool views with them and never translate ids themselves."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError
from ..layout.views import SubPoolView
from ..plan import PoolKind

#: a bucket of prefill chunks (stepped together, each padded at its end to the bucket's longest)
#: takes the next longest chunk while its padded tokens stay within this many times its real ones:
#: few buckets (each is one batched kernel) without padding a short chunk to a long one
PAD_FACTOR = 2


def pad_buckets(lengths: np.ndarray, factor: float = PAD_FACTOR) -> list[np.ndarray]:
    """Indices into `lengths` (each > 0) in buckets, longest first, each bucket's indices in order:
    a bucket of b chunks padded to its longest L holds b * L <= factor * (its real tokens)."""
    order = np.argsort(-lengths, kind="stable")
    buckets: list[np.ndarray] = []
    lo = 0
    while lo < len(order):
        width = real = int(lengths[order[lo]])
        hi = lo + 1
        while hi < len(order) and (hi - lo + 1) * width <= factor * (real + int(lengths[order[hi]])):
            real += int(lengths[order[hi]])
            hi += 1
        buckets.append(np.sort(order[lo:hi]))
        lo = hi
    return buckets


@dataclass
class ForwardBatch:
    """One forward's inputs, on the model's device.

    - `q_starts` (host, `[B+1]`): request b's new tokens are rows `q_starts[b]:q_starts[b+1]` of the
      packed sequence; `prefix_lens[b]` tokens of it are already in the pool (its first new token
      sits at position `prefix_lens[b]`), `seq_lens[b] = prefix_lens[b] + new tokens`.
    - `page_tables[pool]` (`[B, P]`, int64): physical pages of each request's virtual pages in the
      attention sub-pool `pool`; a page the sub-pool does not bind (a retired window row) reads that
      sub-pool's sink page, whose bytes mean nothing: a window kernel masks it by position.
    - `write_locs[pool]` (`[T]`, int64): physical token id (`page * page_size + offset`) where each
      new token's K/V goes in `pool`.
    - `state_slots` (`[B]`, int64): each request's physical state slot (read, then written back);
      `state_fresh[b]`: the request's recurrent state starts from zeros (its first chunk, no
      checkpoint restored), so the slot's old bytes are not read.
    - `layer_pool`: layer id -> the sub-pool holding that layer's KV (its state, for a layer that
      keeps state only); `state_pool_of` finds the state sub-pool of a layer that keeps both."""

    q_starts: np.ndarray
    prefix_lens: np.ndarray
    seq_lens: np.ndarray
    page_size: int
    views: dict[str, SubPoolView]
    layer_pool: dict[int, str]
    page_tables: dict[str, torch.Tensor] = field(default_factory=dict)
    write_locs: dict[str, torch.Tensor] = field(default_factory=dict)
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    #: speculative rounds: requests whose recurrent layers step token by token into scratch slots
    #: (`speculative_state.StepChain`); None outside speculative decoding
    verify: object | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def new_lens(self) -> np.ndarray:
        return self.seq_lens - self.prefix_lens

    def pool_of(self, layer_id: int) -> SubPoolView:
        """The view of the sub-pool that holds `layer_id`'s KV (its state where it keeps no KV)."""
        return self.views[self.layer_pool[layer_id]]

    def state_pool_of(self, layer_id: int) -> SubPoolView:
        """The view of the state sub-pool that holds `layer_id`'s recurrent state: a layer that runs
        attention beside its mixer (Falcon-H1) is in a KV sub-pool too, which `pool_of` names."""
        view = self.pool_of(layer_id)
        if view.pool.kind is PoolKind.STATE:
            return view
        for view in self.views.values():
            if view.pool.kind is PoolKind.STATE and layer_id in view.pool.layer_ids:
                return view
        raise InputError(f"layer {layer_id} keeps recurrent state, but no state sub-pool of the plan holds it")

    def decode_only(self) -> bool:
        """Every request adds one token: one vectorised kernel serves the whole batch."""
        return bool((self.new_lens == 1).all())
