"""The pieces a tensor-parallel shard is cut with (`tp_shard.py`, `tp_mixers.py`): a linear layer
kept by rows (column parallel) or by columns with its output summed over the ranks (row parallel),
the index blocks of a rank's heads, a depthwise convolution's channels, and an RMS norm over
channels the ranks share out."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def rows(index: torch.Tensor, linear: torch.nn.Linear) -> torch.nn.Linear:
    """The output rows `index` of `linear` (a column-parallel shard)."""
    out = torch.nn.Linear(linear.in_features, len(index), bias=linear.bias is not None,
                          device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[index])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[index])
    return out.requires_grad_(False)


def columns(index: torch.Tensor, linear: torch.nn.Linear, rank: int, group: Any) -> RowParallelLinear:
    bias = linear.bias.detach().clone() if linear.bias is not None and rank == 0 else None
    return RowParallelLinear(linear.weight.detach()[:, index].clone(), bias, group)


def blocks(rank: int, per_rank: int, width: int, offset: int = 0) -> torch.Tensor:
    """The indices of this rank's `per_rank` blocks of `width` each, after `offset`."""
    lo = offset + rank * per_rank * width
    return torch.arange(lo, lo + per_rank * width)


def parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.detach().clone(), requires_grad=False)


def conv_channels(conv: torch.nn.Conv1d, index: torch.Tensor) -> torch.nn.Conv1d:
    """The depthwise convolution's channels `index`."""
    out = torch.nn.Conv1d(len(index), len(index), conv.kernel_size[0], groups=len(index), padding=conv.padding[0],
                          bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(conv.weight[index])
        if conv.bias is not None:
            out.bias.copy_(conv.bias[index])
    return out.requires_grad_(False)


def reduced(module: torch.nn.Module, group: Any) -> None:
    """Sum `module`'s output over the ranks after its own forward (its inner rows are split)."""
    inner = module.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        dist.all_reduce(out, group=group)
        return out

    module.forward = forward


def spans_heads(norm: Any, head_dim: int) -> bool:
    """Whether `norm` is an RMS norm (weight times x over its root mean square, no bias) over every
    head's channels at once (OLMo's q/k norms), not each head's."""
    weight = getattr(norm, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() > head_dim
            and hasattr(norm, "variance_epsilon") and getattr(norm, "bias", None) is None)


class SplitRMSNorm(torch.nn.Module):
    """An RMS norm over channels the ranks share out: the mean square is summed over the ranks, so
    each rank scales its channels as the whole norm would, and keeps its channels' weights."""

    def __init__(self, norm: torch.nn.Module, index: torch.Tensor, group: Any, cast_first: bool = False) -> None:
        super().__init__()
        self.weight = parameter(norm.weight[index])
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
