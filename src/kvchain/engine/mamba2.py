"""Nemotron-H Mamba2 on the pool: the module's own projections, conv weights, gated norm and output
projection, with the conv window and the SSM state read from and written to the request's slot.

Per head the state h (`[head_dim, d_state]`) decays by exp(dt A) each token and takes dt x B^T;
the output is h C plus the D skip (y = h C + D x). A = -exp(A_log), dt = softplus(dt + dt_bias)
clamped to the module's time-step limits; B and C come per group, each serving a run of heads.
A chunk is scanned in blocks: within a block the outputs are the quadratic (attention-like) form
of the recurrence, and the state is carried from block to block, which gives the same numbers as
stepping token by token with far fewer kernel launches."""

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


def mamba2_module_types() -> tuple[type, ...]:
    """The mixer classes `mamba2_forward` serves (none when transformers lacks them)."""
    return transformers_classes("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer")


#: the scan's shortest block: any block length gives the same numbers (the state is carried exactly
#: from block to block), so a model's small kernel tile is not copied; on a CPU a block is a few
#: dozen small ops whatever its length, and a prefill chunk rarely needs more than one or two
MIN_BLOCK = 64
f32 = torch.float32


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """`[B, H, ...]` -> `[B, G, H/G, ...]` (a view): head h in group h // (H/G), as B and C serve them."""
    return x.view(x.shape[0], groups, x.shape[1] // groups, *x.shape[2:])


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over L tokens for B sequences, in float32: x `[B, L, H, P]`, dt `[B, L, H]`, a `[H]`
    (negative), b and c `[B, L, G, N]` (group g serving heads g H/G .. (g+1) H/G - 1; G = H
    serves each head its own), state `[B, H, P, N]`. Returns `y = h C` (no D skip) `[B, L, H, P]`
    and the final state. Computed head-major (`[B, G, H/G, L, .]`), so every product is a batched
    matmul and C B^T is formed once per group."""
    n, length, heads, p = x.shape
    groups = b.shape[2]
    x = _grouped(x.transpose(1, 2), groups)  # [B, G, R, L, P]
    dt = _grouped(dt.transpose(1, 2), groups)  # [B, G, R, L]
    b, c = b.transpose(1, 2)[:, :, None], c.transpose(1, 2)[:, :, None]  # [B, G, 1, L, N]
    a = a.view(groups, heads // groups, 1)
    state = _grouped(state, groups)  # [B, G, R, P, N]
    out = torch.empty_like(x)
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        dt_blk = dt[..., lo:hi]
        xdt = x[..., lo:hi, :] * dt_blk[..., None]
        b_blk, c_blk = b[..., lo:hi, :], c[..., lo:hi, :]
        cum = torch.cumsum(dt_blk * a, dim=-1)  # [B, G, R, l], non-increasing
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=x.device).tril()
        decay = torch.where(causal, cum[..., :, None] - cum[..., None, :], float("-inf")).exp()  # s to t
        scores = (c_blk @ b_blk.transpose(-1, -2)) * decay  # [B, G, R, t, s]
        out[..., lo:hi, :] = scores @ xdt + cum.exp()[..., None] * (c_blk @ state.transpose(-1, -2))
        to_end = (cum[..., -1:] - cum).exp()  # [B, G, R, l]
        state = cum[..., -1].exp()[..., None, None] * state + (xdt * to_end[..., None]).transpose(-1, -2) @ b_blk
    return out.reshape(n, heads, length, p).transpose(1, 2), state.reshape(n, heads, p, -1)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSM for B sequences (the decode step; `ssd_scan`'s arguments with L = 1):
    h = exp(dt A) h + dt x B^T, y = h C."""
    n, _one, heads, p = x.shape
    groups = b.shape[2]
    x, dt = _grouped(x[:, 0], groups), _grouped(dt[:, 0], groups)  # [B, G, R, P], [B, G, R]
    b, c = b[:, 0, :, None, None, :], c[:, 0, :, None, :, None]  # [B, G, 1, 1, N], [B, G, 1, N, 1]
    state = _grouped(state, groups)  # [B, G, R, P, N]
    state = (dt * a.view(groups, -1)).exp()[..., None, None] * state + (x * dt[..., None])[..., None] * b
    return (state @ c).view(n, 1, heads, p), state.view(n, heads, p, -1)


def mamba2_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (a `NemotronHMamba2Mixer`) over the packed batch: `[1, T, hidden]` -> `[1, T, hidden]`.
    A padded group's pads get dt = 0: no decay and no input, so they leave the state as it is."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    n_tok = x.shape[0]
    heads, head_dim = module.num_heads, module.head_dim
    groups, d_state = module.n_groups, module.ssm_state_size
    inner = module.intermediate_size

    gate, xbc, dt = module.in_proj(x).split([inner, module.conv_dim, heads], dim=-1)
    lo_limit, hi_limit = module.time_step_limit
    dt = cast(F.softplus(dt + module.dt_bias).clamp(min=lo_limit, max=hi_limit), f32)
    a = -torch.exp(cast(module.A_log, f32))
    skip = cast(module.D, f32)[:, None]

    layer = module.layer_idx
    conv_pool, ssm_pool = conv_store(batch, layer), ssm_store(batch, layer)
    steps = state_groups(batch)
    parts = []
    for group in steps:
        n_req, length = group.size, group.length
        conv_out, conv_next = group_conv(module, conv_pool, group, xbc, dtype)  # [B, L, C]
        xs, b, c = torch.split(conv_out, [inner, groups * d_state, groups * d_state], dim=-1)
        xs = cast(xs.reshape(n_req, length, heads, head_dim), f32)
        b = cast(b.reshape(n_req, length, groups, d_state), f32)
        c = cast(c.reshape(n_req, length, groups, d_state), f32)
        step_dt = group.take(dt).view(n_req, length, heads)
        if group.pad is not None:
            step_dt = step_dt.masked_fill(group.pad[..., None], 0.0)
        state = read_state(ssm_pool, group, torch.float32)
        if length == 1:
            y, state = ssd_step(xs, step_dt, a, b, c, state)
        else:
            y, state = ssd_scan(xs, step_dt, a, b, c, state, max(module.chunk_size, MIN_BLOCK))
        parts.append((y + skip * xs).reshape(n_req * length, heads * head_dim))
        write_state(conv_pool, group, conv_next)
        write_state(ssm_pool, group, state)

    normed = module.norm(assemble(steps, parts, n_tok), gate)
    return module.out_proj(cast(normed, dtype)).unsqueeze(0)
