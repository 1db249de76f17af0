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


def _mamba2_fields(**extra: Any) -> dict[str, Any]:
    """The Mamba2 mixer fields Bamba, Granite 4 hybrids and Falcon-H1 share: 8 heads of 16 fill the
    inner size 2 x hidden, B and C in 2 groups, and a scan chunk shorter than the prompts."""
    return {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2, "mamba_d_state": 16, "mamba_n_groups": 2,
            "mamba_d_conv": 4, "mamba_chunk_size": 16, **extra}


def _bamba() -> dict[str, Any]:
    return {"model_type": "bamba", "num_hidden_layers": 4, "attn_layer_indices": [1, 3], "intermediate_size": 128,
            "tie_word_embeddings": False, **_mamba2_fields()}


def _granitemoehybrid() -> dict[str, Any]:
    # Granite 4.0-H: 4 experts (2 per token) beside a shared MLP in every layer, no RoPE, and its mup
    # multipliers off 1 so a dropped one shows
    return {"model_type": "granitemoehybrid", "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "attention"], "intermediate_size": 32,
            "shared_intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
            "position_embedding_type": None,
            "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
            "logits_scaling": 2.0, "tie_word_embeddings": False, **_mamba2_fields()}


def _mamba2() -> dict[str, Any]:
    # attention-free: every layer keeps state only, and the plan's token-id owner mints the ids
    return {"model_type": "mamba2", "num_hidden_layers": 4, "num_heads": 8, "head_dim": 16, "expand": 2,
            "state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "tie_word_embeddings": False}


def _falcon_h1() -> dict[str, Any]:
    # every layer runs attention and Mamba2 side by side (KV and state in one layer); the mup
    # multipliers are off 1 so a dropped one shows, and the mixer's gated norm normalises first
    return {"model_type": "falcon_h1", "num_hidden_layers": 4, "intermediate_size": 128, "mamba_d_ssm": 128,
            "mamba_rms_norm": True, "mamba_norm_before_gate": True, "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.7],
            "ssm_in_multiplier": 0.9, "ssm_out_multiplier": 1.3, "attention_in_multiplier": 0.8,
            "attention_out_multiplier": 1.1, "key_multiplier": 0.7, "embedding_multiplier": 2.0,
            "lm_head_multiplier": 0.8, "mlp_multipliers": [0.9, 1.1], "tie_word_embeddings": False,
            **_mamba2_fields()}


def _gated_deltanet_fields(**extra: Any) -> dict[str, Any]:
    """The gated-DeltaNet fields Qwen3.5, OLMo Hybrid and Lara Mini share with Qwen3-Next: 2 key
    heads each serving 2 of the 4 value heads (so the grouped heads are exercised), conv width 4."""
    return {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False, **extra}


def _tiny_moe(**extra: Any) -> dict[str, Any]:
    """A sparse MLP of 4 experts, 2 per token, with a shared expert."""
    return {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, **extra}


def _qwen3_5() -> dict[str, Any]:
    # the text model of Qwen3.5: separate qkv / z / b / a projections, partial rotary on 1/4 of a head
    return {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "intermediate_size": 128,
            "layer_types": ["linear_attention", "full_attention"] * 2, **_gated_deltanet_fields()}


def _qwen3_5_moe() -> dict[str, Any]:
    return {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention"] * 2, **_tiny_moe(), **_gated_deltanet_fields()}


def _olmo_hybrid() -> dict[str, Any]:
    # q / k / v / a / b / g projections apart, and beta in [0, 2] (negative eigenvalues)
    return {"model_type": "olmo_hybrid", "num_hidden_layers": 4, "intermediate_size": 128,
            "layer_types": ["linear_attention", "full_attention"] * 2, "linear_allow_neg_eigval": True,
            **_gated_deltanet_fields()}


def _lara_mini() -> dict[str, Any]:
    # DeltaNet, sliding and full attention layers: state, window and full sub-pools
    return {"model_type": "lara_mini", "num_hidden_layers": 4, "sliding_window": 16,
            "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            **_tiny_moe(), **_gated_deltanet_fields()}


def _mamba1(model_type: str) -> Callable[[], dict[str, Any]]:
    """Mamba or Falcon-Mamba: every layer a Mamba1 mixer and none attends, so the plan is the state
    sub-pool and the token-id owner."""
    def config() -> dict[str, Any]:
        return {"model_type": model_type, "num_hidden_layers": 2, "state_size": 16, "conv_kernel": 4, "expand": 2,
                "tie_word_embeddings": False}
    return config


def _jamba() -> dict[str, Any]:
    # Mamba1 layers 0 and 2, attention layers 1 and 3 (the plan: state and full sub-pools), experts on 1 and 3
    return {"model_type": "jamba", "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
            "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
            "intermediate_size": 128, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
            "tie_word_embeddings": False}


def _recurrent_gemma() -> dict[str, Any]:
    # RG-LRU blocks 0, 1 and 3 around a local-attention block 2 over 16 tokens; an lru_width other
    # than hidden, so the state follows lru_width
    return {"model_type": "recurrent_gemma", "num_hidden_layers": 4,
            "block_types": ["recurrent", "recurrent", "attention"], "intermediate_size": 128, "lru_width": 96,
            "conv1d_width": 4, "attention_window_size": 16, "tie_word_embeddings": False}


def _llama4() -> dict[str, Any]:
    # Llama 4's text model: layers 0-2 attend within aligned chunks of 16 tokens (prompts and outputs
    # cross chunks), layer 3 is global without rope; experts on every layer beside a shared one
    return {"model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": 16,
            "intermediate_size": 32, "intermediate_size_mlp": 64, "num_local_experts": 4, "num_experts_per_tok": 1,
            "tie_word_embeddings": False}


def _mimo_v2_flash() -> dict[str, Any]:
    # MiMo-V2-Flash: a global layer, then sliding layers with twice its K/V heads and sinks; keys of
    # 24 dims (8 rotated), values of 16; experts after a first dense layer
    return {"model_type": "mimo_v2_flash", "num_hidden_layers": 4, "head_dim": 24, "v_head_dim": 16,
            "sliding_window": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "tie_word_embeddings": False}


def _bailing_hybrid() -> dict[str, Any]:
    # Bailing's hybrid (Ring-linear): Kimi-style delta attention on layers 0 and 2 (its own forget
    # gate and output gate), latent attention on layers 1 and 3, experts after a first dense layer
    return {"model_type": "bailing_hybrid", "num_hidden_layers": 4, "layer_group_size": 2, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "head_dim": 16, "num_key_value_heads": 4, "tie_word_embeddings": False}


def _minimax() -> dict[str, Any]:
    # lightning-attention layers 0, 2 and 3 around a softmax layer 1, experts on every layer; a block
    # of 16 so transformers' own forward crosses blocks within a prompt, and residual factors off 1
    return {"model_type": "minimax", "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16,
            "linear_attn_alpha_factor": 1.5, "linear_attn_beta_factor": 0.8, "full_attn_alpha_factor": 1.2,
            "mlp_alpha_factor": 0.9, "tie_word_embeddings": False}


def _mla(model_type: str, **extra: Any) -> Callable[[], dict[str, Any]]:
    """A multi-head latent attention family: a 32-dim latent and an 8-dim rope key per token (the
    pool keeps 40 numbers per token and layer, where 4 heads of K and V would take 192), a query
    LoRA, and experts after a first dense layer."""
    def config() -> dict[str, Any]:
        return {"model_type": model_type, "num_hidden_layers": 3, "intermediate_size": 128,
                "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4, "head_dim": 8,
                "tie_word_embeddings": False, **extra}
    return config


def _zamba() -> dict[str, Any]:
    # multi-head Mamba1 in every layer, and one shared attention block run before the mixer of
    # layers 1 and 3 (its uses' weights tied, as tied embeddings make transformers tie them)
    return {"model_type": "zamba", "num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid"] * 2,
            "intermediate_size": 128, "n_mamba_heads": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
            "mamba_expand": 2, "tie_word_embeddings": True}


def _zamba2() -> dict[str, Any]:
    # Mamba2 in every layer; two shared blocks alternate over hybrid layers 1, 3 and 5 (layers 1 and 5
    # run the same one), each use with its own LoRA adapters, and rotary positions. The adapters
    # need as many kv heads as heads and heads of 2 x hidden / heads
    return {"model_type": "zamba2", "num_hidden_layers": 6, "layers_block_type": ["mamba", "hybrid"] * 3,
            "intermediate_size": 128, "num_key_value_heads": 4, "head_dim": 32, "n_mamba_heads": 8,
            "mamba_d_state": 16, "mamba_ngroups": 2, "mamba_d_conv": 4, "mamba_expand": 2, "chunk_size": 16,
            "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
            "tie_word_embeddings": True}


def _kimi_linear() -> dict[str, Any]:
    # Kimi Delta Attention layers 0-2 (a decay per key channel) and a NoPE MLA layer 3, as the real
    # model groups them; no query LoRA (as the real model), experts after a first dense layer
    return {"model_type": "kimi_linear", "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1,
            "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4, "linear_num_heads": 4,
            "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}


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
    # Cohere scales its logits by 1/16 by default: at this size greedy choices would near-tie
    "cohere2": _sliding("cohere2", logit_scale=1.0),
    "lfm2": _lfm2,
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "falcon_h1": _falcon_h1,
    "mamba2": _mamba2,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "olmo_hybrid": _olmo_hybrid,
    "lara_mini": _lara_mini,
    "mamba": _mamba1("mamba"),
    "falcon_mamba": _mamba1("falcon_mamba"),
    "jamba": _jamba,
    "recurrent_gemma": _recurrent_gemma,
    "minimax": _minimax,
    "llama4": _llama4,
    "mimo_v2_flash": _mimo_v2_flash,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _bailing_hybrid,
    "zamba": _zamba,
    "zamba2": _zamba2,
    "deepseek_v3": _mla("deepseek_v3", n_group=1, topk_group=1),
    "deepseek_v2": _mla("deepseek_v2"),
    "glm4_moe_lite": _mla("glm4_moe_lite"),
    # a LongCat-Flash layer runs two attentions (num_hidden_layers counts them): two layers
    "longcat_flash": _mla("longcat_flash", num_hidden_layers=4),
    "minicpm3": _mla("minicpm3"),
    "youtu": _mla("youtu"),
    # DeepSeek-V3.2's sparse attention: an 8-head indexer with one 128-dim key per token picks 16
    # of the up to 92 earlier tokens each query reads
    "deepseek_v32": _mla("deepseek_v32", n_group=1, topk_group=1, index_n_heads=8, index_head_dim=128,
                         index_topk=16),
    # Hunyuan's HY-V4: the same sparse attention, with attention sinks and a gated output; its top-k
    # reaches every token (at 16, one pick on a near-tie flipped in 12 requests: 0.014 in one
    # request's logits), so its family check holds the latent path with sinks exactly; DeepSeek-V3.2
    # and GLM-5 hold the picks
    "hy_v4": _mla("hy_v4", n_group=1, topk_group=1, index_n_heads=8, index_head_dim=128, index_topk=128),
    # GLM-5's: its second layer reuses the first's picks (a shared indexer layer keeps no key)
    "glm_moe_dsa": _mla("glm_moe_dsa", index_n_heads=8, index_head_dim=128, index_topk=16,
                        indexer_types=["full", "shared", "full"]),
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
    return model_for_config(tiny_config(family, **overrides), seed=seed)


def tiny_fields(model_type: str, **fields: Any):
    """The config of a tiny `model_type` outside `FAMILIES`: the families' common sizes (hidden 64,
    vocab 256, 4 heads of 16, 2 key-value heads) under `fields`."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**_COMMON, **fields})


def model_for_config(config, *, seed: int = 0, cls: type | None = None) -> torch.nn.Module:
    """The fp32 causal LM of a (tiny) transformers `config` in eval mode (or the model class `cls`:
    a multimodal release's own architecture), every matrix drawn from `seed` (`_reinit`), its
    generation config's special tokens the config's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if cls is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = cls._from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    text = config.get_text_config()
    model.generation_config.bos_token_id = text.bos_token_id
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
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
