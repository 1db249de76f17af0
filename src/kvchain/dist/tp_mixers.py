"""Each recurrent mixer's rank shard (`tp_shard.py` picks one by the mixer's class): a rank keeps
its heads (or channels) of every projection, convolution and per-head parameter, and its columns of
the output projection, whose partial output is summed over the ranks. Each rank's state shapes are
those `model_from_config(..., tp_size=N)` plans for it."""

from __future__ import annotations

from typing import Any

import torch

from .tp_parts import SplitRMSNorm, blocks, columns, conv_channels, parameter, rows, split


def shortconv(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """LFM's short convolution: `in_proj` is [B | C | x], each of the hidden size, gated around a
    depthwise convolution over the hidden channels."""
    hidden = module.out_proj.in_features
    per_rank = split(hidden, n, "short-conv channels")
    channels = blocks(rank, per_rank, 1)
    module.in_proj = rows(torch.cat([channels, channels + hidden, channels + 2 * hidden]), module.in_proj)
    module.conv = conv_channels(module.conv, channels)
    module.out_proj = columns(channels, module.out_proj, rank, group)


def mamba2(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    heads, groups = split(module.num_heads, n, "Mamba heads"), split(module.n_groups, n, "Mamba groups")
    inner, d_state, hd = heads * module.head_dim, module.ssm_state_size, module.head_dim
    full_inner, full_groups = module.intermediate_size, module.n_groups
    x_lo = full_inner  # in_proj: [z | x | B | C | dt]; conv: [x | B | C]
    b_lo, c_lo = 2 * full_inner, 2 * full_inner + full_groups * d_state
    dt_lo = full_inner + module.conv_dim
    z = blocks(rank, heads, hd)
    xbc = [blocks(rank, heads, hd), blocks(rank, groups, d_state, full_inner),
           blocks(rank, groups, d_state, full_inner + full_groups * d_state)]
    kept = torch.cat([z, blocks(rank, heads, hd, x_lo), blocks(rank, groups, d_state, b_lo),
                      blocks(rank, groups, d_state, c_lo), blocks(rank, heads, 1, dt_lo)])
    module.in_proj = rows(kept, module.in_proj)
    if isinstance(getattr(module, "mup_vector", None), torch.Tensor):  # Falcon-H1: a multiplier per row
        module.mup_vector = module.mup_vector[..., kept].clone()
    module.conv1d = conv_channels(module.conv1d, torch.cat(xbc))
    per_head = blocks(rank, heads, 1)
    for name in ("A_log", "D", "dt_bias"):
        setattr(module, name, parameter(getattr(module, name)[per_head]))
    _gated_norm(module.norm, z, groups)
    module.out_proj = columns(z, module.out_proj, rank, group)
    module.num_heads, module.n_groups, module.intermediate_size = heads, groups, inner
    module.conv_dim = inner + 2 * groups * d_state


def _gated_norm(norm: torch.nn.Module, channels: torch.Tensor, groups: int) -> None:
    """A Mamba2 mixer's gated norm, normalising each group's run of channels apart: this rank keeps
    its groups' weights. Bamba's and Nemotron-H's keep the group size; Falcon-H1's keeps the group
    count, which becomes this rank's; Falcon-H1 without its norm has none to split."""
    if isinstance(norm, torch.nn.Identity):
        return
    norm.weight = parameter(norm.weight[channels])
    if isinstance(getattr(norm, "n_groups", None), int):
        norm.n_groups = groups


def mamba1(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Mamba1 by inner channels: `in_proj` is [x | z], the conv, `dt_proj`, `A_log` and `D` are per
    channel. `x_proj` reads every channel to give dt, B and C, so it keeps this rank's columns and
    sums them over the ranks before Falcon-Mamba's and Jamba's norms over dt, B and C (whole dims)."""
    inner = module.intermediate_size
    channels = blocks(rank, split(inner, n, "Mamba inner channels"), 1)
    module.in_proj = rows(torch.cat([channels, channels + inner]), module.in_proj)
    module.conv1d = conv_channels(module.conv1d, channels)
    module.x_proj = columns(channels, module.x_proj, rank, group)
    module.dt_proj = rows(channels, module.dt_proj)
    module.A_log = parameter(module.A_log[channels])
    module.D = parameter(module.D[channels])
    module.out_proj = columns(channels, module.out_proj, rank, group)
    module.intermediate_size = len(channels)


def zamba(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Zamba's multi-head Mamba by its heads: each head's `x_proj` and `dt_proj` read that head's
    channels only, so a head runs whole on one rank. `in_proj` interleaves each channel's x and gate
    rows (x_c at 2c, its gate at 2c + 1); the conv, dt bias, decay and skip follow the channels and
    heads; `out_proj` keeps this rank's columns."""
    heads = split(module.n_mamba_heads, n, "Zamba Mamba heads")
    channels, per_head = blocks(rank, heads, module.mamba_head_dim), slice(rank * heads, (rank + 1) * heads)
    module.in_proj = rows(torch.stack([2 * channels, 2 * channels + 1], dim=-1).reshape(-1), module.in_proj)
    module.conv1d = conv_channels(module.conv1d, channels)
    for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):
        setattr(module, name, parameter(getattr(module, name)[per_head]))
    module.out_proj = columns(channels, module.out_proj, rank, group)
    module.n_mamba_heads, module.intermediate_size = heads, len(channels)


def _deltanet_inputs(module: torch.nn.Module, rank: int, nk: int, nv: int) -> torch.Tensor:
    """This rank's rows of the mixer's input projections, however it lays them out
    (`deltanet._split_projections`): Qwen3-Next fuses q, k, v and z per key head (and b with a);
    Qwen3.5 and Lara Mini project [q | k | v], z, b and a apart; OLMo Hybrid projects q, k, v, its
    gate g, b and a each apart. Returns the conv's channels ([q | k | v], as the pool's state)."""
    dk, dv, rep, key_dim = module.head_k_dim, module.head_v_dim, nv // nk, module.key_dim
    q, v, heads = blocks(rank, nk, dk), blocks(rank, nv, dv), blocks(rank, nv, 1)
    qkv = torch.cat([q, q + key_dim, v + 2 * key_dim])
    if hasattr(module, "in_proj_qkvz"):
        module.in_proj_qkvz = rows(blocks(rank, nk, 2 * dk + 2 * rep * dv), module.in_proj_qkvz)
        module.in_proj_ba = rows(blocks(rank, nk, 2 * rep), module.in_proj_ba)
    elif hasattr(module, "in_proj_qkv"):
        module.in_proj_qkv = rows(qkv, module.in_proj_qkv)
        module.in_proj_z = rows(v, module.in_proj_z)
        module.in_proj_b, module.in_proj_a = rows(heads, module.in_proj_b), rows(heads, module.in_proj_a)
    else:
        module.q_proj, module.k_proj = rows(q, module.q_proj), rows(q, module.k_proj)
        module.v_proj, module.g_proj = rows(v, module.v_proj), rows(v, module.g_proj)
        module.b_proj, module.a_proj = rows(heads, module.b_proj), rows(heads, module.a_proj)
    return qkv


def deltanet(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Gated DeltaNet by key heads, each with the run of value heads it serves."""
    nk, nv = split(module.num_k_heads, n, "linear key heads"), split(module.num_v_heads, n, "linear value heads")
    dv = module.head_v_dim
    module.conv1d = conv_channels(module.conv1d, _deltanet_inputs(module, rank, nk, nv))
    per_head = blocks(rank, nv, 1)
    module.A_log = parameter(module.A_log[per_head])
    module.dt_bias = parameter(module.dt_bias[per_head])
    out = "out_proj" if hasattr(module, "out_proj") else "o_proj"
    setattr(module, out, columns(blocks(rank, nv, dv), getattr(module, out), rank, group))
    module.num_k_heads, module.num_v_heads = nk, nv
    module.key_dim, module.value_dim = nk * module.head_k_dim, nv * dv
    module.conv_dim = 2 * module.key_dim + module.value_dim


def kda(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Kimi Delta Attention by heads: q, k and v (conv'd side by side in that order), the forget
    gate's per-head rows (`f_b_proj`, `dt_bias` per channel, `A_log` per head), beta's and the
    output gate's rows, the output's columns. The low-rank down-projections (`f_a_proj`,
    `g_a_proj`) and the per-head-dim norm stay whole. Bailing's layer: its full-rank forget and
    output gates (`f_proj`, `g_proj`) by rows, its `A_log` one per head."""
    heads, dim = split(module.num_heads, n, "linear attention heads"), module.head_dim
    width = module.num_heads * dim
    channels, per_head = blocks(rank, heads, dim), blocks(rank, heads, 1)
    output_gate = "g_b_proj" if hasattr(module, "g_b_proj") else "g_proj"  # Bailing's is one projection
    for name in ("q_proj", "k_proj", "v_proj", output_gate):
        setattr(module, name, rows(channels, getattr(module, name)))
    module.b_proj = rows(per_head, module.b_proj)
    module.conv1d = conv_channels(module.conv1d, torch.cat([channels, channels + width, channels + 2 * width]))
    gate = module.forget_gate
    forget = "f_b_proj" if hasattr(gate, "f_b_proj") else "f_proj"  # Bailing's is full rank
    setattr(gate, forget, rows(channels, getattr(gate, forget)))
    gate.dt_bias = parameter(gate.dt_bias[channels])
    gate.A_log = parameter(gate.A_log[per_head] if gate.A_log.dim() == 1 else gate.A_log[:, :, per_head])
    gate.num_heads, gate.qkv_dim = heads, heads * dim
    module.o_proj = columns(channels, module.o_proj, rank, group)
    module.num_heads, module.qkv_dim, module.conv_dim = heads, heads * dim, 3 * heads * dim


def lightning(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """MiniMax's lightning attention by heads: `qkv_proj` holds each head's q, k and v side by side,
    the output gate's rows and the output's columns follow the heads, and so do the per-head decay
    slopes (and the block decays transformers derives from them). Its RMS norm spans every head's
    channels at once: this rank keeps its channels' weights and sums the mean square over the ranks."""
    heads, dim = split(module.num_attention_heads, n, "lightning attention heads"), module.head_dim
    channels = blocks(rank, heads, dim)
    module.qkv_proj = rows(blocks(rank, heads, 3 * dim), module.qkv_proj)
    module.output_gate = rows(channels, module.output_gate)
    module.out_proj = columns(channels, module.out_proj, rank, group)
    module.norm = SplitRMSNorm(module.norm, channels, group, cast_first=True)
    module.slope_rate = module.slope_rate[rank * heads:(rank + 1) * heads].clone()
    module.query_decay, module.key_decay, module.diagonal_decay = module.decay_factors(module.slope_rate)
    module.num_attention_heads = heads


def rglru(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """RecurrentGemma's recurrent block by the RG-LRU's heads: its gates are block-diagonal, one
    `[block_width, block_width]` matrix per head, so a head's channels need no other's. The x and y
    branches' rows, the conv channels, the gates' blocks and the recurrence's per-channel parameter
    follow the heads; `linear_out` keeps this rank's columns."""
    lru = module.rg_lru
    heads, width = split(lru.num_attention_heads, n, "RG-LRU heads"), lru.block_width
    channels, per_head = blocks(rank, heads, width), slice(rank * heads, (rank + 1) * heads)
    module.linear_x, module.linear_y = rows(channels, module.linear_x), rows(channels, module.linear_y)
    module.conv_1d = conv_channels(module.conv_1d, channels)
    module.linear_out = columns(channels, module.linear_out, rank, group)
    lru.recurrent_param = parameter(lru.recurrent_param[channels])
    for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
        setattr(lru, name, parameter(getattr(lru, name)[per_head]))
    lru.num_attention_heads = heads
    module.lru_width = heads * width
