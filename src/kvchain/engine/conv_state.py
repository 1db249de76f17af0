"""What the recurrent mixers share: which requests of a packed batch step together, their state read
from and written to the pool by slot, and the causal depthwise conv that carries its last inputs.

A recurrent layer keeps, per request, the last `d_conv - 1` conv inputs and the SSM state. Decodes
(one new token each) are stepped together in one batched update. Prefill chunks are stepped
together too, each chunk's tokens one sequential recurrence: the chunks of a bucket are padded at
their ends to its longest, and a pad is a token that leaves the state as it is (the mixer zeroes
its step: no decay, no input), so every request's state after the bucket is its state after its
own last token. The groups, their gather rows and their slots are built once per forward and
shared by every recurrent layer. Installing kvchain's forwards on a model's mixers lives here too,
so `deltanet.py` and `mamba2.py` each hold only their own maths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .batch import ForwardBatch, pad_buckets


@dataclass(frozen=True)
class StateGroup:
    """Requests stepped together, built once per forward (`state_groups`).

    - `requests` (host, `[B]`): indices into the batch; `lengths` (host, `[B]`): each one's new
      tokens; `length`: the group's tokens per request, its longest (pads fill the others' ends);
    - `tokens` (host, `[B * length]`): the packed rows the group reads, request-major; a pad repeats
      its request's last row; `rows`: the same on the device, and `span` the same as a slice when
      they are consecutive rows (no pads), so reading and writing them is a view, not a gather;
    - `pad` (`[B, length]` bool, or None when no request is padded): which of them are pads;
    - `real` (or None when no pads): the positions in `tokens` that are real tokens, and
      `real_rows` their packed rows (where the outputs go);
    - `slots`, `fresh` (`[B]`): each request's physical state slot, and whether it starts from zeros."""

    requests: np.ndarray
    lengths: np.ndarray
    length: int
    tokens: np.ndarray
    rows: torch.Tensor
    span: slice | None
    pad: torch.Tensor | None
    real: torch.Tensor | None
    real_rows: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor
    _tails: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.requests)

    def take(self, packed: torch.Tensor) -> torch.Tensor:
        """The group's rows of `packed` (`[T, ...]`): `[B * length, ...]`, request-major."""
        return packed[self.span] if self.span is not None else packed.index_select(0, self.rows)

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Put the group's outputs `values` (`[B * length, ...]`, request-major) into their packed
        rows of `out`, pads dropped."""
        if self.span is not None:
            out[self.span] = values
            return
        if self.real is not None:
            values = values.index_select(0, self.real)
        out.index_copy_(0, self.real_rows, values)

    def tail_index(self, keep: int, channels: int) -> torch.Tensor | None:
        """Where each request's last `keep` inputs sit in `[past (keep), its padded inputs]`, as a
        `[B, channels, keep]` gather index; None when no request is padded (they are the last)."""
        if self.pad is None:
            return None
        index = self._tails.get(keep)
        if index is None:
            cols = _on(torch.from_numpy(self.lengths[:, None] + np.arange(keep, dtype=np.int64)), self.rows.device)
            index = self._tails[keep] = cols[:, None, :]
        return index.expand(-1, channels, -1)


def _slot_tensors(batch: ForwardBatch, requests: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.state_slots is None:
        raise InputError("a batch through recurrent layers needs state_slots")
    device = batch.state_slots.device
    index = _on(torch.from_numpy(np.ascontiguousarray(requests, dtype=np.int64)), device)
    slots = cast(batch.state_slots.index_select(0, index), torch.long)
    if batch.state_fresh is None:
        fresh = torch.zeros(len(requests), dtype=torch.bool, device=device)
    else:
        fresh = cast(_on(batch.state_fresh, device).index_select(0, index), torch.bool)
    return slots, fresh


def _group(batch: ForwardBatch, requests: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> StateGroup:
    device = batch.state_slots.device if batch.state_slots is not None else torch.device("cpu")
    width = int(lengths.max())
    step = np.arange(width, dtype=np.int64)
    tokens = (starts[:, None] + np.minimum(step, lengths[:, None] - 1)).reshape(-1)
    rows = _on(torch.from_numpy(tokens), device)
    lo = int(tokens[0])
    span = slice(lo, lo + len(tokens)) if bool((tokens == np.arange(lo, lo + len(tokens))).all()) else None
    pad = real = None
    real_rows = rows
    if (lengths != width).any():
        is_pad = step[None, :] >= lengths[:, None]
        pad = _on(torch.from_numpy(is_pad), device)
        keep = np.flatnonzero(~is_pad.reshape(-1))
        real = _on(torch.from_numpy(keep), device)
        real_rows = _on(torch.from_numpy(tokens[keep]), device)
    slots, fresh = _slot_tensors(batch, requests)
    return StateGroup(requests, lengths, width, tokens, rows, span, pad, real, real_rows, slots, fresh)


def state_groups(batch: ForwardBatch) -> list[StateGroup]:
    """The decodes as one group (every request with one new token), then the longer chunks in
    buckets (`batch.pad_buckets`); computed once per forward and shared by its recurrent layers."""
    found = batch.__dict__.get("_state_groups")
    if found is not None:
        return found
    new_lens = batch.new_lens.astype(np.int64)
    starts = np.asarray(batch.q_starts, dtype=np.int64)
    if len(starts) != batch.batch_size + 1 or int(starts[0]) != 0 or (np.diff(starts) != new_lens).any():
        raise InputError(f"q_starts {starts.tolist()} do not pack the new tokens {new_lens.tolist()}")
    groups: list[StateGroup] = []
    decodes = np.flatnonzero(new_lens == 1)
    if len(decodes):
        groups.append(_group(batch, decodes, starts[decodes], new_lens[decodes]))
    chunks = np.flatnonzero(new_lens > 1)
    for bucket in pad_buckets(new_lens[chunks]):
        reqs = chunks[bucket]
        groups.append(_group(batch, reqs, starts[reqs], new_lens[reqs]))
    batch.__dict__["_state_groups"] = groups
    return groups


def all_requests(batch: ForwardBatch) -> StateGroup:
    """Every request of the batch as one group (no padding: `tokens` holds each one's first row);
    for a mixer that steps the whole packed batch at once (`shortconv.py`)."""
    found = batch.__dict__.get("_state_all")
    if found is None:
        requests = np.arange(batch.batch_size, dtype=np.int64)
        starts = np.asarray(batch.q_starts[:-1], dtype=np.int64)
        slots, fresh = _slot_tensors(batch, requests)
        rows = _on(torch.from_numpy(starts), slots.device)
        found = batch.__dict__["_state_all"] = StateGroup(
            requests, np.ones(len(requests), np.int64), 1, starts, rows, None, None, None, rows, slots, fresh)
    return found


def assemble(groups: list[StateGroup], parts: list[torch.Tensor], n_tok: int) -> torch.Tensor:
    """The packed outputs `[T, ...]` from each group's `[B * length, ...]` part: the part itself when
    one group reads every row in order, else the parts scattered into their rows."""
    if len(groups) == 1 and groups[0].span == slice(0, n_tok):
        return parts[0]
    out = parts[0].new_empty((n_tok, *parts[0].shape[1:]))
    for group, part in zip(groups, parts, strict=True):
        group.scatter(out, part)
    return out


def read_state(store: torch.Tensor, group: StateGroup, dtype: torch.dtype) -> torch.Tensor:
    """The group's state from `store` (`[n_slots, ...]`) as `dtype`, zeros for a fresh request: its
    slot's old bytes are never used (a select, so even NaN garbage does not leak through)."""
    state = store.index_select(0, group.slots)
    state = cast(state, dtype)
    return torch.where(group.fresh.view(-1, *([1] * (state.dim() - 1))), 0.0, state)


def write_state(store: torch.Tensor, group: StateGroup, state: torch.Tensor) -> None:
    """Write the group's final state back into its slots of `store` (the pool's bytes)."""
    store.index_copy_(0, group.slots, cast(state, store.dtype))


def causal_conv(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: StateGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over `x` (`[B, C, L]`) continuing from `past` (`[B, C, K-1]`, the last
    K-1 inputs before it), with `weight` `[C, K]`. Returns the pre-activation output `[B, C, L]` and
    the new last K-1 inputs (which reach into `past` when L < K-1); with a padded `group`, each
    request's last K-1 inputs before its pads."""
    kernel = weight.shape[-1]
    keep = kernel - 1
    if past.shape[-1] != keep:
        raise InputError(f"conv state keeps {past.shape[-1]} inputs, the kernel of width {kernel} needs {keep}")
    full = torch.cat([cast(past, weight.dtype), cast(x, weight.dtype)], dim=-1)
    out = _depthwise(full, weight, bias)
    tails = None if group is None else group.tail_index(keep, full.shape[1])
    if tails is None:
        return out, full[..., full.shape[-1] - keep:]
    return out, full.gather(2, tails)


def group_conv(module: torch.nn.Module, pool: torch.Tensor, group: StateGroup, x: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixer's depthwise causal conv (`module.conv1d`, then `module.activation`) over one state
    group's tokens of the packed `x` `[T, C]`, from each request's conv state in `pool`: the output
    `[B, L, C]` in `dtype`, and the conv state it leaves (for `write_state`)."""
    seq = group.take(x).view(group.size, group.length, -1).transpose(1, 2)  # [B, C, L]
    past = read_state(pool, group, dtype)
    out, state = causal_conv(seq, past, module.conv1d.weight.squeeze(1), module.conv1d.bias, group)
    return cast(activation(module.activation)(out), dtype).transpose(1, 2), state


def _depthwise(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.conv1d(full, weight[:, None], bias, groups=C)` (no padding) as K shifted multiply-adds:
    the kernel is a few taps wide, and a grouped conv1d call costs more than the taps themselves."""
    kernel = weight.shape[-1]
    length = full.shape[-1] - kernel + 1
    if length == 1:  # a decode: one dot product per channel
        out = (full * weight).sum(-1, keepdim=True)
    else:
        out = full[..., :length] * weight[:, :1]
        for k in range(1, kernel):
            out = out + full[..., k:k + length] * weight[:, k:k + 1]
    return out if bias is None else out + bias[:, None]


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as `dtype`, without a dispatch when it already is (the hot path is many small ops)."""
    return x if x.dtype == dtype else x.to(dtype)


def _on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x if x.device == device else x.to(device)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The conv's activation by its config name."""
    if name in ("silu", "swish"):
        return F.silu
    raise InputError(f"recurrent conv activation {name!r} is not supported (silu only)")


def conv_store(batch: ForwardBatch, layer_id: int) -> torch.Tensor:
    return batch.state_pool_of(layer_id).state(layer_id, "conv")


def ssm_store(batch: ForwardBatch, layer_id: int) -> torch.Tensor:
    return batch.state_pool_of(layer_id).state(layer_id, "ssm")


def packed_input(hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`[1, T, H]` -> `[T, H]`, checking that T is the batch's packed token count."""
    total = int(batch.q_starts[-1])
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != total:
        raise InputError(f"a packed batch of {total} tokens needs hidden states [1, {total}, H], "
                         f"got {tuple(hidden_states.shape)}")
    return hidden_states[0]


def transformers_classes(module: str, name: str) -> tuple[type, ...]:
    """The transformers class `module.name` as a one-class tuple, or none when this transformers
    lacks it (a mixer kvchain serves only where transformers has it)."""
    import importlib

    try:
        return (getattr(importlib.import_module(module), name),)
    except (ImportError, AttributeError):
        return ()
