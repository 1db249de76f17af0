"""Mamba2 on the pool: the module's own projections, conv weights, gated norm and output projection,
with the conv window and the SSM state read from and written to the request's slot. One forward
serves every transformers Mamba2 mixer (`MIXERS`): they share the layout (in_proj -> gate, x B C, dt;
a depthwise conv over x B C; the SSM; a gated norm; out_proj) and their attribute names, and differ
only where `_project` and `_gate` look: Falcon-H1's mup multipliers on the projection's input and on
each of its parts, and its optional norm (a plain silu gate without it).

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

#: (module, class) of each transformers Mamba2 mixer `mamba2_forward` serves
MIXERS = (
    ("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
    ("transformers.models.bamba.modeling_bamba", "BambaMixer"),
    ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    ("transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer"),
    ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
    ("transformers.models.zamba2.modeling_zamba2", "Zamba2MambaMixer"),
)


def mamba2_module_types() -> tuple[type, ...]:
    """The mixer classes `mamba2_forward` serves (those this transformers has)."""
    return tuple(cls for module, name in MIXERS for cls in transformers_classes(module, name))


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


def _project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`in_proj(x)`: gate, x B C and dt side by side. Falcon-H1 (mup) scales its input by
    `ssm_in_multiplier` and each part of its output by its own multiplier (`mup_vector`)."""
    scale = getattr(module, "ssm_in_multiplier", None)
    if scale is not None:
        x = x * scale
    projected = module.in_proj(x)
    mup = getattr(module, "mup_vector", None)
    if mup is not None:
        projected = projected * mup.reshape(-1)
    return projected


def _gate(module: torch.nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The SSM output `[T, inner]` gated by silu(gate) through the module's gated RMS norm (which
    says itself whether it normalises before or after the gate), or gated alone where the module
    has no norm (Falcon-H1 with `mamba_rms_norm` off)."""
    if isinstance(module.norm, torch.nn.Identity):
        return y * F.silu(gate)
    return module.norm(y, gate)


def _dt(module: torch.nn.Module, dt: torch.Tensor) -> torch.Tensor:
    """The time steps softplus(dt + dt_bias), clamped to the module's limits (none when it has
    none), in float32."""
    dt = F.softplus(dt + module.dt_bias)
    limit = module.time_step_limit
    if limit is not None:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return cast(dt, f32)


def mamba2_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (one of `mamba2_module_types()`) over the packed batch: `[1, T, hidden]` -> `[1, T, hidden]`.
    A padded group's pads get dt = 0: no decay and no input, so they leave the state as it is."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    n_tok = x.shape[0]
    heads, head_dim = module.num_heads, module.head_dim
    groups, d_state = module.n_groups, module.ssm_state_size
    inner = module.intermediate_size

    gate, xbc, dt = _project(module, x).split([inner, module.conv_dim, heads], dim=-1)
    dt = _dt(module, dt)
    a = -torch.exp(cast(module.A_log, f32))
    skip = cast(module.D, f32)[:, None]

    conv_pool, ssm_pool = conv_store(batch, module.layer_idx), ssm_store(batch, module.layer_idx)
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

    gated = _gate(module, assemble(steps, parts, n_tok), gate)
    return module.out_proj(cast(gated, dtype)).unsqueeze(0)
