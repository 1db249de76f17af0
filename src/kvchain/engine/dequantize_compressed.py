"""Weights stored in the compressed-tensors layouts (`quant_method: compressed-tensors`), dequantised.

The layout many 8-bit releases ship in (`-FP8-dynamic`, `-W8A8` and block-FP8 checkpoints made with
llm-compressor): `X.weight` in float8 e4m3 (`float-quantized`) or int8 (`int-quantized`,
`naive-quantized`) beside `X.weight_scale`, and for an asymmetric int scheme `X.weight_zero_point`.
The value is `(stored - zero_point) * scale`, the scale laid out by the weights' `strategy`: one for
the tensor, one per output row (`channel`), one per `group_size` inputs of each row (`group`), or one
per `block_structure` block (`block`, ragged edge blocks included). Activation scales
(`input_scale`, `input_zero_point`) are dropped: they scale 8-bit activations, and the dequantised
model computes in float. Packed layouts (`pack-quantized`: several 4-bit values per int32) and
activation-ordered groups (`weight_g_idx`) are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from .block_scales import fp8_blocks_to_float

#: the formats whose weights are stored one value per element
ELEMENT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
STRATEGIES = ("tensor", "channel", "group", "block")
SCALE = ".weight_scale"
ZERO_POINT = ".weight_zero_point"
#: what an 8-bit weight may carry beside its scale, unused once the model computes in float
ACTIVATION_FIELDS = (".input_scale", ".input_zero_point")


def dequantize_compressed(path: Path, quant: dict[str, Any], state: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with each compressed-tensors weight replaced by its value in `dtype`."""
    where = f"checkpoint {path}"
    fmt, weights = _scheme(where, quant)
    out = dict(state)
    for name in state:
        if name.endswith(".weight_g_idx"):
            raise InputError(f"{where}: {name!r}: activation-ordered groups (weight_g_idx) are not dequantised here")
        if not name.endswith(SCALE):
            continue
        stem = name[: -len(SCALE)]
        weight = state.get(stem + ".weight")
        if weight is None:
            raise InputError(f"{where}: weight scale {name!r} has no weight beside it")
        zero = state.get(stem + ZERO_POINT)
        out[stem + ".weight"] = element_weights_to_float(weight, state[name], zero, weights,
                                                         f"{where}: {stem + '.weight'!r}").to(dtype)
        for extra in (SCALE, ZERO_POINT, *ACTIVATION_FIELDS):
            out.pop(stem + extra, None)
    left = sorted(n for n, t in out.items() if t.dtype in (torch.float8_e4m3fn, torch.int8))
    if left:
        raise InputError(f"{where}: {left[0]!r} is stored {out[left[0]].dtype} with no {SCALE[1:]!r} beside it "
                         f"({fmt})")
    return out


def _scheme(where: str, quant: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The format and the weights' quantisation arguments, which every config group must share."""
    fmt = quant.get("format")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InputError(f"{where}: a compressed-tensors quantization_config needs config_groups")
    schemes = []
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise InputError(f"{where}: a config group without weights arguments: {group!r}")
        fmt = group.get("format") or fmt
        schemes.append(weights)
    if fmt not in ELEMENT_FORMATS:
        raise InputError(f"{where}: compressed-tensors format {fmt!r} is not dequantised here (one value per "
                         f"element only: {', '.join(ELEMENT_FORMATS)})")
    if any(s != schemes[0] for s in schemes):
        raise InputError(f"{where}: config groups quantise weights differently; one scheme is dequantised here")
    weights = schemes[0]
    if weights.get("num_bits") != 8 or weights.get("strategy") not in STRATEGIES:
        raise InputError(f"{where}: weights of {weights.get('num_bits')!r} bits by {weights.get('strategy')!r}: "
                         f"8 bits by {', '.join(STRATEGIES)} are dequantised here")
    return fmt, weights


def element_weights_to_float(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                             scheme: dict[str, Any], where: str = "weight") -> torch.Tensor:
    """The float32 value of an 8-bit `weight` `[rows, cols]`: `(weight - zero) * scale`, scale and zero
    point laid out by the scheme's strategy."""
    if weight.dim() != 2:
        raise InputError(f"{where}: a {list(weight.shape)} weight; a 2-D matrix is dequantised here")
    rows, cols = weight.shape
    strategy = scheme["strategy"]
    values = weight.to(torch.float32)
    if zero is not None:
        values = values - _spread(zero.to(torch.float32), rows, cols, strategy, scheme, where)
    if strategy == "block":
        block = scheme.get("block_structure")
        return fp8_blocks_to_float(values, scale, block, where)
    return values * _spread(scale.to(torch.float32), rows, cols, strategy, scheme, where)


def _spread(per: torch.Tensor, rows: int, cols: int, strategy: str, scheme: dict[str, Any],
            where: str) -> torch.Tensor:
    """A scale (or zero point) of `strategy` laid over a `[rows, cols]` weight, broadcastable."""
    if strategy == "tensor":
        if per.numel() != 1:
            raise InputError(f"{where}: {per.numel()} scales for a tensor-wide scale")
        return per.reshape(())
    if strategy == "channel":
        if per.numel() != rows:
            raise InputError(f"{where}: {list(per.shape)} scales for {rows} output channels")
        return per.reshape(rows, 1)
    if strategy == "group":
        size = scheme.get("group_size")
        if not isinstance(size, int) or size <= 0 or tuple(per.shape) != (rows, -(-cols // size)):
            raise InputError(f"{where}: {list(per.shape)} scales for a [{rows}, {cols}] weight in groups of {size!r}")
        return per.repeat_interleave(size, 1)[:, :cols]
    raise InputError(f"{where}: a zero point by {strategy} is not dequantised here")
