"""A rank's shard of a checkpoint's weights, split as tensor-parallel engines split them.

Every layer is split by heads or by inner rows, so a rank computes its own heads end to end and
writes only their keys, values and state into its own pool; the one layer that mixes the heads
back (an attention's or a mixer's output projection, an MLP's down projection, the experts'
down projections) keeps this rank's columns and sums its partial output over the ranks with an
all-reduce. What stays whole on every rank: embeddings, norms over the hidden size, routers, the
shared expert's gate, Zamba2's shared MLP (gate and up fused, with its adapters), the head. The
kinds of layer split here:

- attention (q/k/v/o projections): by query and key-value heads; a gated query (`q_proj` twice as
  wide, each head's query followed by its gate), a per-head output gate and attention sinks split
  with their heads; a q/k norm over every head's channels at once (OLMo's) keeps this rank's
  weights and sums its mean square over the ranks; a shared block run at several layers (Zamba's,
  Zamba2's) splits at each, and Zamba2's per-use LoRA adapters keep their up-projection's rows;
- multi-head latent attention (DeepSeek-V2/V3 and its kin): by query heads, the latent whole on
  every rank (its pool holds all of it, as `models/deepseek.py` plans);
- dense MLPs: gate/up (or up alone) by rows, down by columns;
- MoE experts (fused 3-D weights): every expert's inner rows, the summed output reduced;
- Mamba2 mixers (Nemotron-H, Bamba, Granite 4.0-H, Mamba2, Falcon-H1, Zamba2): by groups of heads, with their
  z, x, B, C and dt projections, conv channels, per-head decay, skip and norm weights (Falcon-H1's
  mup multipliers with their rows, its gated norm's group count this rank's);
- Mamba1 mixers (Mamba, Falcon-Mamba, Jamba): by inner channels, with their x and z projections,
  conv channels, dt projection, decay and skip; `x_proj` reads every channel, so its dt, B and C
  are summed over the ranks before their norms and `dt_proj`;
- gated DeltaNet mixers (Qwen3-Next, Qwen3.5, Lara Mini, OLMo Hybrid): by key heads, with their value
  heads, conv channels, gates and decay, however the mixer lays out its input projections;
- Kimi Delta Attention: by heads, with their conv channels, forget gate, beta and output gate;
- short convolutions (LFM): by hidden channels, with their B, C and x projections;
- MiniMax's lightning attention: by heads, with their decay slopes and output gate; its norm over
  every head's channels sums its mean square over the ranks;
- RecurrentGemma's RG-LRU: by heads (its gates are block-diagonal), with their x and y branches,
  conv channels and recurrence parameter;
- Zamba's per-head Mamba: by heads, each with its own `x_proj` and `dt_proj`.

Each rank's state shapes are then those `model_from_config(..., tp_size=N)` plans for it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..decl import KVLayerDecl, Unit
from ..engine.conv_state import transformers_classes
from ..engine.latent import latent_module
from ..engine.mixers import layer_in_name, served_mixer_types
from ..errors import InputError


class RowParallelLinear(torch.nn.Module):
    """A linear layer's column shard: this rank's partial output, summed over the ranks. The bias
    is added on rank 0 only, so the sum holds it once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        #: the ranks that sum their shards (None: the whole process group)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        dist.all_reduce(out, group=self.group)
        return out


def split(total: int, n: int, what: str) -> int:
    """`total` over `n` ranks, refused in one line when it does not split evenly."""
    if total % n:
        raise InputError(f"--tp {n}: {what} ({total}) do not split evenly over {n} ranks")
    return total // n


def _rows(index: torch.Tensor, linear: torch.nn.Linear) -> torch.nn.Linear:
    """The output rows `index` of `linear` (a column-parallel shard)."""
    out = torch.nn.Linear(linear.in_features, len(index), bias=linear.bias is not None,
                          device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[index])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[index])
    return out.requires_grad_(False)


def _columns(index: torch.Tensor, linear: torch.nn.Linear, rank: int, group: Any) -> RowParallelLinear:
    bias = linear.bias.detach().clone() if linear.bias is not None and rank == 0 else None
    return RowParallelLinear(linear.weight.detach()[:, index].clone(), bias, group)


def _blocks(rank: int, per_rank: int, width: int, offset: int = 0) -> torch.Tensor:
    """The indices of this rank's `per_rank` blocks of `width` each, after `offset`."""
    lo = offset + rank * per_rank * width
    return torch.arange(lo, lo + per_rank * width)


