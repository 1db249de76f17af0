"""Gated DeltaNet on the pool: the module's own projections, conv weights, gated norm and output
projection, with the conv window and the recurrent state read from and written to the request's
state slot. One forward serves every transformers gated-DeltaNet mixer (`MIXERS`): they share the
maths below and differ only in how their input projections are split (`_project`), whether beta
may reach 2 (negative eigenvalues) and what their norm and output projection are called.

Per value head the state S (`[key_dim, value_dim]`) follows the gated delta rule: each token decays
it by exp(g), then corrects what it recalls for the token's key towards the token's value with step
beta (S += k (beta (v - S^T k))^T), and the output reads it with the query (S^T q). q and k are
l2-normalised and q is scaled by 1/sqrt(key_dim); each q/k head serves a run of consecutive value
heads. A padded group's pads get g = 0 and beta = 0: no decay and no correction, so they leave the
state as it is.

The scans and the per-group loop (`delta_rule_layer`) also take a decay per key channel (g
`[..., H, Dk]`, decaying each row of S by its own factor), which is Kimi Delta Attention's
(`kda.py`): the scalar gate is its special case."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
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

#: (module, class) of each transformers gated-DeltaNet mixer `deltanet_forward` serves
MIXERS = (
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet"),
    ("transformers.models.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet"),
)


def deltanet_module_types() -> tuple[type, ...]:
    """The mixer classes `deltanet_forward` serves (those this transformers has)."""
    return tuple(cls for module, name in MIXERS for cls in transformers_classes(module, name))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x` over the sum of its squares plus `eps` along the last dim (FLA's l2norm, not F.normalize's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token for B independent sequences, in float32: q, k `[B, L, G, Dk]`
    (already normalised and scaled; key head j serving value heads j H/G .. (j+1) H/G - 1, G = H
    for one each), v `[B, L, H, Dv]`, beta `[B, L, H]`, the log decay g `[B, L, H]` or per key
    channel `[B, L, H, Dk]`, state `[B, H, Dk, Dv]`. Returns the outputs `[B, L, H, Dv]` and the
    final state. Grouped (`[B, G, H/G, ...]`), so the key heads broadcast over their value heads
    instead of being repeated."""
    n, length, heads, dv = v.shape
    groups = k.shape[2]
    state = state.reshape(n, groups, heads // groups, *state.shape[2:])  # [B, G, R, Dk, Dv]
    decay = g.exp() if g.dim() == 4 else g.exp()[..., None]  # [B, L, H, Dk or 1]
    out = torch.empty_like(v)
    for t in range(length):
        k_t, q_t = k[:, t, :, None, None, :], q[:, t, :, None, None, :]  # [B, G, 1, 1, Dk]
        v_t = v[:, t].view(n, groups, -1, 1, dv)  # [B, G, R, 1, Dv]
        state = state * decay[:, t].view(n, groups, -1, decay.shape[-1], 1)
        delta = (v_t - k_t @ state) * beta[:, t].view(n, groups, -1, 1, 1)  # [B, G, R, 1, Dv]
        state = state + k_t.transpose(-1, -2) @ delta
        out[:, t] = (q_t @ state).view(n, heads, dv)
    return out, state.view(n, heads, *state.shape[3:])


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence (same arguments as `gated_delta_scan`, all H key heads) a block of tokens
    at a time.

    With G_t the decay accumulated from the block's start (a scalar, or a diagonal over the key
    channels) and S0 its starting state, unrolling gives S_t = G_t S0 + sum_{j<=t} (G_t/G_j) k_j u_j^T,
    where the corrections u_t solve the unit lower-triangular system
    u_t + beta_t sum_{j<t} k_t^T (G_t/G_j) k_j u_j = beta_t (v_t - S0^T G_t k_t). Outputs and the
    block's final state are then matrix products; only G_t/G_j with j <= t (at most 1) is ever
    formed, so nothing overflows."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
    beta = beta.transpose(1, 2)  # [B, H, L]
    g = g.transpose(1, 2) if g.dim() == 4 else g.transpose(1, 2)[..., None]  # [B, H, L, Dk or 1]
    out = torch.empty_like(v)
    length = q.shape[2]
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        q_b, k_b, v_b, beta_b = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], beta[:, :, lo:hi]
        gam = torch.cumsum(g[:, :, lo:hi], dim=2)  # log G_t
        kk, qk = _decayed_products(gam, k_b, (k_b, q_b))
        lower = (beta_b[..., None] * kk).tril(-1)
        eye = torch.eye(hi - lo, dtype=q.dtype, device=q.device)
        rhs = beta_b[..., None] * (v_b - (k_b * gam.exp()) @ state)
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        out[:, :, lo:hi] = (q_b * gam.exp()) @ state + qk @ u
        last = gam[:, :, -1:]  # [B, H, 1, Dk or 1]
        state = last.transpose(-1, -2).exp() * state + (k_b * (last - gam).exp()).transpose(-1, -2) @ u
    return out.transpose(1, 2), state


