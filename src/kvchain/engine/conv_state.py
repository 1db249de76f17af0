"""What the recurrent mixers share: which requests of a packed batch step together, their state read
from and written to the pool by slot, and the causal depthwise conv that carries its last inputs.

A recurrent layer keeps, per request, the last `d_conv - 1` conv inputs and the SSM state. Decodes
(one new token each) are stepped together in one batched update; a prefill chunk runs alone, since
its tokens form one sequential recurrence. Installing kvchain's forwards on a model's mixers lives
here too, so `deltanet.py` and `mamba2.py` each hold only their own maths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .batch import ForwardBatch


@dataclass(frozen=True)
class StateGroup:
    """Requests stepped together: `requests` (indices into the batch) and `tokens`, their rows of the
    packed sequence, request-major (`[len(requests) * length]`); every request adds `length` tokens."""

    requests: np.ndarray
    tokens: np.ndarray
    length: int


def state_groups(batch: ForwardBatch) -> list[StateGroup]:
    """The decodes as one group (every request with one new token), then each longer chunk alone."""
    new_lens = batch.new_lens
    starts = np.asarray(batch.q_starts, dtype=np.int64)
    if len(starts) != batch.batch_size + 1 or int(starts[0]) != 0 or (np.diff(starts) != new_lens).any():
        raise InputError(f"q_starts {starts.tolist()} do not pack the new tokens {new_lens.tolist()}")
    groups: list[StateGroup] = []
    decodes = np.flatnonzero(new_lens == 1)
    if len(decodes):
        groups.append(StateGroup(decodes, starts[decodes], 1))
    for b in np.flatnonzero(new_lens > 1):
        groups.append(StateGroup(np.array([b]), np.arange(starts[b], starts[b + 1]), int(new_lens[b])))
    return groups


def _slots(batch: ForwardBatch, requests: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.state_slots is None:
        raise InputError("a batch through recurrent layers needs state_slots")
    index = torch.as_tensor(requests, dtype=torch.long, device=batch.state_slots.device)
    slots = batch.state_slots[index].long()
    if batch.state_fresh is None:
        fresh = torch.zeros(len(requests), dtype=torch.bool, device=slots.device)
    else:
        fresh = batch.state_fresh.to(slots.device)[index].bool()
    return slots, fresh


def read_state(store: torch.Tensor, batch: ForwardBatch, requests: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The requests' state from `store` (`[n_slots, ...]`) as `dtype`, zeros for a fresh request: its
    slot's old bytes are never used (a select, so even NaN garbage does not leak through)."""
    slots, fresh = _slots(batch, requests)
    state = store[slots].to(dtype)
    mask = fresh.view(-1, *([1] * (state.dim() - 1)))
    return torch.where(mask, torch.zeros((), dtype=dtype, device=state.device), state)


def write_state(store: torch.Tensor, batch: ForwardBatch, requests: np.ndarray, state: torch.Tensor) -> None:
    """Write the requests' final state back into their slots of `store` (the pool's bytes)."""
    slots, _fresh = _slots(batch, requests)
    store[slots] = state.to(store.dtype)


def causal_conv(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over `x` (`[B, C, L]`) continuing from `past` (`[B, C, K-1]`, the last
    K-1 inputs before it), with `weight` `[C, K]`. Returns the pre-activation output `[B, C, L]` and
    the new last K-1 inputs (which reach into `past` when L < K-1)."""
    kernel = weight.shape[-1]
    if past.shape[-1] != kernel - 1:
        raise InputError(f"conv state keeps {past.shape[-1]} inputs, the kernel of width {kernel} needs {kernel - 1}")
    full = torch.cat([past.to(weight.dtype), x.to(weight.dtype)], dim=-1)
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return out, full[..., full.shape[-1] - (kernel - 1):]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The conv's activation by its config name."""
    if name in ("silu", "swish"):
        return F.silu
    raise InputError(f"recurrent conv activation {name!r} is not supported (silu only)")


def conv_store(batch: ForwardBatch, layer_id: int) -> torch.Tensor:
    return batch.pool_of(layer_id).state(layer_id, "conv")


def ssm_store(batch: ForwardBatch, layer_id: int) -> torch.Tensor:
    return batch.pool_of(layer_id).state(layer_id, "ssm")


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
