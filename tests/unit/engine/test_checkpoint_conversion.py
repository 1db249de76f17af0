"""Checkpoints in the layout a family keeps on disk load into the modules transformers builds.

transformers 5 renames, fuses and transposes some families' tensors between the hub layout and its
modules (`conversion_mapping.py`); `save_pretrained` writes the hub layout back. Tiny checkpoints of
the MoE and renamed families must round-trip through `save_checkpoint` + `load_checkpoint` bit for
bit, a checkpoint written by hand in the hub's own layout must load too, and a checkpoint that does
not match (a missing, extra or doubly stored tensor, a wrong expert set) is one clear InputError."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.tiny import model_for_config, save_checkpoint, tiny_fields
from kvchain.errors import InputError

IDS = torch.tensor([[3, 70, 100, 5, 9, 200, 17, 42]])
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2, "mamba_d_state": 16, "mamba_n_groups": 2,
           "mamba_d_conv": 4, "mamba_chunk_size": 16}
_DELTANET = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
#: model_type -> the tiny config's fields: 4 experts, 2 per token, in every family
FAMILIES: dict[str, dict[str, Any]] = {
    "granitemoehybrid": {"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"],
                         "intermediate_size": 32, "shared_intermediate_size": 128, "num_local_experts": 4,
                         "num_experts_per_tok": 2, **_MAMBA2},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
              "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2},
    "qwen3_5_moe_text": {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
                         "num_experts_per_tok": 2, **_DELTANET},
    "lfm2_moe": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2, "intermediate_size": 128,
                 "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_dense_layers": 1,
                 "conv_L_cache": 4},
    "mixtral": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_hidden_layers": 2, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2},
    "gpt_oss": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "nemotron_h": {"num_hidden_layers": 4, "layers_block_type": ["mamba", "moe", "attention", "mlp"],
                   "intermediate_size": 128, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32},
}
#: a tensor `save_pretrained` writes for each family: the hub layout, which the modules do not hold
#: (gpt_oss keeps its fused experts on the hub too, so its file holds the module names)
ON_DISK = {
    "granitemoehybrid": "model.layers.0.block_sparse_moe.input_linear.weight",
    "jamba": "model.layers.1.feed_forward.experts.3.gate_proj.weight",
    "qwen3_5_moe_text": "model.layers.0.mlp.experts.3.up_proj.weight",
    "lfm2_moe": "model.layers.1.feed_forward.experts.3.w3.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
    "qwen2_moe": "model.layers.0.mlp.experts.3.down_proj.weight",
    "olmoe": "model.layers.0.mlp.experts.3.gate_proj.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.3.up_proj.weight",
    "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj",
    "nemotron_h": "backbone.layers.1.mixer.experts.3.up_proj.weight",
}


def make_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 model of `model_type`, every matrix drawn from N(0, INIT_STD) so logits are not flat."""
    config = tiny_fields(model_type, tie_word_embeddings=False, **FAMILIES[model_type])
    model = model_for_config(config, seed=seed)
    # as the loader leaves it: with grad off, e.g. Jamba's scan runs another matmul path, last bits differ
    model.requires_grad_(False)
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {model_type: make_model(model_type, seed=1) for model_type in FAMILIES}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, models: dict[str, torch.nn.Module]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conversion")
    return {model_type: save_checkpoint(model, root / model_type) for model_type, model in models.items()}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_save_pretrained_layout_round_trips(
    model_type: str, models: dict[str, torch.nn.Module], saved: dict[str, Path]
) -> None:
    assert ON_DISK[model_type] in load_file(saved[model_type] / "model.safetensors")
    model = load_checkpoint(saved[model_type]).model
    want = models[model_type].state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
    assert torch.equal(logits(model), logits(models[model_type]))


# --- checkpoints written by hand in the hub's layout, independent of transformers' save path -------


