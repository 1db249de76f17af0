"""`model_from_config`: pick the family from `model_type` (or `architectures`), read the text
model's fields (nested in `text_config` for multimodal checkpoints) and build the declarations.

A model type with no family module of its own goes through the generic structural path
(`generic.py`), which reads the layer structure the config states."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..decl import FullLifetime, KVPart, StateLifetime, WindowLifetime, kv_layer_decls
from ..errors import DeclarationError, InputError
from ..units import dtype_name
from . import (
    deepseek,
    dense,
    falcon_h1,
    generic,
    hymba,
    jamba,
    longcat,
    mamba,
    nemotron_h,
    qwen3_next,
    recurrent_gemma,
    windowed,
)
from .fields import Fields
from .parts import Context, FamilyLayers
from .spec import ModelSpec

Parser = Callable[[Fields, Context, str], FamilyLayers]

#: family -> parser. The family is the parser group, named after its reference model type.
_PARSERS: dict[str, Parser] = {
    "llama": dense.parse,
    "gpt_oss": windowed.parse_gpt_oss,
    "gemma3": windowed.parse_gemma3,
    "llama4": windowed.parse_llama4,
    "mimo_v2_flash": windowed.parse_mimo_v2_flash,
    "qwen3_next": qwen3_next.parse,
    "jamba": jamba.parse,
    "nemotron_h": nemotron_h.parse,
    "falcon_h1": falcon_h1.parse,
    "deepseek_v3": deepseek.parse,
    "hymba": hymba.parse,
    "longcat_flash": longcat.parse,
    "mamba": mamba.parse,
    "recurrent_gemma": recurrent_gemma.parse,
    "generic": generic.parse,
}

#: The family of a model type no family module claims.
GENERIC = "generic"

#: model_type (top level, or of a nested text_config) -> family.
MODEL_TYPES: dict[str, str] = {
    **{t: "llama" for t in dense.MODEL_TYPES},
    "gpt_oss": "gpt_oss",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "mimo_v2_flash": "mimo_v2_flash",
    "qwen3_next": "qwen3_next",
    "jamba": "jamba",
    "nemotron_h": "nemotron_h",
    "falcon_h1": "falcon_h1",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "hymba": "hymba",
    "longcat_flash": "longcat_flash",
    **{t: "mamba" for t in (*mamba.MAMBA1_TYPES, *mamba.MAMBA2_TYPES)},
    **{t: "recurrent_gemma" for t in recurrent_gemma.MODEL_TYPES},
}

#: `architectures` entry -> model_type, for configs that omit model_type.
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Llama4ForCausalLM": "llama4_text",
    "Llama4ForConditionalGeneration": "llama4",
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",
    "Qwen3NextForCausalLM": "qwen3_next",
    "JambaForCausalLM": "jamba",
    "NemotronHForCausalLM": "nemotron_h",
    "FalconH1ForCausalLM": "falcon_h1",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "HymbaForCausalLM": "hymba",
    "LongcatFlashForCausalLM": "longcat_flash",
    "MambaForCausalLM": "mamba",
    "FalconMambaForCausalLM": "falcon_mamba",
    "Mamba2ForCausalLM": "mamba2",
    "RecurrentGemmaForCausalLM": "recurrent_gemma",
}


def model_from_config(
    config: dict,
    *,
    tp_size: int = 1,
    kv_dtype: str | None = None,
    checkpoint_interval: int | None = None,
    name: str | None = None,
) -> ModelSpec:
    """Declarations for one TP rank of the model a HF `config.json` describes.

    `kv_dtype` sets the attention KV dtype; None or "auto" means what engines use under
    `dtype="auto"`: the config's 16-bit dtype, bfloat16 for a float32 or unnamed one (an explicit
    dtype, float32 included, is kept as given). `checkpoint_interval` goes to every state part's
    `StateLifetime`. Raises `InputError` (one line naming the field and family) on a config this
    cannot read, and when `tp_size` does not divide what it must."""
    if not isinstance(config, Mapping):
        raise InputError(f"a model config must be a JSON object (dict), got {type(config).__name__}")
    tp = _tp_size(tp_size)
    model_type, family = resolve_family(config)
    fields = text_fields(config, model_type)  # messages name the model type the user wrote
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype.strip().lower() == "auto"):
        model_dtype = kv = fields.serving_dtype()
    else:
        model_dtype, kv = fields.model_dtype(), dtype_name(kv_dtype)
    lifetime = _state_lifetime(checkpoint_interval)
    ctx = Context(tp=tp, kv_dtype=kv, model_dtype=model_dtype, state_lifetime=lifetime)
    parsed = windows_covering_context_as_full(_PARSERS[family](fields, ctx, model_type))
    check_keeps_kv_or_state(fields, parsed)
    try:
        decls = tuple(kv_layer_decls(parsed.layers))
    except DeclarationError as exc:
        raise InputError(f"{family} config: {exc}") from None
    return ModelSpec(
        name=name if name is not None else _default_name(config, model_type),
        family=family,
        decls=decls,
        max_context=parsed.max_context,
        tp_size=tp,
    )


def resolve_family(config: Mapping[str, Any]) -> tuple[str, str]:
    """(model_type, family) of a config: its `model_type`, else its text_config's, else the first
    known `architectures` entry."""
    model_type = config.get("model_type")
    text = config.get("text_config")
    text_type = text.get("model_type") if isinstance(text, Mapping) else None
    if model_type is None:
        model_type = text_type
    if model_type is None:
        model_type = _from_architectures(config.get("architectures"))
    if not isinstance(model_type, str):
        raise InputError(f"config 'model_type' must be a string, got {model_type!r}")
    if model_type not in MODEL_TYPES and isinstance(text_type, str) and text_type in MODEL_TYPES:
        model_type = text_type  # a multimodal wrapper around a text model this knows
    return model_type, MODEL_TYPES.get(model_type, GENERIC)


def text_fields(config: Mapping[str, Any], family: str) -> Fields:
    """The fields of the text model: `text_config` when nested (Gemma 3, Llama 4), else the top."""
    text = config.get("text_config")
    if text is None:
        return Fields(config, family)
    if not isinstance(text, Mapping):
        raise InputError(f"{family} config: 'text_config' must be an object, got {type(text).__name__}")
    return Fields(text, family, outer=config)


def windows_covering_context_as_full(parsed: FamilyLayers) -> FamilyLayers:
    """A sliding window at least as long as the longest context the model supports never drops a
    token, so it is full attention (a context longer than the model's is refused at planning).
    Chunked attention keeps its lifetime: a chunk restarts at every boundary."""
    limit = parsed.max_context

    def full(part: KVPart) -> KVPart:
        lifetime = part.lifetime
        if isinstance(lifetime, WindowLifetime) and not lifetime.chunked and lifetime.window >= limit:
            return KVPart(part.geometry, FullLifetime())
        return part

    layers = [None if layer is None else [full(p) for p in layer] for layer in parsed.layers]
    return FamilyLayers(layers, parsed.max_context)


def check_keeps_kv_or_state(fields: Fields, parsed: FamilyLayers) -> None:
    """Refuse, naming the config field, a model with no layer that keeps KV or recurrent state. A
    model with no full-attention layer (all windows, or only recurrent state) plans with a token-id
    owner that mints the ids (DECL-4)."""
    if any(layer for layer in parsed.layers):
        return
    structure = next(
        (n for n in ("layer_types", "layers_block_type", "attn_layer_indices", "hybrid_override_pattern")
         if fields.present(n)),
        None,
    )
    raise fields.error(structure or "num_hidden_layers", "leaves no layer that keeps KV or recurrent state")


def num_model_layers(config: Mapping[str, Any]) -> int:
    """The model's layer count, KV-free layers included. Nemotron-H's layer list or pattern sets
    its depth (transformers derives num_hidden_layers from it)."""
    _model_type, family = resolve_family(config)
    fields = text_fields(config, family)
    if family == "nemotron_h":
        for name in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
            value = fields.values.get(name)
            if isinstance(value, (list, tuple, str)) and value:
                return len(value)
    if family == "longcat_flash":
        return fields.num_layers("num_layers")
    if family == GENERIC:
        return generic.with_standard_names(fields).num_layers()
    return fields.num_layers()


def _from_architectures(architectures: Any) -> str:
    if architectures is None:
        raise InputError("config has neither 'model_type' nor 'architectures'")
    if not isinstance(architectures, (list, tuple)):
        raise InputError(f"config 'architectures' must be a list, got {type(architectures).__name__}")
    for arch in architectures:
        if isinstance(arch, str) and arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise InputError(
        f"config has no 'model_type' and no known 'architectures' entry (got {list(architectures)})"
    )


def _tp_size(tp_size: Any) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InputError(f"tp_size must be a positive integer, got {tp_size!r}")
    return tp_size


def _state_lifetime(checkpoint_interval: Any) -> StateLifetime:
    if checkpoint_interval is not None and (
        isinstance(checkpoint_interval, bool)
        or not isinstance(checkpoint_interval, int)
        or checkpoint_interval < 1
    ):
        raise InputError(
            f"checkpoint_interval must be a positive integer or None, got {checkpoint_interval!r}"
        )
    return StateLifetime(checkpoint_interval)


def _default_name(config: Mapping[str, Any], model_type: str) -> str:
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and name else model_type
