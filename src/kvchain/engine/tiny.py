"""Tiny random checkpoints of the families the engine serves, written the way real ones are.

The engine's tests compare it with `transformers` token for token; they need checkpoints that load
through the same path as a downloaded one (config.json, safetensors, tokenizer files) yet build in
milliseconds and need no network. `make_checkpoint` writes one such directory.

Token ids: the tokenizer is byte level with no special tokens, id b is byte b, so it fills the
256-entry vocab exactly and decodes any id. bos, eos and pad are all None (in the config and the
generation config), so greedy generation always runs to `max_new_tokens`; pass `eos_token_id=...`
as an override to get a stopping model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError

VOCAB_SIZE = 256
HIDDEN = 64
INIT_STD = 0.2

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "dtype": "float32",
}


def _llama() -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "tie_word_embeddings": True,  # the loader restores a head the file stores once
    }


def _gemma3() -> dict[str, Any]:
    # gemma3_text is the causal-LM half of Gemma 3 (the multimodal wrapper adds only a vision tower).
    return {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        # untied: Gemma scales its input embeddings by sqrt(hidden), and a tied random head then reads
        # the last token back, so greedy decoding repeats one token
        "tie_word_embeddings": False,
    }


def _gpt_oss() -> dict[str, Any]:
    return {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }


def _qwen3_next() -> dict[str, Any]:
    return {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
    }


def _nemotron_h() -> dict[str, Any]:
    return {
        "model_type": "nemotron_h",
        "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "tie_word_embeddings": False,
    }


def _lfm3() -> dict[str, Any]:
    # short-conv, sliding and full attention layers: the pool plans three sub-pools (state, window,
    # full), so the window band floats between the chain's two ends
    return {
        "model_type": "lfm3",
        "num_hidden_layers": 4,
        "layer_types": ["conv", "sliding_attention", "conv", "full_attention"],
        "intermediate_size": 128,
        "conv_L_cache": 4,
        "sliding_window": 16,
        "tie_word_embeddings": False,
    }


def _sliding(model_type: str, **extra: Any) -> Callable[[], dict[str, Any]]:
    """A sliding-window family: three window layers of 16 tokens, then one full-attention layer."""
    def config() -> dict[str, Any]:
        return {"model_type": model_type, "num_hidden_layers": 4, "intermediate_size": 128, "sliding_window": 16,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "tie_word_embeddings": False,
                **extra}
    return config


def _mistral() -> dict[str, Any]:
    # every layer slides over the same window: the plan has a window sub-pool and the token-id owner
    return {"model_type": "mistral", "num_hidden_layers": 2, "intermediate_size": 128, "sliding_window": 16,
            "tie_word_embeddings": False}


def _qwen3() -> dict[str, Any]:
    return {"model_type": "qwen3", "num_hidden_layers": 2, "intermediate_size": 128, "tie_word_embeddings": False}


def _lfm2() -> dict[str, Any]:
    # short-conv state and full attention: LFM2's conv is LFM3's layer
    return {"model_type": "lfm2", "num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2,
            "intermediate_size": 128, "conv_L_cache": 4, "tie_word_embeddings": False}


FAMILIES: dict[str, Callable[[], dict[str, Any]]] = {
    "llama": _llama,
    "gemma3": _gemma3,
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen3_next,
    "nemotron_h": _nemotron_h,
    "lfm3": _lfm3,
    "mistral": _mistral,
    "qwen3": _qwen3,
    "gemma2": _sliding("gemma2"),
    "olmo3": _sliding("olmo3"),
    "cohere2": _sliding("cohere2"),
    "lfm2": _lfm2,
}


def tiny_config(family: str, **overrides: Any):
    """The transformers config object of `family`'s tiny model, `overrides` applied last."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise InputError(f"unknown tiny checkpoint family {family!r} (known: {', '.join(FAMILIES)})")
    fields = {**_COMMON, **FAMILIES[family](), **overrides}
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def make_model(family: str, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny fp32 causal LM of `family` in eval mode, its weights drawn from `seed`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def make_checkpoint(family: str, out_dir: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random checkpoint of `family` (config, safetensors, generation config,
    tokenizer) into `out_dir` and return it."""
    return save_checkpoint(make_model(family, seed=seed, **overrides), out_dir)


def save_checkpoint(model: torch.nn.Module, out_dir: Path) -> Path:
    """Write `model` (its config, generation config and safetensors weights, in the layout
    `save_pretrained` gives the hub) and the byte tokenizer into `out_dir`."""
    from transformers.utils import logging as hf_logging

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a tiny checkpoint is one shard: a bar for it is noise
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    byte_tokenizer().save_pretrained(out_dir)
    return out_dir


def byte_tokenizer():
    """A byte-level fast tokenizer built offline: id b is byte b, no special tokens, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_chars().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False)


def _byte_chars() -> dict[int, str]:
    """The printable stand-in of each byte that byte-level pre-tokenizers use: printable Latin-1
    bytes map to themselves, the rest to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    kept = set(keep)
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in kept:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Redraw every matrix (linear, embedding, conv and expert weights) from N(0, INIT_STD): the
    defaults (std 0.02) give near-flat logits whose greedy argmax is decided by noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * INIT_STD)
