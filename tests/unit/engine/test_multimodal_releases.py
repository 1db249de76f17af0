"""Releases whose architecture is multimodal serve their text model: Gemma 3 (the wrapper is what
`AutoModelForCausalLM` builds), Llama 4 (its causal LM is the text model alone: the release's vision
tower and projector are left unloaded) and Qwen3.5 (its class declares `model.visual` unused). Each
serves what transformers' `from_pretrained` of the same files generates, token for token."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.engine.tiny import _COMMON, model_for_config, save_checkpoint
from kvchain.errors import InputError
from support.engine import workload

TEXT = {**_COMMON, "num_hidden_layers": 4, "intermediate_size": 128, "tie_word_embeddings": False}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
#: per release: its architecture, its config's fields, and whether the text model keeps recurrent state
RELEASES = {
    "gemma3": ("Gemma3ForConditionalGeneration", {
        "text_config": {**TEXT, "model_type": "gemma3_text", "sliding_window": 16,
                        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
        "vision_config": {**VISION, "num_hidden_layers": 1}, "mm_tokens_per_image": 4,
        "image_token_index": 255, "boi_token_index": 253, "eoi_token_index": 254}, False),
    "llama4": ("Llama4ForConditionalGeneration", {
        "text_config": {**TEXT, "model_type": "llama4_text", "num_local_experts": 4, "num_experts_per_tok": 1,
                        "intermediate_size_mlp": 128, "attention_chunk_size": 16, "interleave_moe_layer_step": 1,
                        "no_rope_layers": [1, 1, 1, 0]},
        "vision_config": {**VISION, "num_hidden_layers": 1, "vision_output_dim": 32, "projector_input_dim": 32,
                          "projector_output_dim": 64}, "image_token_index": 255}, False),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", {
        "text_config": {**TEXT, "model_type": "qwen3_5_text",
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64}}, True),
}
N = 6


@functools.cache
def _release(name: str, root: Path) -> Path:
    architecture, fields, _state = RELEASES[name]
    config = transformers.AutoConfig.for_model(name, tie_word_embeddings=False, **fields)
    config.architectures = [architecture]
    model = model_for_config(config, cls=getattr(transformers, architecture))
    return save_checkpoint(model, root / name)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("releases")


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_a_multimodal_release_serves_its_text_model_as_transformers_does(name: str, root: Path) -> None:
    path = _release(name, root)
    stored = load_file(path / "model.safetensors")
    assert any("vision" in key or "visual" in key for key in stored)  # the release holds its vision part
    config = EngineConfig(budget_bytes=4 * 2**20, page_size=4, max_running=4, max_batched_tokens=48,
                          context_len=128, checkpoint_interval=8, ignore_eos=True)
    requests = workload(N)
    with Engine(load_checkpoint(path), config) as engine:
        served = [out.token_ids for out in engine.generate(requests).outputs]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for request, tokens in zip(requests, served):
        ids = torch.tensor([list(request.prompt_token_ids)])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_new_tokens,
                                 do_sample=False, use_cache=not RELEASES[name][2], eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, ids.shape[1]:].tolist()


def test_a_tensor_outside_the_release_architecture_is_still_refused(root: Path, tmp_path: Path) -> None:
    """Only the release architecture's own tensors are set aside: one it does not hold is refused."""
    out = tmp_path / "llama4"
    shutil.copytree(_release("llama4", root), out)
    state = load_file(out / "model.safetensors")
    state["vision_model.extra.weight"] = torch.ones(2)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"unexpected tensors \[vision_model\.extra\.weight\]"):
        load_checkpoint(out)
