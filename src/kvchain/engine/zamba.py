"""Zamba's multi-head Mamba1 mixer on the pool: the module's own projections, conv weights, per-head
x/dt projections and output projection, with the conv window and the SSM state read from and written
to the request's slot.

It is Mamba1 (`mamba1.py`) split into heads: the inner channels fall into `n_mamba_heads` runs,
each with its own `x_proj` (dt, B and C from that head's channels only) and `dt_proj`, and each
scanned as a Mamba1 of its own. The heads are folded into the batch, so one `selective_scan` call
runs them all. Its `in_proj` lays the x and gate channels out interleaved (x_c at row 2c, its gate
at 2c+1), where Mamba's puts all x rows before all gate rows. The state keeps the inner channels
head-major (`[heads * head_dim, d_state]`), as the plan's Mamba1 state and transformers' own do."""

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
from .mamba1 import selective_scan

f32 = torch.float32


def zamba_module_types() -> tuple[type, ...]:
    """The mixer classes `zamba_forward` serves (those the installed transformers has)."""
    return transformers_classes("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer")


def _fold(x: torch.Tensor) -> torch.Tensor:
    """`[B, L, H, ...]` -> `[B * H, L, ...]`: each (sequence, head) one scanned sequence."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], *x.shape[3:])


def _selective_inputs(module: torch.nn.Module, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dt (softplus-ed), B and C of each token and head from the conv output `xs` `[B, L, H, d]`, in
    float32: `[B, L, H, d]`, `[B, L, H, N]`, `[B, L, H, N]`; each head projects its own channels."""
    rank, d_state = module.time_step_rank, module.ssm_state_size
    params = torch.einsum("blhd,hkd->blhk", xs, cast(module.x_proj_weight, f32))
    dt, b, c = params.split([rank, d_state, d_state], dim=-1)
    dt = torch.einsum("blhr,hdr->blhd", dt, cast(module.dt_proj_weight, f32)) + cast(module.dt_proj_bias, f32)
    return F.softplus(dt), b, c


def zamba_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (a `ZambaMambaMixer`) over the packed batch: `[1, T, hidden]` -> `[1, T, hidden]`. A
    padded group's pads get dt = 0: no decay and no input, so they leave the state as it is."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    heads, head_dim, inner = module.n_mamba_heads, module.mamba_head_dim, module.intermediate_size
    xs_all, gate = module.in_proj(x).view(x.shape[0], inner, 2).unbind(-1)  # the interleaved halves
    a = -torch.exp(cast(module.A_log, f32))  # [H, d, N]
    skip = cast(module.D, f32).reshape(inner)

    layer = module.layer_idx
    conv_pool, ssm_pool = conv_store(batch, layer), ssm_store(batch, layer)
    steps = state_groups(batch)
    parts = []
    for group in steps:
        n_req, length = group.size, group.length
        xs, conv_next = group_conv(module, conv_pool, group, xs_all, dtype)  # [B, L, inner]
        xs = cast(xs, f32)
        xh = xs.view(n_req, length, heads, head_dim)
        dt, b, c = _selective_inputs(module, xh)
        if group.pad is not None:
            dt = dt.masked_fill(group.pad[..., None, None], 0.0)
        rates = a.expand(n_req, -1, -1, -1).reshape(n_req * heads, 1, head_dim, -1)  # per folded sequence
        state = read_state(ssm_pool, group, f32).view(n_req * heads, head_dim, -1)
        y, state = selective_scan(_fold(xh), _fold(dt), rates, _fold(b), _fold(c), state)
        y = y.view(n_req, heads, length, head_dim).transpose(1, 2).reshape(n_req * length, inner)
        parts.append(y + skip * xs.reshape(n_req * length, inner))
        write_state(conv_pool, group, conv_next)
        write_state(ssm_pool, group, state.reshape(n_req, inner, -1))

    gated = assemble(steps, parts, x.shape[0]) * F.silu(cast(gate, f32))
    return module.out_proj(cast(gated, dtype)).unsqueeze(0)
