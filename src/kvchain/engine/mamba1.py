"""Mamba1 (the selective scan) on the pool: the module's own projections, conv weights, B/C/dt norms
and output projection, with the conv window and the SSM state read from and written to the
request's slot. Serves Mamba, Falcon-Mamba and Jamba's mixers.

Each inner channel d keeps its own state row h_d (`[d_state]`): per token it decays by
exp(dt_d A_d) (A = -exp(A_log), one rate per channel and state entry) and takes dt_d x_d B; the
output is h_d . C plus the D skip, gated by silu(z). dt, B and C come from the conv output through
`x_proj` (dt at a low rank, raised by `dt_proj` and softplus-ed); Falcon-Mamba and Jamba RMS-norm
them first. The state after every token of a chunk comes from one parallel prefix scan (a log2(L)
doubling of the linear recurrence h_t = a_t h_(t-1) + b_t), so a prefill chunk costs a handful of
batched ops per doubling instead of one step per token; its decays are products of factors <= 1,
so nothing overflows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import ForwardBatch
from .conv_state import (
    assemble,
    cast,
    conv_store,
    group_conv,
    packed_input,
    read_state,
    ssm_store,
    state_groups,
    transformers_classes,
    write_state,
)

f32 = torch.float32
#: tokens scanned at once: the scan holds a few `[B, block, channels, d_state]` tensors, so a long
#: prefill chunk is scanned block by block (the state carried exactly from one to the next)
BLOCK = 64


def mamba1_module_types() -> tuple[type, ...]:
    """The mixer classes `mamba1_forward` serves (those the installed transformers has)."""
    return (transformers_classes("transformers.models.mamba.modeling_mamba", "MambaMixer")
            + transformers_classes("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer")
            + transformers_classes("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"))


def linear_scan(decay: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Every h_t of h_t = decay_t h_(t-1) + inputs_t (h_(-1) = 0) along dim 1, for `[B, L, ...]`
    tensors: a Hillis-Steele doubling, after the round with offset k each position holds the
    recurrence composed over its last 2k tokens."""
    length = decay.shape[1]
    k = 1
    while k < length:
        inputs = torch.cat([inputs[:, :k], torch.addcmul(inputs[:, k:], decay[:, k:], inputs[:, :-k])], dim=1)
        if 2 * k < length:  # the last round's decays are never read
            decay = torch.cat([decay[:, :k], decay[:, k:] * decay[:, :-k]], dim=1)
        k *= 2
    return inputs


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over L tokens for B sequences, in float32: x and dt `[B, L, D]`, a `[D, N]`
    (negative; or `[B, 1, D, N]`, a rate per sequence: Zamba's heads folded into B), b and c
    `[B, L, N]`, state `[B, D, N]`. Returns `y = h . C` (no D skip) `[B, L, D]` and the final state.
    A token with dt = 0 leaves the state as it is."""
    out = torch.empty_like(x)
    for lo in range(0, x.shape[1], block):
        hi = min(lo + block, x.shape[1])
        dt_blk = dt[:, lo:hi, :, None]  # [B, l, D, 1]
        decay = (dt_blk * a).exp()  # [B, l, D, N]
        inputs = (dt_blk * x[:, lo:hi, :, None]) * b[:, lo:hi, None, :]
        inputs[:, 0] += decay[:, 0] * state  # the carried state enters through the first token
        states = linear_scan(decay, inputs)
        out[:, lo:hi] = (states @ c[:, lo:hi, :, None]).squeeze(-1)
        state = states[:, -1]
    return out, state


def _normed(module: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """`x` through the module's norm `name` (Falcon-Mamba's and Jamba's on dt, B and C), or as it is
    where the module has none (Mamba's)."""
    norm = getattr(module, name, None)
    return x if norm is None else norm(x)


def _selective_inputs(module: torch.nn.Module, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dt (softplus-ed, float32), B and C of each token from its conv output `xs` `[..., D]`, through
    `x_proj`, the norms Falcon-Mamba and Jamba put on them (the module's own, where it has them)
    and `dt_proj`."""
    rank, d_state = module.time_step_rank, module.ssm_state_size
    dt, b, c = module.x_proj(xs).split([rank, d_state, d_state], dim=-1)
    dt, b, c = (_normed(module, name, t) for name, t in (("dt_layernorm", dt), ("b_layernorm", b), ("c_layernorm", c)))
    return F.softplus(cast(module.dt_proj(dt), f32)), cast(b, f32), cast(c, f32)


def mamba1_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (a `MambaMixer`, `FalconMambaMixer` or `JambaMambaMixer`) over the packed batch:
    `[1, T, hidden]` -> `[1, T, hidden]`. A padded group's pads get dt = 0: no decay and no input,
    so they leave the state as it is."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    inner = module.intermediate_size
    xs_all, gate = module.in_proj(x).split([inner, inner], dim=-1)
    a = -torch.exp(cast(module.A_log, f32))  # [D, N]
    skip = cast(module.D, f32)

    layer = module.layer_idx
    conv_pool, ssm_pool = conv_store(batch, layer), ssm_store(batch, layer)
    steps = state_groups(batch)
    parts = []
    for group in steps:
        xs, conv_next = group_conv(module, conv_pool, group, xs_all, dtype)  # [B, L, D]
        dt, b, c = _selective_inputs(module, xs)
        if group.pad is not None:
            dt = dt.masked_fill(group.pad[..., None], 0.0)
        xs = cast(xs, f32)
        y, state = selective_scan(xs, dt, a, b, c, read_state(ssm_pool, group, f32))
        parts.append((y + skip * xs).reshape(group.size * group.length, inner))
        write_state(conv_pool, group, conv_next)
        write_state(ssm_pool, group, state)

    gated = assemble(steps, parts, x.shape[0]) * F.silu(cast(gate, f32))
    return module.out_proj(cast(gated, dtype)).unsqueeze(0)
