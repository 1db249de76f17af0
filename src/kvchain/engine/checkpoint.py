"""Load a Hugging Face checkpoint directory the way a serving engine does.

The engine runs the HF module tree but owns every byte of KV and state, so it must also own the
load: config.json picks the config class, the model is built with weight init skipped, and the
safetensors files are read and checked name by name and shape by shape before a strict
`load_state_dict`. `from_pretrained` is not used for the weights: its silent fix-ups (re-initialising
missing tensors, dropping unexpected ones) would hide a checkpoint that does not match the model.
The names and layouts do follow `from_pretrained`: transformers' own conversion mapping for the
family (`get_model_conversion_mapping`) turns the hub layout into the modules' tensors, and its
operations run here, with the checks it leaves to its loading report made errors. Weights stored
quantised (fp8 blocks, MXFP4 experts, compressed-tensors 8-bit) are dequantised as they are read
(`dequantize.py`).
Every problem is one `InputError` line naming the path and what is wrong."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import jsonio
from ..errors import InputError
from ..models.registry import model_from_config
from ..models.spec import ModelSpec
from ..units import dtype_name
from .dequantize import dequantize_state

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_NAMES_SHOWN = 5
_FLOAT_TAG = "__float__"
_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


@dataclass
class LoadedCheckpoint:
    """A loaded checkpoint: the model (eval, no grad) and what the engine needs beside it."""

    model: torch.nn.Module
    config: Any
    config_dict: dict[str, Any]
    tokenizer: Any | None
    eos_token_ids: tuple[int, ...]
    path: Path
    dtype: torch.dtype

    def model_spec(self, kv_dtype: str | torch.dtype | None = None, tp_size: int = 1) -> ModelSpec:
        """The pool declarations of this checkpoint, from the same parser `kvchain plan` uses (a
        rank's share of the heads over `tp_size` ranks); the KV dtype defaults to the dtype the
        weights were loaded in."""
        chosen = self.dtype if kv_dtype is None else kv_dtype
        return model_from_config(self.config_dict, kv_dtype=dtype_name(chosen), tp_size=tp_size)


#: the dtypes a checkpoint loads in, by name; "auto" is the checkpoint's own
LOAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Load the checkpoint directory `path` in `dtype` (a torch dtype, a name of `LOAD_DTYPES`, or
    "auto": the dtype its config.json names, as serving engines' `--dtype auto`) on `device`."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"checkpoint {path}: {'not a directory' if path.exists() else 'no such directory'}")
    config_dict = read_config(path)
    dtype = load_dtype(dtype, config_dict)
    config = build_config(path, config_dict)
    model_from_config(config_dict)  # kvchain's own checks of the fields, before transformers divides by them
    model = _empty_model(path, config, dtype, device)
    state = read_safetensors(path)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    state = dequantize_state(path, config_dict, state, shapes, dtype)
    state = to_module_layout(path, model, state)
    _load_weights(path, model, state, release_only_tensors(config, model))
    model.eval()
    model.requires_grad_(False)
    return LoadedCheckpoint(
        model=model,
        config=config,
        config_dict=config_dict,
        tokenizer=_load_tokenizer(path),
        eos_token_ids=_eos_token_ids(path, config),
        path=path,
        dtype=dtype,
    )


#: what attention reads K/V back from: float types (an int8 KV would need scales the engine does not keep)
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def kv_cache_dtype(asked: str | torch.dtype) -> str | None:
    """The pool's KV dtype name for an engine's `kv_cache_dtype`; None for `auto` (the dtype the
    model computes in). `fp8` is e4m3: the cast saturates at 448, with no scale."""
    if isinstance(asked, str) and asked == "auto":
        return None
    try:
        name = dtype_name(asked)
    except InputError:
        name = None
    if name not in KV_CACHE_DTYPES:
        raise InputError(f"kv_cache_dtype must be auto, fp8, fp8_e5m2 or one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"not {asked!r}")
    return name


def load_dtype(dtype: torch.dtype | str, config_dict: dict[str, Any]) -> torch.dtype:
    """The torch dtype `dtype` names; "auto": the checkpoint's own (`dtype`, or the older
    `torch_dtype`, of its config or its text config), float32 where it names none or another."""
    if isinstance(dtype, torch.dtype):
        if dtype not in LOAD_DTYPES.values():
            raise InputError(f"a checkpoint loads in {', '.join(LOAD_DTYPES)}, not {dtype}")
        return dtype
    if dtype == "auto":
        text = config_dict.get("text_config")
        for fields in (config_dict, text if isinstance(text, dict) else {}):
            stored = fields.get("dtype") or fields.get("torch_dtype")
            if isinstance(stored, str) and stored in LOAD_DTYPES:
                return LOAD_DTYPES[stored]
        return torch.float32
    if dtype not in LOAD_DTYPES:
        raise InputError(f"dtype must be auto or one of {', '.join(LOAD_DTYPES)}, not {dtype!r}")
    return LOAD_DTYPES[dtype]


def read_config(path: Path) -> dict[str, Any]:
    """config.json of `path` as a dict, with a string `model_type`."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise InputError(f"checkpoint {path}: no {CONFIG_FILE}")
    config = _read_json(path, file)
    if not isinstance(config, dict):
        raise InputError(
            f"checkpoint {path}: {CONFIG_FILE} must hold a JSON object, got {type(config).__name__}"
        )
    if not isinstance(config.get("model_type"), str):
        raise InputError(f"checkpoint {path}: {CONFIG_FILE} has no string 'model_type'")
    return config


