"""Quantised checkpoints (fp8 blocks, MXFP4 experts) load dequantised and serve what transformers
serves from the same files: the formats by hand, the families token for token, the bad files refused."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvchain.cli import main
from kvchain.dist.tp_engine import generate_in_ranks
from kvchain.engine.block_scales import fp8_blocks_to_float
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.dequantize import mxfp4_to_float
from kvchain.engine.dequantize_compressed import element_weights_to_float
from kvchain.engine.quantize import fp8_blocks, mxfp4_blocks, quantize_checkpoint
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.engine.tiny import make_checkpoint
from kvchain.errors import InputError
from support.engine import reference, serve, workload

N = 12
#: the released layouts: GPT-OSS's experts in MXFP4, DeepSeek-V3's projections in fp8 blocks (8 x 8
#: here, so each tiny matrix holds several blocks; transformers' dequantiser needs the blocks to tile
#: the matrix exactly, which its 128 x 128 blocks do not in DeepSeek-V3's 576-row latent projection)
QUANTISED = {"gpt_oss": ("mxfp4", 128), "deepseek_v3": ("fp8", 8)}
#: llm-compressor's compressed-tensors layouts, per channel: FP8-dynamic and W8A8 releases
COMPRESSED = {"gemma3": "compressed-fp8", "qwen3_next": "compressed-fp8", "llama": "compressed-int8"}
#: one weight each stores quantised
QUANTISED_WEIGHT = {"gpt_oss": "model.layers.0.mlp.experts.gate_up_proj",
                    "deepseek_v3": "model.layers.2.self_attn.kv_b_proj.weight"}


@functools.cache
def _compressed_dir(family: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"kvchain-{family}-compressed-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return quantize_checkpoint(make_checkpoint(family, root / family, seed=1), COMPRESSED[family])


@functools.cache
def _quantised_dir(family: str) -> Path:
    method, block = QUANTISED[family]
    root = Path(tempfile.mkdtemp(prefix=f"kvchain-{family}-{method}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return quantize_checkpoint(make_checkpoint(family, root / family, seed=1), method, block)


def test_fp8_blocks_scale_each_value_by_its_own_block() -> None:
    """A 20 x 12 weight in 8 x 8 blocks: a 3 x 2 grid whose last row and column are ragged; each
    value is its stored fp8 value times the scale of the block it lies in."""
    torch.manual_seed(0)
    weight = torch.randn(20, 12) * torch.arange(1, 13)  # columns of other magnitudes: scales differ
    stored, scale = fp8_blocks(weight, 8)
    assert stored.dtype == torch.float8_e4m3fn and list(scale.shape) == [3, 2]
    got = fp8_blocks_to_float(stored, scale, [8, 8])
    want = torch.tensor([[stored[i, j].float().item() * scale[i // 8, j // 8].item() for j in range(12)]
                         for i in range(20)])
    assert torch.equal(got, want)
    assert (got - weight).abs().max() <= weight.abs().max() / 16  # e4m3 keeps 3 mantissa bits
    assert torch.equal(fp8_blocks_to_float(stored, torch.tensor([2.0]), None), stored.float() * 2)
    with pytest.raises(InputError, match=r"its scales are \[3, 2\], a \[20, 12\] weight in 16x8 blocks needs \[2, 2\]"):
        fp8_blocks_to_float(stored, scale, [16, 8])


def test_mxfp4_codes_and_exponents_by_hand() -> None:
    """Byte 0x2F holds code 0xF (-6) in its low nibble and 0x2 (1.0) in its high one; exponent byte
    128 scales its group by 2, 125 by 1/4."""
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F
    blocks[1, 0, 15] = 0x9B  # low 0xB = -1.5, high 0x9 = -0.5
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)
    values = mxfp4_to_float(blocks, scales)
    assert values.shape == (2, 32)
    assert values[0, :2].tolist() == [-12.0, 2.0] and not values[0, 2:].any()
    assert values[1, 30:].tolist() == [-1.5 / 4, -0.5 / 4] and not values[1, :30].any()


def test_mxfp4_keeps_what_e2m1_holds_and_rounds_the_rest_to_the_nearest() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4) * torch.tensor([1.0, -1.0] * 16)
    exact = torch.stack([grid * 2.0 ** -3, grid * 2.0 ** 5])  # each row one group, exponents -3 and 5
    assert torch.equal(mxfp4_to_float(*mxfp4_blocks(exact)), exact)
    torch.manual_seed(0)
    values = torch.randn(4, 64)
    back = mxfp4_to_float(*mxfp4_blocks(values))
    largest = values.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    unit = torch.exp2(torch.floor(torch.log2(largest)) - 2)  # the group's scale: the largest lands in [4, 8)
    error = (back - values).unflatten(-1, (-1, 32)).abs()
    held = values.unflatten(-1, (-1, 32)).abs() <= 6 * unit  # e2m1 steps are at most 2 units: half of one off
    assert (error[held] <= unit.expand_as(error)[held]).all()
    assert (error[~held] <= 2 * unit.expand_as(error)[~held]).all()  # past 6 units: clipped to 6, as the format does
    assert (~held).any()


@pytest.mark.parametrize("family", sorted(QUANTISED))
def test_a_quantised_release_serves_what_transformers_serves_from_it(family: str) -> None:
    """The engine, loading the quantised files through its own loader, against transformers'
    `from_pretrained` of the same files (its own dequantiser): token for token at 12 requests. The
    quantisation changed the model: its float original's logits are elsewhere."""
    path = _quantised_dir(family)
    result = serve(family, N, poison=True, path=path)
    want, logits = reference(family, N, path, from_pretrained=True)
    assert [out.token_ids for out in result.outputs] == want
    error = max(float((result.logits[(i, j)] - logits[i][j]).abs().max()) for i in range(N) for j in range(len(want[i])))
    assert error < 1e-4
    _float_tokens, float_logits = reference(family, N)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, float_logits)) > 1e-3
    assert result.stats.compaction_moves > 0 and result.stats.cached_tokens > 0


