"""RecurrentGemma's recurrent block (Griffin's RG-LRU) on the pool: the block's own projections, conv
weights and gate parameters, with the conv window and the RG-LRU state read from and written to the
request's state slot (the plan's `conv` and `rg_lru` tensors, `models/recurrent_gemma.py`).

The block projects each token twice: a gelu branch `y` and a branch `x` that runs through a
depthwise causal conv (no activation) and then the RG-LRU. Per channel the RG-LRU keeps one float32
value h: each token decays it by a = exp(-8 r softplus(Lambda)) (r, the recurrence gate) and adds
the gated input scaled by sqrt(1 - a^2); the block's output is h * y, projected out. At position 0
the recurrence resets (a = 0, input unscaled), as the model defines a sequence's start. The gates
depend on the token alone, so only the recurrence h_t = a_t h_(t-1) + u_t is sequential, and a
chunk scans it by doubling (log2(L) batched rounds). A padded group's pads get a = 1 and u = 0:
they leave the state as it is."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .batch import ForwardBatch
from .conv_state import (
    StateGroup,
    assemble,
    cast,
    causal_conv,
    packed_input,
    read_state,
    state_groups,
    transformers_classes,
    write_state,
)

f32 = torch.float32
#: tokens scanned at once: a long prefill chunk is scanned block by block, the state carried exactly
#: from one block to the next
BLOCK = 128


def rglru_module_types() -> tuple[type, ...]:
    """The block classes `rglru_forward` serves (those the installed transformers has)."""
    return transformers_classes("transformers.models.recurrent_gemma.modeling_recurrent_gemma",
                                "RecurrentGemmaRecurrentBlock")


def linear_recurrence(decay: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor,
                      block: int = BLOCK) -> torch.Tensor:
    """Every h_t of h_t = decay_t h_(t-1) + inputs_t from h_(-1) = `state`, for `[B, L, W]` decays
    and inputs and a `[B, W]` state. Within a block a Hillis-Steele doubling: after the round with
    offset k each position holds the recurrence composed over its last 2k tokens."""
    out = torch.empty_like(inputs)
    for lo in range(0, inputs.shape[1], block):
        hi = min(lo + block, inputs.shape[1])
        a, h = decay[:, lo:hi], inputs[:, lo:hi]
        h = torch.cat([torch.addcmul(h[:, :1], a[:, :1], state[:, None]), h[:, 1:]], dim=1)
        k = 1
        while k < hi - lo:
            h = torch.cat([h[:, :k], torch.addcmul(h[:, k:], a[:, k:], h[:, :-k])], dim=1)
            if 2 * k < hi - lo:  # the last round's decays are never read
                a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], dim=1)
            k *= 2
        out[:, lo:hi] = h
        state = h[:, -1]
    return out


def _block_gate(lru: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid of one of the RG-LRU's block-diagonal gates (one `[block_width, block_width]` matrix
    per head) of the conv outputs `x` `[N, W]`."""
    heads = lru.num_attention_heads
    per_head = x.reshape(-1, heads, lru.block_width).transpose(0, 1)  # [H, N, bw]
    return torch.sigmoid(torch.baddbmm(bias[:, None, :], per_head, weight).transpose(0, 1).reshape(x.shape))


def rglru_inputs(lru: torch.nn.Module, x: torch.Tensor, reset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence's decay a and input u (float32) of the conv outputs `x` `[..., W]`, where
    `reset` (broadcast against x) marks a sequence's first token: there a = 0 and the gated input
    is not rescaled. The gates are computed in the model's dtype, as the module does."""
    flat = x.reshape(-1, x.shape[-1])
    input_gate = _block_gate(lru, flat, lru.input_gate_weight, lru.input_gate_bias).view(x.shape)
    recurrent_gate = _block_gate(lru, flat, lru.recurrent_gate_weight, lru.recurrent_gate_bias).view(x.shape)
    log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param)
    scale = torch.where(reset, 1.0, torch.sqrt(1 - torch.exp(2 * log_a))).to(x.dtype)
    decay = torch.where(reset, 0.0, cast(torch.exp(log_a), f32))
    return decay, cast(x * input_gate * scale, f32)


def _starts(batch: ForwardBatch, group: StateGroup) -> torch.Tensor:
    """`[B, L, 1]` bool: which of the group's tokens sit at position 0 (a request's first token)."""
    first = np.asarray(batch.prefix_lens, dtype=np.int64)[group.requests] == 0
    at_zero = np.zeros((group.size, group.length, 1), dtype=bool)
    at_zero[:, 0, 0] = first
    return torch.from_numpy(at_zero).to(group.slots.device)


def rglru_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (a `RecurrentGemmaRecurrentBlock`) over the packed batch: `[1, T, hidden]` ->
    `[1, T, hidden]` (its block unpacks `(output, None)`, which `mixers.py` pairs it into)."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    width = module.lru_width
    y_branch = module.act_fn(module.linear_y(x))
    x_branch = module.linear_x(x)
    weight, bias = module.conv_1d.weight.squeeze(1), module.conv_1d.bias

    layer = module.layer_idx
    view = batch.state_pool_of(layer)
    conv_pool, lru_pool = view.state(layer, "conv"), view.state(layer, "rg_lru")
    steps = state_groups(batch)
    parts = []
    for group in steps:
        n_req, length = group.size, group.length
        seq = group.take(x_branch).view(n_req, length, width).transpose(1, 2)  # [B, W, L]
        conv, conv_next = causal_conv(seq, read_state(conv_pool, group, dtype), weight, bias, group)
        decay, inputs = rglru_inputs(module.rg_lru, cast(conv, dtype).transpose(1, 2), _starts(batch, group))
        if group.pad is not None:
            decay = decay.masked_fill(group.pad[..., None], 1.0)
            inputs = inputs.masked_fill(group.pad[..., None], 0.0)
        states = linear_recurrence(decay, inputs, read_state(lru_pool, group, f32))
        parts.append(cast(states, dtype).reshape(n_req * length, width))
        write_state(conv_pool, group, conv_next)
        write_state(lru_pool, group, states[:, -1])

    return module.linear_out(assemble(steps, parts, x.shape[0]) * y_branch).unsqueeze(0)