def _parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.detach().clone(), requires_grad=False)


def _conv(conv: torch.nn.Conv1d, index: torch.Tensor) -> torch.nn.Conv1d:
    """The depthwise convolution's channels `index`."""
    out = torch.nn.Conv1d(len(index), len(index), conv.kernel_size[0], groups=len(index), padding=conv.padding[0],
                          bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(conv.weight[index])
        if conv.bias is not None:
            out.bias.copy_(conv.bias[index])
    return out.requires_grad_(False)


def _reduced(module: torch.nn.Module, group: Any) -> None:
    """Sum `module`'s output over the ranks after its own forward (its inner rows are split)."""
    inner = module.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        dist.all_reduce(out, group=group)
        return out

    module.forward = forward


def _attention(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    head_dim = int(module.head_dim)
    kv_heads = module.k_proj.out_features // head_dim
    out = _attention_out(module)
    heads = getattr(module, out).in_features // head_dim
    per_head = module.q_proj.out_features // heads  # head_dim, or twice it for a gated query
    h, kvh = split(heads, n, "attention heads"), split(kv_heads, n, "key-value heads")
    module.q_proj = _rows(_blocks(rank, h, per_head), module.q_proj)
    module.k_proj = _rows(_blocks(rank, kvh, head_dim), module.k_proj)
    module.v_proj = _rows(_blocks(rank, kvh, head_dim), module.v_proj)
    setattr(module, out, _columns(_blocks(rank, h, head_dim), getattr(module, out), rank, group))
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        module.sinks = _parameter(module.sinks[rank * h:(rank + 1) * h])
    if isinstance(getattr(module, "g_proj", None), torch.nn.Linear):  # LFM's per-head output gate
        module.g_proj = _rows(_blocks(rank, h, 1), module.g_proj)
    for name, index in (("q_norm", _blocks(rank, h, head_dim)), ("k_norm", _blocks(rank, kvh, head_dim))):
        norm = getattr(module, name, None)
        if _spans_heads(norm, head_dim):
            setattr(module, name, _SplitRMSNorm(norm, index, group))
    for name, index in (("q", _blocks(rank, h, per_head)), ("k", _blocks(rank, kvh, head_dim)),
                        ("v", _blocks(rank, kvh, head_dim))):
        _adapters(getattr(module, f"linear_{name}_adapter_list", ()), index)


def _adapters(adapters: Iterable[torch.nn.Module], index: torch.Tensor) -> None:
    """Zamba2's per-use LoRA adapters, each added to its projection's output: the down-projection
    reads the whole input and stays whole, the up-projection keeps the projection's rows `index`
    (the uses that run no adapter hold an identity)."""
    for adapter in adapters:
        if isinstance(adapter, torch.nn.Sequential):
            adapter[1] = _rows(index, adapter[1])


def _attention_out(module: torch.nn.Module) -> str | None:
    """The name of an attention module's output projection: `o_proj`, or `out_proj` (LFM2's)."""
    return next((name for name in ("o_proj", "out_proj") if isinstance(getattr(module, name, None), torch.nn.Linear)),
                None)


def _spans_heads(norm: Any, head_dim: int) -> bool:
    """Whether `norm` is an RMS norm (weight times x over its root mean square, no bias) over every
    head's channels at once (OLMo's q/k norms), not each head's."""
    weight = getattr(norm, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() > head_dim
            and hasattr(norm, "variance_epsilon") and getattr(norm, "bias", None) is None)


class _SplitRMSNorm(torch.nn.Module):
    """An RMS norm over channels the ranks share out: the mean square is summed over the ranks, so
    each rank scales its channels as the whole norm would, and keeps its channels' weights."""

    def __init__(self, norm: torch.nn.Module, index: torch.Tensor, group: Any, cast_first: bool = False) -> None:
        super().__init__()
        self.weight = _parameter(norm.weight[index])
        self.variance_epsilon = float(norm.variance_epsilon)
        self.width = norm.weight.numel()
        self.group = group
        #: whether the weight scales the normed channels after they are cast back (MiniMax's), not
        #: before (OLMo's): the two round differently below float32
        self.cast_first = cast_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        square = x.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(square, group=self.group)
        normed = x * torch.rsqrt(square / self.width + self.variance_epsilon)
        if self.cast_first:
            return self.weight * normed.to(dtype)
        return (self.weight * normed).to(dtype)


def _latent(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """MLA by query heads: each rank's queries, its heads' rows of the latent's up-projection
    (`kv_b_proj`: each head's key and value parts) and its columns of the output. The latent's own
    projection and norm stay whole: every rank keeps (and writes into its pool) the whole latent."""
    h = split(int(module.num_heads), n, "attention heads")
    q_name = "q_proj" if getattr(module, "q_proj", None) is not None else "q_b_proj"
    setattr(module, q_name, _rows(_blocks(rank, h, int(module.qk_head_dim)), getattr(module, q_name)))
    kv_width = int(module.qk_nope_head_dim) + int(module.v_head_dim)
    module.kv_b_proj = _rows(_blocks(rank, h, kv_width), module.kv_b_proj)
    module.o_proj = _columns(_blocks(rank, h, int(module.v_head_dim)), module.o_proj, rank, group)
    module.num_heads = h


#: a dense MLP's (gate, up, down) projection names: HF's usual ones and LFM's
_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _mlp_names(module: torch.nn.Module) -> tuple[str | None, str, str] | None:
    for gate, up, down in _MLP_NAMES:
        if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in (up, down)):
            return (gate if isinstance(getattr(module, gate, None), torch.nn.Linear) else None), up, down
    return None


def _mlp(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    gate, up, down = _mlp_names(module)
    index = _blocks(rank, split(getattr(module, up).out_features, n, "MLP intermediate rows"), 1)
    for name in (gate, up) if gate else (up,):
        setattr(module, name, _rows(index, getattr(module, name)))
    setattr(module, down, _columns(index, getattr(module, down), rank, group))


def _shortconv(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """LFM's short convolution: `in_proj` is [B | C | x], each of the hidden size, gated around a
    depthwise convolution over the hidden channels."""
    hidden = module.out_proj.in_features
    per_rank = split(hidden, n, "short-conv channels")
    channels = _blocks(rank, per_rank, 1)
    module.in_proj = _rows(torch.cat([channels, channels + hidden, channels + 2 * hidden]), module.in_proj)
    module.conv = _conv(module.conv, channels)
    module.out_proj = _columns(channels, module.out_proj, rank, group)


def _experts(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Fused experts: GPT-OSS stores `[E, hidden, 2I]` with gate and up interleaved and biases;
    Qwen3-Next stores `[E, 2I, hidden]` with the gates first, then the ups (LongCat-Flash's rows
    past its routed experts belong to identity experts, which use none)."""
    with torch.no_grad():
        if hasattr(module, "gate_up_proj_bias"):  # gpt-oss
            inner = split(module.gate_up_proj.shape[-1] // 2, n, "expert intermediate rows")
            pairs = _blocks(rank, inner, 2)
            module.gate_up_proj = _parameter(module.gate_up_proj[:, :, pairs])
            module.gate_up_proj_bias = _parameter(module.gate_up_proj_bias[:, pairs])
            rows = _blocks(rank, inner, 1)
            module.down_proj = _parameter(module.down_proj[:, rows])
            if rank:
                module.down_proj_bias = _parameter(torch.zeros_like(module.down_proj_bias))
            module.intermediate_size = inner
        else:
            full = module.gate_up_proj.shape[1] // 2
            inner = split(full, n, "expert intermediate rows")
            rows = torch.cat([_blocks(rank, inner, 1), _blocks(rank, inner, 1, full)])
            module.gate_up_proj = _parameter(module.gate_up_proj[:, rows])
            module.down_proj = _parameter(module.down_proj[:, :, _blocks(rank, inner, 1)])
            module.intermediate_dim = inner
    if rank and isinstance(getattr(module, "identity_expert", None), torch.nn.Identity):
        # LongCat-Flash's zero-compute experts pass their tokens through: the sum over the ranks
        # must add that once, from rank 0
        module.identity_expert = _Zeros()
    _reduced(module, group)


class _Zeros(torch.nn.Module):
    """An identity expert's share on a rank other than the first: nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def _mamba2(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    heads, groups = split(module.num_heads, n, "Mamba heads"), split(module.n_groups, n, "Mamba groups")
    inner, d_state, hd = heads * module.head_dim, module.ssm_state_size, module.head_dim
    full_inner, full_groups = module.intermediate_size, module.n_groups
    x_lo = full_inner  # in_proj: [z | x | B | C | dt]; conv: [x | B | C]
    b_lo, c_lo = 2 * full_inner, 2 * full_inner + full_groups * d_state
    dt_lo = full_inner + module.conv_dim
    z = _blocks(rank, heads, hd)
    xbc = [_blocks(rank, heads, hd), _blocks(rank, groups, d_state, full_inner),
           _blocks(rank, groups, d_state, full_inner + full_groups * d_state)]
    rows = torch.cat([z, _blocks(rank, heads, hd, x_lo), _blocks(rank, groups, d_state, b_lo),
                      _blocks(rank, groups, d_state, c_lo), _blocks(rank, heads, 1, dt_lo)])
    module.in_proj = _rows(rows, module.in_proj)
    if isinstance(getattr(module, "mup_vector", None), torch.Tensor):  # Falcon-H1: a multiplier per row
        module.mup_vector = module.mup_vector[..., rows].clone()
    module.conv1d = _conv(module.conv1d, torch.cat(xbc))
    per_head = _blocks(rank, heads, 1)
    for name in ("A_log", "D", "dt_bias"):
        setattr(module, name, _parameter(getattr(module, name)[per_head]))
    _gated_norm(module.norm, z, groups)
    module.out_proj = _columns(z, module.out_proj, rank, group)
    module.num_heads, module.n_groups, module.intermediate_size = heads, groups, inner
    module.conv_dim = inner + 2 * groups * d_state


def _gated_norm(norm: torch.nn.Module, channels: torch.Tensor, groups: int) -> None:
    """A Mamba2 mixer's gated norm, normalising each group's run of channels apart: this rank keeps
    its groups' weights. Bamba's and Nemotron-H's keep the group size; Falcon-H1's keeps the group
    count, which becomes this rank's; Falcon-H1 without its norm has none to split."""
    if isinstance(norm, torch.nn.Identity):
        return
    norm.weight = _parameter(norm.weight[channels])
    if isinstance(getattr(norm, "n_groups", None), int):
        norm.n_groups = groups


def _mamba1(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Mamba1 by inner channels: `in_proj` is [x | z], the conv, `dt_proj`, `A_log` and `D` are per
    channel. `x_proj` reads every channel to give dt, B and C, so it keeps this rank's columns and
    sums them over the ranks before Falcon-Mamba's and Jamba's norms over dt, B and C (whole dims)."""
    inner = module.intermediate_size
    channels = _blocks(rank, split(inner, n, "Mamba inner channels"), 1)
    module.in_proj = _rows(torch.cat([channels, channels + inner]), module.in_proj)
    module.conv1d = _conv(module.conv1d, channels)
    module.x_proj = _columns(channels, module.x_proj, rank, group)
    module.dt_proj = _rows(channels, module.dt_proj)
    module.A_log = _parameter(module.A_log[channels])
    module.D = _parameter(module.D[channels])
    module.out_proj = _columns(channels, module.out_proj, rank, group)
    module.intermediate_size = len(channels)


def _zamba(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Zamba's multi-head Mamba by its heads: each head's `x_proj` and `dt_proj` read that head's
    channels only, so a head runs whole on one rank. `in_proj` interleaves each channel's x and gate
    rows (x_c at 2c, its gate at 2c + 1); the conv, dt bias, decay and skip follow the channels and
    heads; `out_proj` keeps this rank's columns."""
    heads = split(module.n_mamba_heads, n, "Zamba Mamba heads")
    channels, per_head = _blocks(rank, heads, module.mamba_head_dim), slice(rank * heads, (rank + 1) * heads)
    module.in_proj = _rows(torch.stack([2 * channels, 2 * channels + 1], dim=-1).reshape(-1), module.in_proj)
    module.conv1d = _conv(module.conv1d, channels)
    for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):
        setattr(module, name, _parameter(getattr(module, name)[per_head]))
    module.out_proj = _columns(channels, module.out_proj, rank, group)
    module.n_mamba_heads, module.intermediate_size = heads, len(channels)


def _deltanet_inputs(module: torch.nn.Module, rank: int, nk: int, nv: int) -> torch.Tensor:
    """This rank's rows of the mixer's input projections, however it lays them out
    (`deltanet._split_projections`): Qwen3-Next fuses q, k, v and z per key head (and b with a);
    Qwen3.5 and Lara Mini project [q | k | v], z, b and a apart; OLMo Hybrid projects q, k, v, its
    gate g, b and a each apart. Returns the conv's channels ([q | k | v], as the pool's state)."""
    dk, dv, rep, key_dim = module.head_k_dim, module.head_v_dim, nv // nk, module.key_dim
    q, v, heads = _blocks(rank, nk, dk), _blocks(rank, nv, dv), _blocks(rank, nv, 1)
    qkv = torch.cat([q, q + key_dim, v + 2 * key_dim])
    if hasattr(module, "in_proj_qkvz"):
        module.in_proj_qkvz = _rows(_blocks(rank, nk, 2 * dk + 2 * rep * dv), module.in_proj_qkvz)
        module.in_proj_ba = _rows(_blocks(rank, nk, 2 * rep), module.in_proj_ba)
    elif hasattr(module, "in_proj_qkv"):
        module.in_proj_qkv = _rows(qkv, module.in_proj_qkv)
        module.in_proj_z = _rows(v, module.in_proj_z)
        module.in_proj_b, module.in_proj_a = _rows(heads, module.in_proj_b), _rows(heads, module.in_proj_a)
    else:
        module.q_proj, module.k_proj = _rows(q, module.q_proj), _rows(q, module.k_proj)
        module.v_proj, module.g_proj = _rows(v, module.v_proj), _rows(v, module.g_proj)
        module.b_proj, module.a_proj = _rows(heads, module.b_proj), _rows(heads, module.a_proj)
    return qkv


def _deltanet(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Gated DeltaNet by key heads, each with the run of value heads it serves."""
    nk, nv = split(module.num_k_heads, n, "linear key heads"), split(module.num_v_heads, n, "linear value heads")
    dv = module.head_v_dim
    module.conv1d = _conv(module.conv1d, _deltanet_inputs(module, rank, nk, nv))
    per_head = _blocks(rank, nv, 1)
    module.A_log = _parameter(module.A_log[per_head])
    module.dt_bias = _parameter(module.dt_bias[per_head])
    out = "out_proj" if hasattr(module, "out_proj") else "o_proj"
    setattr(module, out, _columns(_blocks(rank, nv, dv), getattr(module, out), rank, group))
    module.num_k_heads, module.num_v_heads = nk, nv
    module.key_dim, module.value_dim = nk * module.head_k_dim, nv * dv
    module.conv_dim = 2 * module.key_dim + module.value_dim


def _kda(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Kimi Delta Attention by heads: q, k and v (conv'd side by side in that order), the forget
    gate's per-head rows (`f_b_proj`, `dt_bias` per channel, `A_log` per head), beta's and the
    output gate's rows, the output's columns. The low-rank down-projections (`f_a_proj`,
    `g_a_proj`) and the per-head-dim norm stay whole."""
    heads, dim = split(module.num_heads, n, "linear attention heads"), module.head_dim
    width = module.num_heads * dim
    channels, per_head = _blocks(rank, heads, dim), _blocks(rank, heads, 1)
    for name in ("q_proj", "k_proj", "v_proj", "g_b_proj"):
        setattr(module, name, _rows(channels, getattr(module, name)))
    module.b_proj = _rows(per_head, module.b_proj)
    module.conv1d = _conv(module.conv1d, torch.cat([channels, channels + width, channels + 2 * width]))
    gate = module.forget_gate
    gate.f_b_proj = _rows(channels, gate.f_b_proj)
    gate.dt_bias = _parameter(gate.dt_bias[channels])
    gate.A_log = _parameter(gate.A_log[:, :, per_head])
    gate.num_heads, gate.qkv_dim = heads, heads * dim
    module.o_proj = _columns(channels, module.o_proj, rank, group)
    module.num_heads, module.qkv_dim, module.conv_dim = heads, heads * dim, 3 * heads * dim


def _lightning(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """MiniMax's lightning attention by heads: `qkv_proj` holds each head's q, k and v side by side,
    the output gate's rows and the output's columns follow the heads, and so do the per-head decay
    slopes (and the block decays transformers derives from them). Its RMS norm spans every head's
    channels at once: this rank keeps its channels' weights and sums the mean square over the ranks."""
    heads, dim = split(module.num_attention_heads, n, "lightning attention heads"), module.head_dim
    channels = _blocks(rank, heads, dim)
    module.qkv_proj = _rows(_blocks(rank, heads, 3 * dim), module.qkv_proj)
    module.output_gate = _rows(channels, module.output_gate)
    module.out_proj = _columns(channels, module.out_proj, rank, group)
    module.norm = _SplitRMSNorm(module.norm, channels, group, cast_first=True)
    module.slope_rate = module.slope_rate[rank * heads:(rank + 1) * heads].clone()
    module.query_decay, module.key_decay, module.diagonal_decay = module.decay_factors(module.slope_rate)
    module.num_attention_heads = heads


def _rglru(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """RecurrentGemma's recurrent block by the RG-LRU's heads: its gates are block-diagonal, one
    `[block_width, block_width]` matrix per head, so a head's channels need no other's. The x and y
    branches' rows, the conv channels, the gates' blocks and the recurrence's per-channel parameter
    follow the heads; `linear_out` keeps this rank's columns."""
    lru = module.rg_lru
    heads, width = split(lru.num_attention_heads, n, "RG-LRU heads"), lru.block_width
    channels, per_head = _blocks(rank, heads, width), slice(rank * heads, (rank + 1) * heads)
    module.linear_x, module.linear_y = _rows(channels, module.linear_x), _rows(channels, module.linear_y)
    module.conv_1d = _conv(module.conv_1d, channels)
    module.linear_out = _columns(channels, module.linear_out, rank, group)
    lru.recurrent_param = _parameter(lru.recurrent_param[channels])
    for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
        setattr(lru, name, _parameter(getattr(lru, name)[per_head]))
    lru.num_attention_heads = heads
    module.lru_width = heads * width


#: the recurrent mixers whose weights this module splits, by class: another family's mixer with the
#: same weight names may lay them out otherwise (split projections, multipliers, per-channel decay),
#: so it stays unsplit and `check_split` refuses it when the pool holds its state
_SPLIT_MIXERS = {
    "deltanet": (("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
                 ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
                 ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
                 ("transformers.models.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet"),
                 ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet")),
    "mamba2": (("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
               ("transformers.models.bamba.modeling_bamba", "BambaMixer"),
               ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
               ("transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer"),
               ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
               ("transformers.models.zamba2.modeling_zamba2", "Zamba2MambaMixer")),
    "mamba1": (("transformers.models.mamba.modeling_mamba", "MambaMixer"),
               ("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer"),
               ("transformers.models.jamba.modeling_jamba", "JambaMambaMixer")),
    "kda": (("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention"),),
    "lightning": (("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention"),),
    "rglru": (("transformers.models.recurrent_gemma.modeling_recurrent_gemma", "RecurrentGemmaRecurrentBlock"),),
    "zamba": (("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer"),),
}


def _split_mixer(module: torch.nn.Module) -> str | None:
    """The kind of a recurrent mixer this module splits, or None for one it does not."""
    return next((kind for kind, classes in _SPLIT_MIXERS.items() for where, name in classes
                 if isinstance(module, transformers_classes(where, name))), None)


def _kind(module: torch.nn.Module) -> str | None:
    """Which split `module` takes, read from the weights it holds (a recurrent mixer: from its class)."""
    served = served_mixer_types()
    if served and isinstance(module, served):
        if (kind := _split_mixer(module)) is not None:
            return kind
        if isinstance(getattr(module, "in_proj", None), torch.nn.Linear) and isinstance(
                getattr(module, "conv", None), torch.nn.Conv1d):
            return "shortconv"
        return None
    if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj")) and _attention_out(module):
        return "attention"
    if latent_module(module):
        return "latent"
    if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
        return "experts"
    if _mlp_names(module) is not None:
        return "mlp"
    return None


_SHARD = {"attention": _attention, "latent": _latent, "deltanet": _deltanet, "mamba2": _mamba2, "shortconv": _shortconv,
          "experts": _experts, "mlp": _mlp, "mamba1": _mamba1, "kda": _kda, "lightning": _lightning,
          "rglru": _rglru, "zamba": _zamba}


def _experts_inner(module: torch.nn.Module) -> int:
    width = module.gate_up_proj.shape[-1] if hasattr(module, "gate_up_proj_bias") else module.gate_up_proj.shape[1]
    return width // 2


#: what each kind of layer splits by: (its count, what it is called in a refusal)
_TOTALS = {
    "attention": lambda m: [(getattr(m, _attention_out(m)).in_features // int(m.head_dim), "attention heads"),
                            (m.k_proj.out_features // int(m.head_dim), "key-value heads")],
    "latent": lambda m: [(int(m.num_heads), "attention heads")],
    "mlp": lambda m: [(getattr(m, _mlp_names(m)[1]).out_features, "MLP intermediate rows")],
    "shortconv": lambda m: [(m.out_proj.in_features, "short-conv channels")],
    "experts": lambda m: [(_experts_inner(m), "expert intermediate rows")],
    "mamba2": lambda m: [(m.num_heads, "Mamba heads"), (m.n_groups, "Mamba groups")],
    "deltanet": lambda m: [(m.num_k_heads, "linear key heads"), (m.num_v_heads, "linear value heads")],
    "mamba1": lambda m: [(m.intermediate_size, "Mamba inner channels")],
    "kda": lambda m: [(m.num_heads, "linear attention heads")],
    "lightning": lambda m: [(m.num_attention_heads, "lightning attention heads")],
    "rglru": lambda m: [(m.rg_lru.num_attention_heads, "RG-LRU heads")],
    "zamba": lambda m: [(m.n_mamba_heads, "Zamba Mamba heads")],
}


#: the kinds of layer that write KV or state into the pool
_POOL_KINDS = ("attention", "latent", "deltanet", "mamba2", "mamba1", "kda", "shortconv", "lightning", "rglru", "zamba")
#: of those, the kinds that write KV (the others write recurrent state)
_KV_KINDS = ("attention", "latent")


def _layer_of(name: str, module: torch.nn.Module) -> int | None:
    """The layer a module's KV or state is kept for: its own `layer_idx`, or for one that keeps none
    (RecurrentGemma's block before the engine numbers it, a shared attention block told its layer
    per call) the `layers.<i>` its name sits in."""
    lid = getattr(module, "layer_idx", None)
    return lid if isinstance(lid, int) and lid >= 0 else layer_in_name(name)


def check_split(model: torch.nn.Module, n: int, decls: Iterable[KVLayerDecl] = ()) -> int:
    """Refuse, in one line and before any rank starts, a layer whose heads or rows do not split
    over `n` ranks, or a layer the pool gives KV (`decls`' token parts) without a split attention
    of that layer, or state without a split mixer of that layer: its whole heads would meet the
    pool's shard of them. The number of layers that split."""
    layers = [(module, kind) for module in model.modules() if (kind := _kind(module)) is not None]
    for module, kind in layers:
        for total, what in _TOTALS[kind](module):
            split(total, n, what)
    kv_layers, state_layers = set(), set()
    for decl in decls:
        for part in decl.parts:
            (kv_layers if part.geometry.unit is Unit.TOKEN else state_layers).add(decl.layer_id)
    # every name of a module counts: a shared attention block reused under several `layers.<i>`
    # splits each layer it runs at
    split_kv, split_state = set(), set()
    for name, module in model.named_modules(remove_duplicate=False):
        kind = _kind(module)
        if kind in _POOL_KINDS and (lid := _layer_of(name, module)) is not None:
            (split_kv if kind in _KV_KINDS else split_state).add(lid)
    whole = sorted((kv_layers - split_kv) | (state_layers - split_state))
    if whole:
        raise InputError(f"--tp {n}: layers {whole} hold KV or state in a form not split over ranks here "
                         "(attention and shared attention blocks, latent attention, Nemotron-H, Bamba, Granite, "
                         "Mamba2, Falcon-H1 and Zamba2 Mamba2 mixers, Mamba, Falcon-Mamba and Jamba Mamba1, "
                         "Zamba's per-head Mamba, Qwen3-Next, Qwen3.5, Lara Mini and OLMo Hybrid gated DeltaNet, "
                         "Kimi Delta Attention, MiniMax lightning attention, RecurrentGemma RG-LRU and LFM "
                         "short-conv layers are)")
    return len(layers)


def shard_model(model: torch.nn.Module, rank: int, n: int, group: Any = None) -> int:
    """Keep rank `rank`'s shard of every layer of `model` that splits; the number of layers split.
    The row-parallel sums run over `group` (None: the whole process group)."""
    split_layers = 0
    for module in list(model.modules()):
        kind = _kind(module)
        if kind is not None:
            _SHARD[kind](module, rank, n, group)
            split_layers += 1
    return split_layers