def build_config(path: Path, config_dict: dict[str, Any]) -> Any:
    """The transformers config object for `config_dict`, its class chosen by `model_type`."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING

    model_type = config_dict["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise InputError(f"checkpoint {path}: model_type {model_type!r} is unknown to transformers")
    try:
        return CONFIG_MAPPING[model_type].from_dict(config_dict)
    except (StrictDataclassError, TypeError, ValueError, KeyError) as exc:
        raise InputError(
            f"checkpoint {path}: {CONFIG_FILE} is not a valid {model_type} config: {_one_line(exc)}"
        ) from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name: the files the shard index names, else every
    `*.safetensors` file in `path`."""
    files = _weight_files(path)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _read_file(path, file).items():
            if name in state:
                raise InputError(f"checkpoint {path}: tensor {name!r} is stored in more than one file")
            state[name] = tensor
    return state


def to_module_layout(path: Path, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the checkpoint's tensors onto the model's own names the way `from_pretrained` does, with
    the family's conversion mapping from transformers: renames (Nemotron-H's `backbone.` prefix,
    Granite's `input_linear`, Mixtral's `block_sparse_moe`), per-expert MoE matrices stacked into
    the fused `experts.*` tensors, splits and transposes, then the base-model prefix added or dropped.
    Unlike `from_pretrained`, nothing is dropped or guessed: one model tensor reached from two
    checkpoint names, an incomplete expert set or a failed conversion is an InputError. A name that
    maps to nothing in the model stays as it is, to be reported as unexpected."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    expected = model.state_dict(keep_vars=True)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # model name -> the checkpoint name(s) it came from, for messages
    fusions: dict[str, _Fusion] = {}
    for name in sorted(state, key=dot_natural_key):  # transformers' order: experts by number
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, expected)
        if target not in expected:
            target, pattern = name, None  # a name the model holds as is, or one reported as unexpected
        if pattern is None:
            _place(path, out, origin, target, state[name], repr(name))
        else:
            fusion = fusions.setdefault(target, _Fusion(copy.deepcopy(by_pattern[pattern])))
            fusion.add(path, target, name, pattern, state[name])
    for target, fusion in fusions.items():
        for name, tensor in fusion.build(path, model, target, expected[target]).items():
            _place(path, out, origin, name, tensor, fusion.shown())
    return out


def _place(
    path: Path, out: dict[str, torch.Tensor], origin: dict[str, str], name: str, tensor: torch.Tensor, source: str
) -> None:
    """Put `tensor` at model name `name`; a name filled twice is refused, not overwritten."""
    if name in out:
        raise InputError(f"checkpoint {path}: tensor {name!r} is stored twice, as {origin[name]} and as {source}")
    out[name] = tensor
    origin[name] = source


