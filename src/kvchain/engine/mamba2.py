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
    activation,
    causal_conv,
    conv_store,
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


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over L tokens for B sequences, in float32: x `[B, L, H, P]`, dt `[B, L, H]`, a `[H]`
    (negative), b and c `[B, L, H, N]` (repeated to the heads), state `[B, H, P, N]`. Returns
    `y = h C` (no D skip) `[B, L, H, P]` and the final state. Computed head-major (`[B, H, L, .]`),
    so every product is a batched matmul."""
    x, b, c = x.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)  # [B, H, L, .]
    dt = dt.transpose(1, 2)  # [B, H, L]
    out = torch.empty_like(x)
    length = x.shape[2]
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        dt_blk = dt[:, :, lo:hi]
        xdt = x[:, :, lo:hi] * dt_blk[..., None]
        b_blk, c_blk = b[:, :, lo:hi], c[:, :, lo:hi]
        cum = torch.cumsum(dt_blk * a[:, None], dim=-1)  # [B, H, l], non-increasing
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=x.device).tril()
        decay = torch.where(causal, cum[..., :, None] - cum[..., None, :], float("-inf")).exp()  # s to t
        scores = (c_blk @ b_blk.transpose(-1, -2)) * decay  # [B, H, t, s]
        out[:, :, lo:hi] = scores @ xdt + cum.exp()[..., None] * (c_blk @ state.transpose(-1, -2))
        to_end = (cum[..., -1:] - cum).exp()  # [B, H, l]
        state = cum[..., -1].exp()[..., None, None] * state + (xdt * to_end[..., None]).transpose(-1, -2) @ b_blk
    return out.transpose(1, 2), state


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSM for B sequences (the decode step; `ssd_scan`'s arguments with L = 1):
    h = exp(dt A) h + dt x B^T, y = h C."""
    x, dt, b, c = x[:, 0], dt[:, 0], b[:, 0], c[:, 0]  # [B, H, P], [B, H], [B, H, N]
    state = (dt * a).exp()[..., None, None] * state + (x * dt[..., None])[..., None] * b[:, :, None, :]
    return (state @ c[..., None])[..., 0][:, None], state  # [B, 1, H, P]


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
    dt = F.softplus(dt + module.dt_bias).clamp(min=lo_limit, max=hi_limit).float()
    a = -torch.exp(module.A_log.float())
    skip = module.D.float()[:, None]

    layer = module.layer_idx
    conv_pool, ssm_pool = conv_store(batch, layer), ssm_store(batch, layer)
    weight = module.conv1d.weight.squeeze(1)
    act = activation(module.activation)
    scan = torch.empty(n_tok, heads, head_dim, dtype=torch.float32, device=x.device)
    for group in state_groups(batch):
        n_req, length = group.size, group.length
        seq = xbc.index_select(0, group.rows).view(n_req, length, -1).transpose(1, 2)  # [B, C, L]
        conv_past = read_state(conv_pool, group, dtype)
        conv_out, conv_next = causal_conv(seq, conv_past, weight, module.conv1d.bias, group)
        conv_out = act(conv_out).to(dtype).transpose(1, 2)  # [B, L, C]
        xs, b, c = torch.split(conv_out, [inner, groups * d_state, groups * d_state], dim=-1)
        xs = xs.reshape(n_req, length, heads, head_dim).float()
        b = b.reshape(n_req, length, groups, d_state).float().repeat_interleave(heads // groups, dim=2)
        c = c.reshape(n_req, length, groups, d_state).float().repeat_interleave(heads // groups, dim=2)
        step_dt = dt.index_select(0, group.rows).view(n_req, length, heads)
        if group.pad is not None:
            step_dt = step_dt.masked_fill(group.pad[..., None], 0.0)
        state = read_state(ssm_pool, group, torch.float32)
        if length == 1:
            y, state = ssd_step(xs, step_dt, a, b, c, state)
        else:
            y, state = ssd_scan(xs, step_dt, a, b, c, state, module.chunk_size)
        group.scatter(scan, (y + skip * xs).reshape(n_req * length, heads, head_dim))
        write_state(conv_pool, group, conv_next)
        write_state(ssm_pool, group, state)

    normed = module.norm(scan.reshape(n_tok, inner), gate)
    return module.out_proj(normed.to(dtype)).unsqueeze(0)