def _decayed_products(gam: torch.Tensor, k: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """For each of `rows` (x `[B, H, l, Dk]`), x_t^T (G_t/G_j) k_j for j <= t and 0 above, `[B, H, l, l]`,
    with log G `gam` `[B, H, l, Dk or 1]`. A scalar decay scales the plain products; a per-channel
    one weighs each channel inside the sum, so its ratios are `[l, l, Dk]` per head, formed once."""
    width = gam.shape[2]
    above = torch.ones(width, width, dtype=torch.bool, device=gam.device).triu(1)[..., None]
    rel = (gam[..., :, None, :] - gam[..., None, :, :]).masked_fill_(above, float("-inf")).exp_()  # [B, H, l, l, c]
    if gam.shape[-1] == 1:
        rel = rel[..., 0]
        return [(x @ k.transpose(-1, -2)) * rel for x in rows]
    keys = rel.mul_(k[:, :, None, :, :])  # (G_t/G_j) k_j
    return [(keys @ x[..., None])[..., 0] for x in rows]


@dataclass(frozen=True)
class DeltaInputs:
    """A layer's per-token inputs, packed `[T, ...]`: `mixed`, the conv's input (q, k and v side by
    side, the channel order of the plan's conv state); `gate` `[T, H, Dv]`, the output norm's gate;
    `beta` `[T, H]`; the log decay `g`, `[T, H]` or per key channel `[T, H, Dk]`."""

    mixed: torch.Tensor
    gate: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor


def _split_projections(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q k v, gate, b, a) from the module's input projections, however it splits them: Qwen3-Next
    fuses q, k, v and z per key head (`in_proj_qkvz`, each head's [q, k, its value heads' v, their
    z]) and b with a (`in_proj_ba`); Qwen3.5 and Lara Mini project q k v, z, b and a apart; OLMo
    Hybrid projects q, k, v, a, b and its gate (`g_proj`) each apart."""
    n_tok = x.shape[0]
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    rep = nv // nk
    if hasattr(module, "in_proj_qkvz"):
        qkvz = module.in_proj_qkvz(x).view(n_tok, nk, 2 * dk + 2 * rep * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, rep * dv, rep * dv], dim=-1)
        b, a = torch.split(module.in_proj_ba(x).view(n_tok, nk, 2 * rep), [rep, rep], dim=-1)
        mixed = torch.cat([q.reshape(n_tok, -1), k.reshape(n_tok, -1), v.reshape(n_tok, -1)], dim=-1)
        return mixed, z, b.reshape(n_tok, nv), a.reshape(n_tok, nv)
    if hasattr(module, "in_proj_qkv"):
        return module.in_proj_qkv(x), module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)
    if hasattr(module, "q_proj") and hasattr(module, "g_proj"):
        mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        return mixed, module.g_proj(x), module.b_proj(x), module.a_proj(x)
    raise InputError(f"layer {module.layer_idx} ({type(module).__name__}): no gated-DeltaNet input projections "
                     "kvchain knows (in_proj_qkvz, in_proj_qkv, or q_proj/k_proj/v_proj with g_proj)")


def _project(module: torch.nn.Module, x: torch.Tensor) -> DeltaInputs:
    """The layer's inputs from the packed hidden states `x` `[T, hidden]`: beta = sigmoid(b), twice
    that where the model allows negative eigenvalues (OLMo Hybrid: beta in [0, 2], so a step may
    overshoot and flip what the state recalls), and g = -exp(A_log) softplus(a + dt_bias) in float32."""
    mixed, gate, b, a = _split_projections(module, x)
    beta = b.sigmoid()
    if getattr(module, "allow_neg_eigval", False):
        beta = beta * 2.0
    g = -cast(module.A_log, f32).exp() * F.softplus(cast(a, f32) + module.dt_bias)
    return DeltaInputs(mixed, gate.reshape(x.shape[0], module.num_v_heads, module.head_v_dim), beta, g)


def _output(module: torch.nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The scan's outputs `[T, H, Dv]` through the module's gated norm (per value head) and output
    projection: `norm`/`out_proj` (Qwen3-Next, Qwen3.5, Lara Mini) or `o_norm`/`o_proj` (OLMo Hybrid)."""
    norm = module.norm if hasattr(module, "norm") else module.o_norm
    proj = module.out_proj if hasattr(module, "out_proj") else module.o_proj
    dv = module.head_v_dim
    normed = norm(y.reshape(-1, dv), gate.reshape(-1, dv))
    return proj(normed.reshape(1, y.shape[0], -1))


