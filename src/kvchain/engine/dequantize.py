"""Weights a checkpoint stores quantised, turned back into the float matrices the modules hold.

Several families are published only, or first, in a quantised form: GPT-OSS's experts in MXFP4,
DeepSeek-V3/R1 and many `-FP8` releases in fp8 blocks. The engine computes in the load dtype, as
transformers does on a machine without the formats' kernels, so the loader dequantises on read:

- **fp8 blocks** (`quant_method: fp8`): `X.weight` in float8 (e4m3 or e5m2) beside
  `X.weight_scale_inv` in float, one scale per `weight_block_size` block (rows x columns; a ragged
  last block has a scale of its own, as DeepSeek-V3's 576-row latent projection does) or one for the
  whole tensor. The value is the stored one times its block's scale. Activation scales are dropped:
  they scale fp8 activations, and the dequantised model computes in float.
- **MXFP4** (`quant_method: mxfp4`): `X_blocks` (uint8, `[..., rows, G, 16]`, two e2m1 values per
  byte, the low nibble first) beside `X_scales` (uint8, `[..., rows, G]`, a power-of-two exponent
  biased by 127 for each 32 values). The values form `[..., rows, 32 G]`, each row one output's
  inputs; stacked experts `[E, out, in]` are turned to `[E, in, out]`, as GPT-OSS's experts hold them.

- **compressed-tensors** 8-bit layouts (`dequantize_compressed.py`).

Every other method that stores packed tensors is refused with its name. Problems (a packed tensor
without its scale, a scale grid that does not tile the weight) are one `InputError` line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from .block_scales import fp8_blocks_to_float
from .dequantize_compressed import dequantize_compressed

FP8_SCALE = "_scale_inv"
#: what an fp8 weight may carry beside its scale: activation scales, unused once dequantised
FP8_ACTIVATION_SCALES = ("input_scale", "activation_scale")
MXFP4_BLOCKS = "_blocks"
MXFP4_SCALES = "_scales"
#: values per MXFP4 scale, and per byte
MXFP4_GROUP = 32
#: e2m1 by its 4-bit code: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_EXPONENT_BIAS = 127
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: dtypes a quantised checkpoint stores its weights (or their packed blocks) in (GPTQ and AWQ pack int4 in int32)
PACKED_DTYPES = (*_FP8, torch.uint8, torch.int8, torch.int32)


def dequantize_state(path: Path, config_dict: dict[str, Any], state: dict[str, torch.Tensor],
                     shapes: dict[str, torch.Size], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`state` with every quantised weight replaced by its value in `dtype` (computed in float32, one
    tensor at a time, so a release never lies in memory whole in float32; `shapes`: the model's own
    tensor shapes by name, which unpacked MXFP4 tensors must match). A checkpoint
    without `quantization_config`, or whose tensors are all float, is returned as it is."""
    quant = config_dict.get("quantization_config")
    packed = sorted(name for name, tensor in state.items() if tensor.dtype in PACKED_DTYPES)
    if quant is None or not packed:
        return state
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        return _dequantize_fp8(path, quant, state, dtype)
    if method == "mxfp4":
        return _dequantize_mxfp4(path, state, shapes, dtype)
    if method == "compressed-tensors":
        return dequantize_compressed(path, quant, state, dtype)
    raise InputError(f"checkpoint {path}: its weights are quantised ({method or '?'}: {len(packed)} tensors such "
                     f"as {packed[0]!r}); kvchain's loader dequantises fp8 blocks, mxfp4 and 8-bit "
                     "compressed-tensors only: use the model's 16-bit release or a dequantised copy")


def _dequantize_fp8(path: Path, quant: dict[str, Any], state: dict[str, torch.Tensor],
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    block = quant.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise InputError(f"checkpoint {path}: quantization_config weight_block_size must be two positive "
                         f"integers, got {block!r}")
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith(FP8_SCALE):
            if name[: -len(FP8_SCALE)] not in state:
                raise InputError(f"checkpoint {path}: fp8 scale {name!r} has no weight beside it")
            continue
        if tensor.dtype not in _FP8:
            continue
        scale = state.get(name + FP8_SCALE)
        if scale is None:
            raise InputError(f"checkpoint {path}: fp8 weight {name!r} has no {name + FP8_SCALE!r}")
        out[name] = fp8_blocks_to_float(tensor, scale, block, f"checkpoint {path}: {name!r}").to(dtype)
        del out[name + FP8_SCALE]
        stem = name.rsplit(".", 1)[0]
        for extra in FP8_ACTIVATION_SCALES:
            out.pop(f"{stem}.{extra}", None)
    return out


def _dequantize_mxfp4(path: Path, state: dict[str, torch.Tensor], shapes: dict[str, torch.Size],
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = dict(state)
    for name in state:
        if name.endswith(MXFP4_SCALES) and name[: -len(MXFP4_SCALES)] + MXFP4_BLOCKS not in state:
            raise InputError(f"checkpoint {path}: mxfp4 scales {name!r} have no blocks beside them")
        if not name.endswith(MXFP4_BLOCKS):
            continue
        stem = name[: -len(MXFP4_BLOCKS)]
        scales = state.get(stem + MXFP4_SCALES)
        if scales is None:
            raise InputError(f"checkpoint {path}: mxfp4 blocks {name!r} have no {stem + MXFP4_SCALES!r}")
        values = mxfp4_to_float(state[name], scales, f"checkpoint {path}: {name!r}")
        if values.dim() >= 3:  # stacked experts: the release packs [E, out, in], the model holds [E, in, out]
            values = values.transpose(-1, -2).contiguous()
        want = shapes.get(stem)
        if want is not None and values.shape != want:
            raise InputError(f"checkpoint {path}: {name!r} unpacks to {list(values.shape)}, the model's "
                             f"{stem!r} is {list(want)}")
        del out[name], out[stem + MXFP4_SCALES]
        out[stem] = values.to(dtype)
    return out


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor, where: str = "mxfp4 blocks") -> torch.Tensor:
    """The float32 values `[..., rows, 32 G]` of MXFP4 `blocks` `[..., rows, G, 16]` and their
    exponents `scales` `[..., rows, G]`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise InputError(f"{where}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise InputError(f"{where}: blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                         f"({MXFP4_GROUP // 2} bytes per scale)")
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # low nibble first
    exponents = scales.to(torch.int32) - MXFP4_EXPONENT_BIAS
    values = torch.ldexp(table[codes.long()], exponents.unsqueeze(-1))
    return values.flatten(-2)