def test_generate_serves_a_quantised_checkpoint_made_by_make_checkpoint(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "oss"
    assert main(["make-checkpoint", "gpt_oss", str(out), "--quantize", "mxfp4"]) == 0
    assert "gate_up_proj_blocks" in " ".join(load_file(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    capsys.readouterr()
    assert main(["generate", "--model-path", str(out), "--prompt", "hello", "--max-new-tokens", "4", "--json"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert len(outputs) == 1 and len(outputs[0]["token_ids"]) == 4


def test_make_checkpoint_refuses_a_quantisation_the_family_has_nothing_for(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """Llama has no stacked experts: no MXFP4 release quantises any of its weights."""
    assert main(["make-checkpoint", "llama", str(tmp_path / "l"), "--quantize", "mxfp4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no weights that a mxfp4 release quantises" in err[0]
    assert not (tmp_path / "l").exists()
    assert main(["make-checkpoint", "llama", str(tmp_path / "l"), "--fp8-block", "8"]) == 2
    assert "--fp8-block sizes the blocks of --quantize fp8" in capsys.readouterr().err


def _broken(source: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(source, out)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("family", "edit", "message"), [
    ("deepseek_v3", lambda s: s.pop("model.layers.0.mlp.down_proj.weight_scale_inv"),
     r"fp8 weight 'model\.layers\.0\.mlp\.down_proj\.weight' has no 'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv'"),
    ("deepseek_v3", lambda s: s.update({"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)}),
     r"'model\.layers\.0\.mlp\.down_proj\.weight': its scales are \[2, 2\], a \[64, 128\] weight in 8x8 blocks "
     r"needs \[8, 16\]"),
    ("deepseek_v3", lambda s: s.update({"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)}),
     r"fp8 scale 'model\.layers\.0\.mlp\.extra\.weight_scale_inv' has no weight beside it"),
    ("gpt_oss", lambda s: s.pop("model.layers.1.mlp.experts.down_proj_scales"),
     r"mxfp4 blocks 'model\.layers\.1\.mlp\.experts\.down_proj_blocks' have no "
     r"'model\.layers\.1\.mlp\.experts\.down_proj_scales'"),
    ("gpt_oss", lambda s: s.update({"model.layers.1.mlp.experts.down_proj_scales":
                                    s["model.layers.1.mlp.experts.down_proj_scales"][:, :, :1].contiguous()}),
     r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks': blocks \[4, 64, 2, 16\] and scales \[4, 64, 1\] do not pair"),
])
def test_a_broken_quantised_file_is_refused_in_one_line(family: str, edit, message: str, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=message):
        load_checkpoint(_broken(_quantised_dir(family), tmp_path, edit))


@pytest.mark.parametrize("family", sorted(QUANTISED))
def test_a_quantised_release_loads_in_the_load_dtype(family: str) -> None:
    """Loaded in bfloat16, each dequantised weight is its float32 value rounded once to bfloat16 (a
    tensor the model keeps in float32, DeepSeek's router, stays in float32)."""
    wide = load_checkpoint(_quantised_dir(family)).model.state_dict()
    narrow = load_checkpoint(_quantised_dir(family), dtype=torch.bfloat16).model.state_dict()
    assert narrow[QUANTISED_WEIGHT[family]].dtype == torch.bfloat16
    assert all(torch.equal(narrow[name], wide[name].to(narrow[name].dtype)) for name in wide)


def test_a_quantised_release_splits_over_two_ranks() -> None:
    """GPT-OSS's dequantised experts split by rank as float ones do: two ranks sample what one
    process samples from the same MXFP4 files."""
    path = str(_quantised_dir("gpt_oss"))
    config = EngineConfig(budget_bytes=4 * 2**20, page_size=4, max_running=8, max_batched_tokens=64,
                          context_len=128, ignore_eos=True, overlap=False)
    with Engine(path, config) as engine:
        one = engine.generate(workload(4))
    for run in generate_in_ranks(path, config, workload(4), 2):
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]


@pytest.mark.parametrize("family", sorted(COMPRESSED))
def test_a_compressed_tensors_release_serves_what_transformers_serves_from_it(family: str) -> None:
    """Per-channel fp8 (Gemma 3, Qwen3-Next) and int8 (Llama) weights in the compressed-tensors
    layout, against transformers' `from_pretrained` of the same files decompressed (compressed-tensors'
    own dequantisation, computed in float as the engine computes; run compressed, transformers
    quantises the activations too): token for token at 12 requests, logits within 1e-4 (5e-3 with
    Qwen3-Next's state); its float original's logits are elsewhere."""
    path = _compressed_dir(family)
    result = serve(family, N, poison=True, path=path)
    want, logits = reference(family, N, path, from_pretrained=True, decompressed=True)
    assert [out.token_ids for out in result.outputs] == want
    tolerance = 5e-3 if family == "qwen3_next" else 1e-4
    assert max(float((result.logits[(i, j)] - logits[i][j]).abs().max())
               for i in range(N) for j in range(len(want[i]))) < tolerance
    _float_tokens, float_logits = reference(family, N)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, float_logits)) > 1e-3


def test_compressed_weights_by_strategy_by_hand() -> None:
    """`(stored - zero_point) * scale`, the scale laid out per tensor, per output row, per group of
    inputs (a ragged last group) and per block (ragged edge blocks)."""
    stored = torch.arange(-12, 12, dtype=torch.int8).reshape(4, 6)
    q = stored.float()
    assert torch.equal(element_weights_to_float(stored, torch.tensor([0.5]), None, {"strategy": "tensor"}), q * 0.5)
    rows = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert torch.equal(element_weights_to_float(stored, rows, None, {"strategy": "channel"}), q * rows)
    groups = torch.tensor([[1.0, 2.0]] * 4)  # groups of 4 inputs: columns 0-3, then 4-5
    zero = torch.tensor([[1.0, -1.0]] * 4)
    want = torch.cat([(q[:, :4] - 1) * 1.0, (q[:, 4:] + 1) * 2.0], dim=1)
    got = element_weights_to_float(stored, groups, zero, {"strategy": "group", "group_size": 4})
    assert torch.equal(got, want)
    blocks = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # 3 x 4 blocks over 4 x 6: a ragged last row and column
    want = q * torch.tensor([[1.0] * 4 + [2.0] * 2] * 3 + [[3.0] * 4 + [4.0] * 2])
    assert torch.equal(element_weights_to_float(stored, blocks, None, {"strategy": "block",
                                                                      "block_structure": [3, 4]}), want)
    with pytest.raises(InputError, match=r"\[2, 2\] scales for a \[4, 6\] weight in groups of 3"):
        element_weights_to_float(stored, groups.reshape(-1)[:4].reshape(2, 2), None,
                                 {"strategy": "group", "group_size": 3})


def _compressed_config_with(path: Path, **weights) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda p, s: _compressed_config_with(p, num_bits=4), r"weights of 4 bits by 'channel'"),
    (lambda p, s: s.update({"model.layers.0.mlp.down_proj.weight_g_idx": torch.zeros(64, dtype=torch.int32)}),
     r"activation-ordered groups"),
    (lambda p, s: s.pop("model.layers.0.mlp.down_proj.weight_scale"),
     r"'model\.layers\.0\.mlp\.down_proj\.weight' is stored torch\.int8 with no 'weight_scale'"),
    (lambda p, s: s.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(3, 1)}),
     r"\[3, 1\] scales for 64 output channels"),
])
def test_a_broken_compressed_release_is_refused_in_one_line(edit, message: str, tmp_path: Path) -> None:
    out = tmp_path / "llama"
    shutil.copytree(_compressed_dir("llama"), out)
    state = load_file(out / "model.safetensors")
    edit(out, state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=message):
        load_checkpoint(out)


def test_a_packed_compressed_format_is_refused_by_name(tmp_path: Path) -> None:
    out = tmp_path / "llama"
    shutil.copytree(_compressed_dir("llama"), out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"format 'pack-quantized' is not dequantised here"):
        load_checkpoint(out)