@dataclass(frozen=True)
class DeltaHeads:
    """A delta-rule layer's heads: `nk` q/k heads of `dk`, each serving `nv / nk` value heads of `dv`."""

    nk: int
    nv: int
    dk: int
    dv: int


def delta_rule_layer(module: torch.nn.Module, batch: ForwardBatch, inputs: DeltaInputs,
                     heads: DeltaHeads) -> torch.Tensor:
    """The delta rule of layer `module.layer_idx` over the packed batch, its state groups each stepped
    from its requests' conv window and recurrent state in the pool (zeros for a fresh one) and
    leaving theirs there: the conv (`module.conv1d`, `module.activation`) over `inputs.mixed`, q and k
    l2-normalised (q scaled by 1/sqrt(dk)), then the scan. The outputs `[T, nv, dv]` in float32."""
    nk, nv, dk, dv = heads.nk, heads.nv, heads.dk, heads.dv
    rep = nv // nk
    layer = module.layer_idx
    conv_pool, ssm_pool = conv_store(batch, layer), ssm_store(batch, layer)
    steps = state_groups(batch)
    parts = []
    for group in steps:
        n_req, length = group.size, group.length
        conv_out, conv_next = group_conv(module, conv_pool, group, inputs.mixed, inputs.mixed.dtype)  # [B, L, C]
        q_c, k_c, v_c = torch.split(conv_out, [nk * dk, nk * dk, nv * dv], dim=-1)
        q_c = l2norm(cast(q_c.reshape(n_req, length, nk, dk), f32)) / dk**0.5
        k_c = l2norm(cast(k_c.reshape(n_req, length, nk, dk), f32))
        v_c = cast(v_c.reshape(n_req, length, nv, dv), f32)
        step_g = cast(group.take(inputs.g), f32).view(n_req, length, *inputs.g.shape[1:])
        step_beta = cast(group.take(inputs.beta).view(n_req, length, nv), f32)
        if group.pad is not None:
            step_g = step_g.masked_fill(group.pad.view(n_req, length, *[1] * (step_g.dim() - 2)), 0.0)
            step_beta = step_beta.masked_fill(group.pad[..., None], 0.0)
        state = read_state(ssm_pool, group, torch.float32)
        if length == 1:  # a decode: the key heads broadcast over their value heads
            out, state = gated_delta_scan(q_c, k_c, v_c, step_g, step_beta, state)
        else:
            if rep > 1:
                q_c, k_c = q_c.repeat_interleave(rep, dim=2), k_c.repeat_interleave(rep, dim=2)
            out, state = gated_delta_chunked(q_c, k_c, v_c, step_g, step_beta, state)
        parts.append(out.reshape(n_req * length, nv, dv))
        write_state(conv_pool, group, conv_next)
        write_state(ssm_pool, group, state)
    return assemble(steps, parts, int(inputs.mixed.shape[0]))


def deltanet_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (one of `deltanet_module_types()`) over the packed batch: `[1, T, hidden]` -> `[1, T, hidden]`."""
    x = packed_input(hidden_states, batch)
    inputs = _project(module, x)
    heads = DeltaHeads(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
    return _output(module, cast(delta_rule_layer(module, batch, inputs, heads), x.dtype), inputs.gate)
