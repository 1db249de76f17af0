"""Per-block scales laid over a quantised matrix, shared by the loader's dequantisers.

An fp8 release (`quant_method: fp8`) and compressed-tensors' `block` strategy both keep one scale per
block of rows x columns, the grid rounded up where the matrix does not divide into whole blocks
(DeepSeek-V3's 576-row latent projection in 128 x 128 blocks), or one scale for the whole tensor."""

from __future__ import annotations

import torch

from ..errors import InputError


def fp8_blocks_to_float(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None,
                        where: str = "fp8 weight") -> torch.Tensor:
    """The float32 value of an fp8 `weight` `[rows, cols]` and its scales: one per `block` (rows x
    cols, the grid rounded up at ragged edges), or a single one for the whole tensor."""
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return values * scale.reshape(())
    if weight.dim() != 2 or block is None:
        raise InputError(f"{where}: {scale.numel()} scales for a {list(weight.shape)} weight and no "
                         "2-D weight_block_size to lay them out by")
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != grid:
        raise InputError(f"{where}: its scales are {list(scale.shape)}, a {[rows, cols]} weight in "
                         f"{block[0]}x{block[1]} blocks needs {list(grid)}")
    spread = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return values * spread
