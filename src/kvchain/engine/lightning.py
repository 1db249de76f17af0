"""MiniMax's lightning (linear) attention on the pool: the module's own projections, norm, output gate
and output projection, with the `[heads, head_dim, head_dim]` float32 KV state read from and written
to the request's state slot (the plan's `ssm` tensor, `models/parts.py::lightning_state`).

Per head the state S (`[head_dim (key), head_dim (value)]`) decays by exp(-s) each token (s, the
head's slope, fixed per layer) and takes k^T v; the output reads it with the query (q S). q, k and v
are the activated projection's thirds, unscaled. A chunk is computed in blocks: within a block the
outputs are the quadratic form (causal q k^T weighted by the decay between the two tokens, times v)
plus the decayed carried state, and the state is carried from block to block, which gives the
numbers of stepping token by token. The decay is written per token (g_t = -s), so a padded group's
pads get g = 0 and k = 0: no decay and no input, and they leave the state as it is. The outputs are
RMS-normed across heads, gated by sigmoid(output_gate(x)) and projected out."""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .conv_state import (
    assemble,
    cast,
    packed_input,
    read_state,
    ssm_store,
    state_groups,
    transformers_classes,
    write_state,
)

f32 = torch.float32
#: the block of the quadratic form: any length gives the same numbers (the state is carried exactly),
#: so the module's `block_size` is not copied; it bounds the `[B, H, block, block]` decay matrix
BLOCK = 64


def lightning_module_types() -> tuple[type, ...]:
    """The mixer classes `lightning_forward` serves (those the installed transformers has)."""
    return transformers_classes("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention")


def lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for B sequences (the decode step): q, k, v `[B, 1, H, D]`, g `[B, 1, H]`, state
    `[B, H, D, D]`. S = exp(g) S + k^T v, and the output q S `[B, 1, H, D]`."""
    k_t, v_t, q_t = k[:, 0, :, :, None], v[:, 0, :, None, :], q[:, 0, :, None, :]  # [B, H, D, 1], [B, H, 1, D]
    state = g[:, 0].exp()[..., None, None] * state + k_t @ v_t
    return (q_t @ state).transpose(1, 2), state


def lightning_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
                      block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over L tokens (same arguments as `lightning_step`, L tokens), a block at a
    time. With G_t the decay accumulated from the block's start and S0 its starting state, the
    output is G_t q_t S0 + sum_{j<=t} (G_t/G_j)(q_t.k_j) v_j and the block leaves
    G_l S0 + sum_j (G_l/G_j) k_j^T v_j; only ratios G_t/G_j with j <= t (at most 1) are formed."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
    g = g.transpose(1, 2)  # [B, H, L]
    out = torch.empty_like(v)
    length = q.shape[2]
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        q_b, k_b, v_b = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]
        gam = torch.cumsum(g[:, :, lo:hi], dim=-1)  # log G_t
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
        rel = torch.where(causal, gam[..., :, None] - gam[..., None, :], float("-inf")).exp()  # G_t/G_j, j<=t
        out[:, :, lo:hi] = ((q_b @ k_b.transpose(-1, -2)) * rel) @ v_b + gam.exp()[..., None] * (q_b @ state)
        last = gam[..., -1:]
        state = last.exp()[..., None] * state + (k_b * (last - gam).exp()[..., None]).transpose(-1, -2) @ v_b
    return out.transpose(1, 2), state


def lightning_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (a `MiniMaxLightningAttention`) over the packed batch: `[1, T, hidden]` ->
    `[1, T, hidden]` (its layer unpacks `(output, weights)`, which `mixers.py` pairs it into)."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    n_tok = x.shape[0]
    heads, dim = module.num_attention_heads, module.head_dim
    q, k, v = module.act_fn(module.qkv_proj(x)).view(n_tok, heads, 3 * dim).split(dim, dim=-1)
    log_decay = -cast(module.slope_rate, f32).reshape(heads)

    store = ssm_store(batch, module.layer_idx)
    steps = state_groups(batch)
    parts = []
    for group in steps:
        n_req, length = group.size, group.length
        q_g, k_g, v_g = (cast(group.take(t), f32).view(n_req, length, heads, dim) for t in (q, k, v))
        g = log_decay.expand(n_req, length, heads)
        if group.pad is not None:
            g = g.masked_fill(group.pad[..., None], 0.0)
            k_g = k_g.masked_fill(group.pad[..., None, None], 0.0)
        state = read_state(store, group, f32)
        if length == 1:
            out, state = lightning_step(q_g, k_g, v_g, g, state)
        else:
            out, state = lightning_chunked(q_g, k_g, v_g, g, state)
        parts.append(out.reshape(n_req * length, heads * dim))
        write_state(store, group, state)

    normed = module.norm(cast(assemble(steps, parts, n_tok), dtype))
    return module.out_proj(torch.sigmoid(module.output_gate(x)) * normed).unsqueeze(0)