def _mixtral_hub(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral on the hub: `block_sparse_moe.` modules, experts `w1` (gate), `w3` (up), `w2` (down)."""
    out = _per_expert(state, "mlp.experts.", ("w1", "w3", "w2"))
    return {name.replace(".mlp.", ".block_sparse_moe."): tensor for name, tensor in out.items()}


def _qwen3_moe_hub(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-MoE on the hub: one `gate_proj` / `up_proj` / `down_proj` linear per expert."""
    return _per_expert(state, "mlp.experts.", ("gate_proj", "up_proj", "down_proj"))


def _granite_hub(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Granite 4.0-H on the hub: fused experts as `input_linear` / `output_linear`, router `router.layer`."""
    renames = {".experts.gate_up_proj": ".input_linear.weight", ".experts.down_proj": ".output_linear.weight",
               ".router.weight": ".router.layer.weight"}
    out = {}
    for name, tensor in state.items():
        for old, new in renames.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        out[name] = tensor
    return out


def _per_expert(state: dict[str, torch.Tensor], experts: str, parts: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """Split fused `{experts}gate_up_proj` (gate rows first) and `{experts}down_proj` into one matrix
    per expert named `{experts}{e}.{part}.weight`."""
    gate, up, down = parts
    out = {}
    for name, tensor in state.items():
        if name.endswith(f"{experts}gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, fused in enumerate(tensor):
                out[f"{base}{e}.{gate}.weight"], out[f"{base}{e}.{up}.weight"] = fused.chunk(2, dim=0)
        elif name.endswith(f"{experts}down_proj"):
            base = name[: -len("down_proj")]
            for e, matrix in enumerate(tensor):
                out[f"{base}{e}.{down}.weight"] = matrix
        else:
            out[name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


HUB_LAYOUTS: dict[str, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "mixtral": _mixtral_hub,
    "qwen3_moe": _qwen3_moe_hub,
    "granitemoehybrid": _granite_hub,
}


def write_hub(model_type: str, model: torch.nn.Module, out: Path) -> Path:
    """The checkpoint of `model` with its tensors written in the hub layout of `model_type`."""
    save_checkpoint(model, out)
    save_file(HUB_LAYOUTS[model_type](dict(model.state_dict())), out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, models: dict[str, torch.nn.Module]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    return {model_type: write_hub(model_type, models[model_type], root / model_type) for model_type in HUB_LAYOUTS}


@pytest.mark.parametrize("model_type", list(HUB_LAYOUTS))
def test_hub_layout_loads(model_type: str, models: dict[str, torch.nn.Module], hub: dict[str, Path]) -> None:
    names = set(load_file(hub[model_type] / "model.safetensors"))
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    model = load_checkpoint(hub[model_type]).model
    for name, tensor in models[model_type].state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert torch.equal(logits(model), logits(models[model_type]))


def test_hub_nemotron_h_backbone_prefix_loads(models: dict[str, torch.nn.Module], saved: dict[str, Path]) -> None:
    names = load_file(saved["nemotron_h"] / "model.safetensors")
    assert all(name.startswith(("backbone.", "lm_head.")) for name in names)
    assert torch.equal(logits(load_checkpoint(saved["nemotron_h"]).model), logits(models["nemotron_h"]))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_engine_serves_converted_checkpoint_like_transformers(
    model_type: str, models: dict[str, torch.nn.Module], saved: dict[str, Path], hub: dict[str, Path]
) -> None:
    """The engine serves a converted MoE checkpoint (Mixtral in the hub's own layout, Qwen2-MoE as
    `save_pretrained` writes it) token for token like transformers' greedy `generate`."""
    from transformers import GenerationConfig

    from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest

    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = models[model_type].generate(IDS, attention_mask=torch.ones_like(IDS), generation_config=config)
    want = out[0, IDS.shape[1] :].tolist()
    path = hub.get(model_type, saved[model_type])
    with Engine(path, EngineConfig(budget_bytes=8 * 2**20, page_size=4, context_len=128)) as engine:
        got = engine.generate([GenerateRequest(IDS[0].tolist(), max_new_tokens=8)]).outputs[0].token_ids
    assert got == want
    assert len(set(want)) > 1  # not one token repeated: the experts shape the output


# --- a checkpoint that does not match is refused, naming the tensor ---------------------------------

MISSING_EXPERT = "model.layers.0.mlp.experts.3.down_proj.weight"


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        del state[name]
    return edit


def _rename(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda state: state.update({new: state.pop(old)})


def _add(name: str, like: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda state: state.update({name: state[like].clone()})


def _reshape_one(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda state: state.update({name: torch.zeros(state[name].shape[0] + 1, state[name].shape[1])})


def _grow_all(part: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        for name in [n for n in state if n.endswith(f".{part}.weight") and ".experts." in n]:
            state[name] = torch.zeros(state[name].shape[0] + 2, state[name].shape[1])
    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop(MISSING_EXPERT),
         r"'model\.layers\.0\.mlp\.experts\.\*\.down_proj\.weight' holds experts \[0, 1, 2\], "
         r"'model\.layers\.0\.mlp\.experts\.down_proj' needs experts 0\.\.3"),
        (_rename(MISSING_EXPERT, "model.layers.0.mlp.experts.4.down_proj.weight"),
         r"holds experts \[0, 1, 2, 4\], 'model\.layers\.0\.mlp\.experts\.down_proj' needs experts 0\.\.3"),
        (_add("model.layers.1.mlp.experts.4.gate_proj.weight", "model.layers.1.mlp.experts.0.gate_proj.weight"),
         r"'model\.layers\.1\.mlp\.experts\.\*\.gate_proj\.weight' holds experts \[0, 1, 2, 3, 4\]"),
        (_drop("model.layers.1.mlp.experts.2.up_proj.weight"),
         r"'model\.layers\.1\.mlp\.experts\.\*\.up_proj\.weight' holds experts \[0, 1, 3\]"),
        (lambda state: [state.pop(n) for n in list(state) if n.startswith("model.layers.1.mlp.experts.")
                        and n.endswith(".up_proj.weight")],
         r"'model\.layers\.1\.mlp\.experts\.gate_up_proj' is built from .*up_proj.*: the checkpoint has no "
         r"'model\.layers\.1\.mlp\.experts\.\*\.up_proj\.weight'"),
        (_add("model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.0.down_proj.weight"),
         r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj' is stored twice"),
        (_add("model.layers.0.mlp.extra.weight", "model.norm.weight"),
         r"unexpected tensors \[model\.layers\.0\.mlp\.extra\.weight\] \(1 in all\)"),
        (_drop("model.layers.1.mlp.gate.weight"), r"missing tensors \[model\.layers\.1\.mlp\.gate\.weight\]"),
        (_reshape_one("model.layers.0.mlp.experts.2.gate_proj.weight"),
         r"cannot build 'model\.layers\.0\.mlp\.experts\.gate_up_proj' from "
         r"'model\.layers\.0\.mlp\.experts\.\*\.gate_proj\.weight'.*stack expects each tensor to be equal size"),
        (_grow_all("down_proj"),
         r"'model\.layers\.0\.mlp\.experts\.down_proj' has shape \(4, 66, 32\), the model expects \(4, 64, 32\)"),
    ],
    ids=["missing-expert", "expert-gap", "extra-expert", "missing-up-expert", "missing-up-part",
         "fused-and-per-expert", "unexpected", "missing-router", "one-expert-shape", "all-experts-shape"],
)
def test_broken_hub_layout_refused(edit, message: str, hub: dict[str, Path], tmp_path: Path) -> None:
    _assert_load_error(_rewrite(hub["qwen3_moe"], tmp_path, edit), message)


def test_granite_missing_router_named_by_module(hub: dict[str, Path], tmp_path: Path) -> None:
    out = _rewrite(hub["granitemoehybrid"], tmp_path, _drop("model.layers.1.block_sparse_moe.router.layer.weight"))
    _assert_load_error(out, r"missing tensors \[model\.layers\.1\.block_sparse_moe\.router\.weight\] \(1 in all\)")


def test_granite_extra_hub_tensor_refused(hub: dict[str, Path], tmp_path: Path) -> None:
    extra = "model.layers.0.block_sparse_moe.input_linear.bias"
    out = _rewrite(hub["granitemoehybrid"], tmp_path, _add(extra, "model.norm.weight"))
    _assert_load_error(out, rf"unexpected tensors \[{extra.replace('.', '[.]')}\]")


def test_nemotron_h_prefixed_and_module_name_both_stored(saved: dict[str, Path], tmp_path: Path) -> None:
    out = _rewrite(saved["nemotron_h"], tmp_path, _add("model.norm_f.weight", "backbone.norm_f.weight"))
    _assert_load_error(out, r"tensor 'model\.norm_f\.weight' is stored twice, as 'backbone\.norm_f\.weight' "
                            r"and as 'model\.norm_f\.weight'")


def test_mixtral_missing_hub_expert_named(hub: dict[str, Path], tmp_path: Path) -> None:
    out = _rewrite(hub["mixtral"], tmp_path, _drop("model.layers.1.block_sparse_moe.experts.0.w2.weight"))
    _assert_load_error(out, r"'model\.layers\.1\.block_sparse_moe\.experts\.\*\.w2\.weight' holds experts "
                            r"\[1, 2, 3\], 'model\.layers\.1\.mlp\.experts\.down_proj' needs experts 0\.\.3")


def _assert_load_error(path: Path, pattern: str) -> None:
    """load_checkpoint fails with one InputError line that names the path and matches `pattern`."""
    with pytest.raises(InputError, match=pattern) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path}: ")
    assert "\n" not in message


def _rewrite(src: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], Any]) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors")
    return out