@dataclass
class _Fusion:
    """The checkpoint tensors one transformers `WeightConverter` turns into a model tensor (e.g. the
    per-expert matrices of one fused `experts.gate_up_proj`), and the checks transformers leaves out:
    it stacks whatever experts it finds and concatenates whichever parts are present."""

    converter: WeightConverter
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> names, in order

    def add(self, path: Path, target: str, name: str, pattern: str, tensor: torch.Tensor) -> None:
        """Collect `tensor` (checkpoint name `name`, matched by `pattern`) for `target`."""
        if pattern not in self.converter.source_patterns:  # two converters aim at one model tensor
            raise InputError(f"checkpoint {path}: tensor {target!r} is stored twice, as {self.shown()} and as {name!r}")
        self.sources.setdefault(pattern, []).append(name)
        self.converter.add_tensor(target, name, pattern, tensor)

    def shown(self) -> str:
        """The checkpoint names collected, one `*`-pattern per part, for messages."""
        return " + ".join(repr(_wildcard(names[0], pattern)[0]) for pattern, names in self.sources.items())

    def build(
        self, path: Path, model: torch.nn.Module, target: str, want: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Run the converter's operations once every part and every expert is there."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        operations = self.converter.operations
        if any(isinstance(op, Concatenate) for op in operations):
            self._check_parts(path, target)
        for op in operations:
            if isinstance(op, MergeModulelist):
                self._check_experts(path, target, want.shape[op.dim])
        try:
            built = self.converter.convert(target, model=model, config=model.config)
        except (RuntimeError, ValueError, IndexError, KeyError, AttributeError, TypeError) as exc:
            raise InputError(
                f"checkpoint {path}: cannot build {target!r} from {self.shown()}: {_one_line(exc)}"
            ) from None
        return {name: value[0] if isinstance(value, list) else value for name, value in built.items()}

    def _check_parts(self, path: Path, target: str) -> None:
        """A concatenation needs each of its parts (gate and up); transformers skips an absent one."""
        missing = [p for p in self.converter.source_patterns if p not in self.sources]
        if missing:
            pattern, names = next(iter(self.sources.items()))
            match = _match(names[0], pattern)
            prefix = names[0] if match is None else names[0][: match.start()]
            parts = " + ".join(repr(prefix + _literal(p)) for p in self.converter.source_patterns)
            raise InputError(
                f"checkpoint {path}: {target!r} is built from {parts}: "
                f"the checkpoint has no {prefix + _literal(missing[0])!r}"
            )

    def _check_experts(self, path: Path, target: str, count: int) -> None:
        """Each stacked part holds experts 0..count-1, one matrix each, in order."""
        for pattern, names in self.sources.items():
            indices = [_wildcard(name, pattern)[1] for name in names]
            if None in indices:
                continue  # a pattern without an expert index: only the shape check applies
            if indices != list(range(count)):
                raise InputError(
                    f"checkpoint {path}: {_wildcard(names[0], pattern)[0]!r} holds experts {indices}, "
                    f"{target!r} needs experts 0..{count - 1}"
                )


def _wildcard(name: str, pattern: str) -> tuple[str, int | None]:
    """`name` with the expert index that a converter pattern's `*` stands for shown as `*`, and that
    index (None where the pattern has no `*` or does not match the checkpoint name)."""
    match = _match(name, pattern)
    if match is None or match.lastindex is None:
        return name, None
    return name[: match.start(1)] + "*" + name[match.end(1) :], int(match[1])


def _match(name: str, pattern: str) -> re.Match[str] | None:
    """Where converter pattern `pattern` (a regex whose `*` is an expert index) matches `name`."""
    return re.search(pattern.replace("*", r"(\d+)"), name)


def _literal(pattern: str) -> str:
    """A converter pattern written as a name, its regex escapes dropped."""
    return pattern.replace("\\", "")


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        content = _read_json(path, index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"checkpoint {path}: {INDEX_FILE} has no 'weight_map' object")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"checkpoint {path}: {INDEX_FILE} names missing shard files {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError(f"checkpoint {path}: no *.safetensors files")
    return files


def _read_file(path: Path, file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"checkpoint {path}: cannot read {file.name}: {_one_line(exc)}") from None


def _empty_model(path: Path, config: Any, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """The causal-LM model for `config` on `device` in `dtype`, its weights left uninitialised
    (they are all overwritten by the load)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        with torch.device(device), no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, ArithmeticError) as exc:
        raise InputError(
            f"checkpoint {path}: no causal-LM model for {config.model_type!r}: {_one_line(exc)}"
        ) from None
    model.tie_weights()  # skipped init also skipped the tying; tied names then share one tensor
    return model


def _load_weights(path: Path, model: torch.nn.Module, state: dict[str, torch.Tensor],
                  other_parts: frozenset[str] = frozenset()) -> None:
    """Check `state` against the model's tensors, fill tied aliases, then load strictly; tensors the
    model class declares unused and those of the release's other parts (`other_parts`) are left
    unloaded."""
    expected = model.state_dict(keep_vars=True)
    _fill_tied(expected, state)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    released_unused = unused_by_the_model(model)
    for name in unexpected:
        if name in other_parts or (released_unused is not None and released_unused.search(name)):
            del state[name]
    unexpected = [n for n in unexpected if n in state]
    if missing:
        raise InputError(f"checkpoint {path}: missing tensors {_names(missing)}")
    if unexpected:
        raise InputError(f"checkpoint {path}: unexpected tensors {_names(unexpected)}")
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise InputError(
                f"checkpoint {path}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {want}"
            )
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


def unused_by_the_model(model: torch.nn.Module) -> re.Pattern[str] | None:
    """What a release stores that the model class declares it does not use, as `from_pretrained`
    leaves it unloaded: the class's `_keys_to_ignore_on_load_unexpected` (multi-token-prediction
    layers: DeepSeek-V3's `model.layers.61`, Qwen3-Next's `mtp.`, GLM-4.5's layers 46 and 92) and
    the per-layer rotary `inv_freq` and `position_ids` buffers older releases stored, where the
    model keeps such buffers itself. Only tensors that map to nothing in the model are dropped by
    it; anything else unexpected is still refused."""
    declared = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    patterns = {p for p in declared if isinstance(p, str)} if isinstance(declared, (list, set, tuple)) else set()
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    if not patterns:
        return None
    return re.compile("|".join(f"({p})" for p in sorted(patterns)))


def release_only_tensors(config: Any, model: torch.nn.Module) -> frozenset[str]:
    """The tensors of the release's own architecture (`architectures` in config.json) that the
    model the engine builds does not hold: a multimodal release whose text model serves causal LM
    (Llama 4's `Llama4ForConditionalGeneration`, whose `AutoModelForCausalLM` is `Llama4ForCausalLM`)
    stores its vision tower and projector beside the text weights, which `from_pretrained` leaves
    unloaded too. The names are that architecture's own, built on the meta device (no memory)."""
    import transformers
    from transformers.initialization import no_init_weights

    names = getattr(config, "architectures", None) or []
    release = getattr(transformers, names[0], None) if names and isinstance(names[0], str) else None
    if not isinstance(release, type) or isinstance(model, release) or not hasattr(release, "_from_config"):
        return frozenset()
    try:
        with torch.device("meta"), no_init_weights():
            other = release._from_config(config)
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError):
        return frozenset()  # not buildable from this config: nothing is set aside, the load stays strict
    return frozenset(other.state_dict()) - frozenset(model.state_dict())


def _fill_tied(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Names that share one tensor in the model (tied embeddings) are stored once; give the
    missing ones the stored tensor."""
    groups: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    for names in groups.values():
        stored = [name for name in names if name in state]
        if stored and len(names) > 1:
            for name in names:
                state.setdefault(name, state[stored[0]])


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}] ({len(names)} in all)"


def _load_tokenizer(path: Path) -> Any | None:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"checkpoint {path}: cannot load the tokenizer: {_one_line(exc)}") from None


def _eos_token_ids(path: Path, config: Any) -> tuple[int, ...]:
    """The stop ids: generation_config.json's eos_token_id when it sets one, else the config's."""
    value = None
    file = path / GENERATION_CONFIG_FILE
    if file.is_file():
        generation = _read_json(path, file)
        if isinstance(generation, dict):
            value = generation.get("eos_token_id")
    if value is None:
        value = getattr(config, "eos_token_id", None)
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in values):
        raise InputError(f"checkpoint {path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _read_json(path: Path, file: Path) -> Any:
    where = f"checkpoint {path}: {file.name}"
    return jsonio.loads(jsonio.read_text(file, where), where, object_hook=_special_float)


def _special_float(obj: dict[str, Any]) -> Any:
    """transformers writes inf and nan (e.g. Nemotron-H's `time_step_limit`) as {"__float__": "Infinity"}."""
    if len(obj) == 1 and isinstance(obj.get(_FLOAT_TAG), str) and obj[_FLOAT_TAG] in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj[_FLOAT_TAG]]
    return obj


def _one_line(exc: Exception) -> str:
    """An exception's message folded onto one line (the CLI prints errors as one line)."""
    return " ".join(str(exc).split()) or type(exc).__name__
