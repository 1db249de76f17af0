"""Tiny checkpoints written by `make_checkpoint` load back through `load_checkpoint` bit for bit, plan
into the sub-pools their family needs, and every broken checkpoint fails with one clear InputError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvchain.engine.checkpoint import LoadedCheckpoint, load_checkpoint
from kvchain.engine.tiny import FAMILIES, VOCAB_SIZE, make_checkpoint, make_model, save_checkpoint
from kvchain.errors import InputError, KVChainError
from kvchain.plan import PoolKind, plan_kv_storage

IDS = torch.tensor([[3, 70, 100, 5, 9, 200, 17, 42, 255, 0, 128, 64]])
POOL_KINDS = {
    "llama": {PoolKind.FULL},
    "gemma3": {PoolKind.FULL, PoolKind.WINDOW},
    "gpt_oss": {PoolKind.FULL, PoolKind.WINDOW},
    "qwen3_next": {PoolKind.FULL, PoolKind.STATE},
    "nemotron_h": {PoolKind.FULL, PoolKind.STATE},
    "lfm3": {PoolKind.FULL, PoolKind.WINDOW, PoolKind.STATE},
    # every layer slides: the window sub-pool and the token-id owner (a FULL pool with no layers)
    "mistral": {PoolKind.FULL, PoolKind.WINDOW},
    "qwen3": {PoolKind.FULL},
    **dict.fromkeys(("gemma2", "olmo3", "cohere2"), frozenset({PoolKind.FULL, PoolKind.WINDOW})),
    # Llama 4: chunked layers (a window sub-pool that retires by chunk) and a global one
    "llama4": frozenset({PoolKind.FULL, PoolKind.WINDOW}),
    "mimo_v2_flash": frozenset({PoolKind.FULL, PoolKind.WINDOW}),
    **dict.fromkeys(("lfm2", "bamba", "granitemoehybrid", "falcon_h1", "qwen3_5", "qwen3_5_moe", "olmo_hybrid",
                     "jamba", "minimax", "kimi_linear", "bailing_hybrid"), frozenset({PoolKind.FULL, PoolKind.STATE})),
    # every layer keeps Mamba state, and the hybrid layers attend too (KV beside their state)
    **dict.fromkeys(("zamba", "zamba2"), frozenset({PoolKind.FULL, PoolKind.STATE})),
    # state only: the state sub-pool and the token-id owner
    **dict.fromkeys(("mamba2", "mamba", "falcon_mamba"), frozenset({PoolKind.FULL, PoolKind.STATE})),
    **dict.fromkeys(("lara_mini", "recurrent_gemma"), frozenset({PoolKind.FULL, PoolKind.WINDOW, PoolKind.STATE})),
    # latent attention on every layer: one full sub-pool of latents
    **dict.fromkeys(("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "longcat_flash", "minicpm3", "youtu",
                     "deepseek_v32", "glm_moe_dsa", "hy_v4"), frozenset({PoolKind.FULL})),
}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@pytest.fixture(scope="module")
def saved_models() -> dict[str, torch.nn.Module]:
    return {family: make_model(family, seed=1) for family in FAMILIES}


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, saved_models: dict[str, torch.nn.Module]
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: save_checkpoint(model, root / family) for family, model in saved_models.items()}


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, Path]) -> dict[str, LoadedCheckpoint]:
    return {family: load_checkpoint(path) for family, path in checkpoints.items()}


@pytest.fixture(scope="module")
def llama_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_logits_equal_saved_model(
    family: str, saved_models: dict[str, torch.nn.Module], loaded: dict[str, LoadedCheckpoint]
) -> None:
    ckpt = loaded[family]
    assert not ckpt.model.training
    assert all(not p.requires_grad for p in ckpt.model.parameters())
    assert all(p.dtype == torch.float32 for p in ckpt.model.parameters())
    expected, got = _logits(saved_models[family]), _logits(ckpt.model)
    assert torch.equal(got, expected)
    top2 = expected.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3  # greedy argmax is not a tie
    assert expected.std() > 0.5  # logits are not flat
    assert ckpt.eos_token_ids == ()
    assert ckpt.config.model_type == ckpt.config_dict["model_type"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_spec_plans_family_pools(family: str, loaded: dict[str, LoadedCheckpoint]) -> None:
    spec = loaded[family].model_spec()
    plan = plan_kv_storage(spec.decls, page_size=4)
    assert {pool.kind for pool in plan.sub_pools} == POOL_KINDS[family]
    windows = {pool.window for pool in plan.sub_pools if pool.kind is PoolKind.WINDOW}
    assert windows <= {16}
    assert all(d.dtype == "float32" for d in spec.decls if hasattr(d, "dtype"))


def test_model_spec_kv_dtype_override(loaded: dict[str, LoadedCheckpoint]) -> None:
    ckpt = loaded["llama"]
    small = plan_kv_storage(ckpt.model_spec(kv_dtype="bfloat16").decls, page_size=4)
    full = plan_kv_storage(ckpt.model_spec().decls, page_size=4)
    assert small.sub_pools[0].page_bytes * 2 == full.sub_pools[0].page_bytes


def test_load_in_bfloat16_casts_and_sets_kv_dtype(
    llama_dir: Path, loaded: dict[str, LoadedCheckpoint]
) -> None:
    half = load_checkpoint(llama_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())
    reference = dict(loaded["llama"].model.named_parameters())
    for name, param in half.model.named_parameters():
        assert torch.equal(param, reference[name].to(torch.bfloat16))
    small = plan_kv_storage(half.model_spec().decls, page_size=4)
    full = plan_kv_storage(loaded["llama"].model_spec().decls, page_size=4)
    assert small.sub_pools[0].page_bytes * 2 == full.sub_pools[0].page_bytes


def test_tied_embeddings_stored_once_and_shared(
    checkpoints: dict[str, Path], loaded: dict[str, LoadedCheckpoint]
) -> None:
    names = set(load_file(checkpoints["llama"] / "model.safetensors"))
    assert "lm_head.weight" not in names
    model = loaded["llama"].model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_tokenizer_round_trip(loaded: dict[str, LoadedCheckpoint]) -> None:
    tok = loaded["llama"].tokenizer
    assert tok is not None
    text = "Hello, wörld! 12 \n\ttabs"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte level, no special tokens
    assert max(ids) < VOCAB_SIZE
    assert tok.decode(ids) == text
    assert tok.decode(list(range(VOCAB_SIZE)))  # every id decodes


def test_no_tokenizer_files_gives_none(llama_dir: Path, tmp_path: Path) -> None:
    bare = _copy(llama_dir, tmp_path, drop=("tokenizer.json", "tokenizer_config.json"))
    assert load_checkpoint(bare).tokenizer is None


def test_eos_override_reaches_eos_ids(tmp_path: Path) -> None:
    path = make_checkpoint("llama", tmp_path / "eos", eos_token_id=10)
    assert load_checkpoint(path).eos_token_ids == (10,)


def test_sharded_index_loads(llama_dir: Path, tmp_path: Path, loaded: dict[str, LoadedCheckpoint]) -> None:
    out = _copy(llama_dir, tmp_path, drop=("model.safetensors",))
    state = load_file(llama_dir / "model.safetensors")
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, out / file)
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_logits(load_checkpoint(out).model), _logits(loaded["llama"].model))


def test_hub_expert_layout_fused_on_load(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """save_pretrained writes MoE experts one matrix per expert (the hub layout) and Nemotron-H under
    `backbone.`; the loader fuses and renames them into the modules' tensors."""
    names = set(load_file(checkpoints["qwen3_next"] / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    moe = {
        "layers_block_type": ["mamba", "moe", "attention", "mlp"],
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    }
    path = make_checkpoint("nemotron_h", tmp_path / "moe", seed=2, **moe)
    names = set(load_file(path / "model.safetensors"))
    assert "backbone.layers.1.mixer.experts.3.up_proj.weight" in names
    loaded = load_checkpoint(path)
    assert torch.equal(_logits(loaded.model), _logits(make_model("nemotron_h", seed=2, **moe)))


def test_unknown_family_names_known_ones(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"unknown tiny checkpoint family 'no_such_family'.*llama.*nemotron_h"):
        make_checkpoint("no_such_family", tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    _assert_load_error(tmp_path / "nope", r"nope: no such directory")
    (tmp_path / "a-file").write_text("{}")
    _assert_load_error(tmp_path / "a-file", r"a-file: not a directory")  # it said "no such directory"


def test_missing_config(llama_dir: Path, tmp_path: Path) -> None:
    _assert_load_error(_copy(llama_dir, tmp_path, drop=("config.json",)), r"no config\.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"config\.json: invalid JSON"),
        ("[1, 2]", r"config\.json must hold a JSON object, got list"),
        ('{"hidden_size": 64}', r"config\.json has no string 'model_type'"),
        ('{"model_type": "not_a_model"}', r"model_type 'not_a_model' is unknown"),
        ('{"model_type": "llama", "hidden_size": "big"}', r"not a valid llama config: .*hidden_size"),
        ('{"model_type": "llama", "num_attention_heads": 5}', r"not a valid llama config: .*multiple"),
    ],
)
def test_bad_config(llama_dir: Path, tmp_path: Path, text: str, message: str) -> None:
    out = _copy(llama_dir, tmp_path)
    (out / "config.json").write_text(text)
    _assert_load_error(out, message)


def test_no_safetensors(llama_dir: Path, tmp_path: Path) -> None:
    _assert_load_error(_copy(llama_dir, tmp_path, drop=("model.safetensors",)), r"no \*\.safetensors files")


def test_missing_tensor(llama_dir: Path, tmp_path: Path) -> None:
    out = _rewrite(llama_dir, tmp_path, lambda s: s.pop("model.norm.weight"))
    _assert_load_error(out, r"missing tensors \[model\.norm\.weight\] \(1 in all\)")


def test_unexpected_tensor(llama_dir: Path, tmp_path: Path) -> None:
    out = _rewrite(llama_dir, tmp_path, lambda s: s.update(extra=torch.zeros(2)))
    _assert_load_error(out, r"unexpected tensors \[extra\]")


def test_shape_mismatch(llama_dir: Path, tmp_path: Path) -> None:
    out = _rewrite(llama_dir, tmp_path, lambda s: s.update({"model.norm.weight": torch.ones(32)}))
    _assert_load_error(out, r"'model\.norm\.weight' has shape \(32,\), the model expects \(64,\)")


def _with_mtp_and_old_buffers(family: str):
    """What real releases store beside the model's tensors: DeepSeek-V3's multi-token-prediction
    layer 61 (experts per matrix, as the hub lays them out), Qwen3-Next's `mtp.` head, and the
    per-layer rotary `inv_freq` buffers of older releases."""
    def edit(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        if family == "deepseek_v3":
            state["model.layers.61.eh_proj.weight"] = torch.ones(64, 128)
            state["model.layers.61.mlp.experts.0.gate_proj.weight"] = torch.ones(32, 64)
        if family == "qwen3_next":
            state["mtp.fc.weight"] = torch.ones(64, 128)
            state["mtp.layers.0.mlp.experts.0.up_proj.weight"] = torch.ones(32, 64)
    return edit


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next", "llama"])
def test_what_a_release_stores_for_other_uses_is_left_unloaded(family: str, tmp_path: Path) -> None:
    """A release's multi-token-prediction layers and old rotary buffers, which the model class
    declares it does not use, are left unloaded as `from_pretrained` leaves them: the model is the
    one the release's own tensors make. Any other unexpected tensor is still refused."""
    source = make_checkpoint(family, tmp_path / "source", seed=1)
    out = _rewrite(source, tmp_path, _with_mtp_and_old_buffers(family))
    assert torch.equal(_logits(load_checkpoint(out).model), _logits(load_checkpoint(source).model))
    broken = _rewrite(out, tmp_path / "more", lambda s: s.update({"model.layers.0.extra.weight": torch.ones(2)}))
    _assert_load_error(broken, r"unexpected tensors \[model\.layers\.0\.extra\.weight\]")


def _int4_packed(state: dict[str, torch.Tensor]) -> None:
    """A projection packed as AWQ packs it: eight 4-bit values per int32, with scales and zeros."""
    state.pop("model.layers.0.mlp.down_proj.weight")
    state["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(128, 8, dtype=torch.int32)
    state["model.layers.0.mlp.down_proj.scales"] = torch.ones(1, 64)


def test_weights_quantised_by_another_method_are_refused_by_name(llama_dir: Path, tmp_path: Path) -> None:
    """A checkpoint packed by a method the loader does not dequantise (fp8 blocks, mxfp4 and 8-bit
    compressed-tensors only, `test_quantized_checkpoint.py`) is refused as quantised, naming the
    method and a packed tensor, not as one with missing and unexpected tensors; the same config over
    float weights (a dequantised copy that kept it) loads."""
    out = _rewrite(llama_dir, tmp_path, _int4_packed)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    _assert_load_error(out, r"weights are quantised \(awq: 1 tensors such as "
                            r"'model\.layers\.0\.mlp\.down_proj\.qweight'\); kvchain's loader dequantises fp8 "
                            r"blocks, mxfp4 and 8-bit compressed-tensors only")
    floats = _copy(llama_dir, tmp_path / "floats")
    (floats / "config.json").write_text(json.dumps({**json.loads((floats / "config.json").read_text()),
                                                    "quantization_config": config["quantization_config"]}))
    load_checkpoint(floats)


def test_corrupt_safetensors(llama_dir: Path, tmp_path: Path) -> None:
    out = _copy(llama_dir, tmp_path)
    (out / "model.safetensors").write_bytes(b"\x00" * 16)
    _assert_load_error(out, r"cannot read model\.safetensors")


def test_index_naming_missing_shard(llama_dir: Path, tmp_path: Path) -> None:
    out = _copy(llama_dir, tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_load_error(out, r"missing shard files \['model-00002-of-00002\.safetensors'\]")


def _assert_load_error(path: Path, pattern: str) -> None:
    """load_checkpoint fails with one InputError line that names the path and matches `pattern`."""
    with pytest.raises(InputError, match=pattern) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path}: ")
    assert "\n" not in message


def _copy(src: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    for name in drop:
        (out / name).unlink()
    return out


def _rewrite(src: Path, tmp_path: Path, edit) -> Path:
    out = _copy(src, tmp_path)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors")
    return out


@pytest.mark.parametrize(("field", "value"), [("num_key_value_heads", 0), ("head_dim", 0), ("eos_token_id", 10**30)])
def test_fields_transformers_would_divide_by_are_refused_first(llama_dir: Path, tmp_path: Path, field, value) -> None:
    """kvchain's own checks of the config run before transformers builds the model: a zero head
    count is a typed refusal naming the field, not a ZeroDivisionError from inside transformers."""
    out = _copy(llama_dir, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config[field] = value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(KVChainError, match=field):
        load_checkpoint(out)
