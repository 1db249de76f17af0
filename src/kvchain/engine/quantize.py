"""Rewrite a checkpoint's weights in the quantised layouts of the hub's releases.

The loader dequantises fp8-block, MXFP4 and compressed-tensors checkpoints (`dequantize.py`); none can be
downloaded here, so `quantize_checkpoint` makes one from a float checkpoint the way the releases are
laid out: DeepSeek-V3's (every projection of the decoder layers in fp8 e4m3 with a float32 scale per
block, norms, routers, embeddings and the output head left in float), GPT-OSS's (its stacked
experts as MXFP4 blocks and exponents, everything else in float), and llm-compressor's
compressed-tensors per-channel 8-bit layouts (`-FP8-dynamic`: fp8; `-W8A8`: int8). The rounding is the formats' own:
an fp8 block's scale maps its largest magnitude to e4m3's largest finite value, an MXFP4 group's
exponent puts its largest magnitude in [4, 8) and each value goes to the nearest e2m1 value."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import InputError
from .dequantize import E2M1, FP8_SCALE, MXFP4_BLOCKS, MXFP4_EXPONENT_BIAS, MXFP4_GROUP, MXFP4_SCALES

METHODS = ("fp8", "mxfp4", "compressed-fp8", "compressed-int8")
WEIGHTS_FILE = "model.safetensors"
#: e4m3's largest finite magnitude
FP8_MAX = 448.0
#: e2m1's largest exponent: a group's largest magnitude lands in [4, 8) before rounding
E2M1_EMAX = 2
#: the decoder-layer projections an fp8 release quantises: 2-D weights of the layers that are
#: neither norms nor MoE routers (`mlp.gate`, `router`)
_FP8_SKIP = re.compile(r"norm|router|\.gate\.weight$")
#: the stacked experts an MXFP4 release quantises
_MXFP4_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def quantize_checkpoint(directory: str | Path, method: str, block: int = 128) -> Path:
    """Rewrite the single-file float checkpoint in `directory` as `method` stores it (fp8 blocks of
    `block` x `block`, MXFP4 experts, or compressed-tensors per-channel fp8 or int8), its config's
    `quantization_config` set to match."""
    directory = Path(directory)
    if method not in METHODS:
        raise InputError(f"unknown quantisation {method!r}; known: {', '.join(METHODS)}")
    if block <= 0:
        raise InputError(f"an fp8 block of {block} rows and columns")
    from safetensors.torch import load_file, save_file

    file = directory / WEIGHTS_FILE
    if not file.is_file():
        raise InputError(f"{directory}: no {WEIGHTS_FILE} to quantise")
    state = load_file(file)
    if method == "fp8":
        state, count = _projections(state, lambda w: fp8_blocks(w, block), FP8_SCALE)
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [block, block]}
    elif method == "mxfp4":
        state, count = _mxfp4_state(state)
        config = {"quant_method": "mxfp4"}
    else:
        fp8 = method == "compressed-fp8"
        state, count = _projections(state, lambda w: per_channel(w, fp8), "_scale")
        config = compressed_config(method == "compressed-fp8")
    if not count:
        raise InputError(f"{directory}: no weights that a {method} release quantises")
    save_file(state, file, metadata={"format": "pt"})
    config_file = directory / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "quantization_config": config},
                                      indent=2) + "\n")
    return directory


def _projections(state: dict[str, torch.Tensor], encode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 scale_suffix: str) -> tuple[dict[str, torch.Tensor], int]:
    """`state` with each decoder-layer projection (a 2-D weight that is neither a norm nor a MoE
    router) stored as `encode` stores it, its scale beside it under `name + scale_suffix`; and how
    many were."""
    out, count = {}, 0
    for name, tensor in state.items():
        if ".layers." in name and name.endswith(".weight") and tensor.dim() == 2 and not _FP8_SKIP.search(name):
            out[name], out[name + scale_suffix] = encode(tensor)
            count += 1
        else:
            out[name] = tensor
    return out, count


def fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[rows, cols]` in fp8 e4m3 and its float32 scale per `block` x `block` block (the
    grid rounded up: a ragged edge block has its own scale)."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block, 0, -rows % block))
    tiles = padded.unflatten(1, (-1, block)).unflatten(0, (-1, block))  # [R, block, C, block]
    scale = tiles.abs().amax((1, 3)).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    stored = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return stored.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale.contiguous()


def per_channel(weight: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[rows, cols]` with one float32 scale per output row: in fp8 e4m3 (its largest
    magnitude at 448) or symmetric int8 (at 127, rounded to the nearest)."""
    top = FP8_MAX if fp8 else 127.0
    scale = weight.float().abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    scaled = weight.float() / scale
    stored = scaled.to(torch.float8_e4m3fn) if fp8 else scaled.round().clamp(-128, 127).to(torch.int8)
    return stored.contiguous(), scale.contiguous()


def compressed_config(fp8: bool) -> dict:
    """The quantization_config llm-compressor writes for per-channel 8-bit weights with dynamic
    per-token activations (`-FP8-dynamic`, `-W8A8`)."""
    kind = "float" if fp8 else "int"
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True,
                                      "dynamic": True}}},
            "ignore": ["lm_head"]}


def _mxfp4_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    out, count = {}, 0
    for name, tensor in state.items():
        if _MXFP4_EXPERTS.search(name) and tensor.dim() == 3:
            # the checkpoint holds the experts [E, in, out]; the release packs each output row's inputs
            out[name + MXFP4_BLOCKS], out[name + MXFP4_SCALES] = mxfp4_blocks(tensor.transpose(1, 2))
            count += 1
        else:
            out[name] = tensor
    return out, count


def mxfp4_blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` `[..., n]` (n a multiple of 32) as MXFP4: blocks `[..., n / 32, 16]` (two e2m1 codes
    per byte, the low nibble first) and biased exponents `[..., n / 32]`."""
    if values.shape[-1] % MXFP4_GROUP:
        raise InputError(f"mxfp4 packs rows of a multiple of {MXFP4_GROUP} values, not {values.shape[-1]}")
    groups = values.float().unflatten(-1, (-1, MXFP4_GROUP))
    largest = groups.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -(MXFP4_EXPONENT_BIAS - 1))
    exponent = (torch.floor(torch.log2(largest)) - E2M1_EMAX).clamp(-MXFP4_EXPONENT_BIAS, MXFP4_EXPONENT_BIAS)
    scaled = groups / torch.exp2(exponent)
    magnitudes = torch.tensor(E2M1[:8])
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + MXFP4_EXPONENT_BIAS).to(torch.uint8).contiguous()
