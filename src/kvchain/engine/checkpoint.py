"""Load a Hugging Face checkpoint directory the way a serving engine does.

The engine runs the HF module tree but owns every byte of KV and state, so it must also own the
load: config.json picks the config class, the model is built with weight init skipped, and the
safetensors files are read and checked name by name and shape by shape before a strict
`load_state_dict`. `from_pretrained` is not used for the weights: its silent fix-ups (re-initialising
missing tensors, dropping unexpected ones) would hide a checkpoint that does not match the model.
Every problem is one `InputError` line naming the path and what is wrong."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import jsonio
from ..errors import InputError
from ..models.registry import model_from_config
from ..models.spec import ModelSpec
from ..units import dtype_name

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_NAMES_SHOWN = 5
_FLOAT_TAG = "__float__"
_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}
# Hub checkpoints of some families keep a top-level module name the transformers class renamed.
_PREFIX_RENAMES = {"nemotron_h": (("backbone.", "model."),)}
# ... and some keep a module name inside the path that the class renamed (LFM3's attention output
# gate is `gate_proj` on the hub and in `save_pretrained`'s output, `g_proj` in the module).
_INFIX_RENAMES = {"lfm3": ((".self_attn.gate_proj.", ".self_attn.g_proj."),)}
# Fused expert tensor -> the per-expert matrices it concatenates (along rows), in order.
_FUSED = (
    ("gate_up_proj", ("gate_proj", "up_proj")),
    ("up_proj", ("up_proj",)),
    ("down_proj", ("down_proj",)),
)
_EXPERT = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


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

    def model_spec(self, kv_dtype: str | torch.dtype | None = None) -> ModelSpec:
        """The pool declarations of this checkpoint, from the same parser `kvchain plan` uses;
        the KV dtype defaults to the dtype the weights were loaded in."""
        chosen = self.dtype if kv_dtype is None else kv_dtype
        return model_from_config(self.config_dict, kv_dtype=dtype_name(chosen))


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Load the checkpoint directory `path` in `dtype` on `device`."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"checkpoint {path}: no such directory")
    config_dict = read_config(path)
    config = build_config(path, config_dict)
    model_from_config(config_dict)  # kvchain's own checks of the fields, before transformers divides by them
    model = _empty_model(path, config, dtype, device)
    state = read_safetensors(path)
    state = to_module_layout(path, config_dict["model_type"], state, model.state_dict(keep_vars=True))
    _load_weights(path, model, state)
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


def to_module_layout(
    path: Path, model_type: str, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename and fuse hub-layout tensors into the names the transformers modules hold: a family's
    renamed prefix or inner module name, and per-expert MoE matrices (`experts.{e}.{gate,up,down}_proj.weight`) stacked
    into the fused `experts.gate_up_proj` / `experts.up_proj` / `experts.down_proj` the model
    expects (gate rows before up rows). A name the model holds as is stays as it is."""
    renames = _PREFIX_RENAMES.get(model_type, ())
    infixes = _INFIX_RENAMES.get(model_type, ())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for old, new in renames:
            if name.startswith(old) and name not in expected:
                name = new + name[len(old) :]
        for old, new in infixes:
            if old in name and name not in expected:
                name = name.replace(old, new)
        if name in out:
            raise InputError(f"checkpoint {path}: tensor {name!r} is stored under two names")
        out[name] = tensor
    return _fuse_experts(path, out, expected)


def _fuse_experts(
    path: Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    found: dict[tuple[str, str], dict[int, str]] = {}  # (experts module, proj) -> expert index -> name
    for name in state:
        match = _EXPERT.match(name)
        if match is not None and name not in expected:
            found.setdefault((match["experts"], match["proj"]), {})[int(match["index"])] = name
    for experts in sorted({experts for experts, _proj in found}):
        for target, parts in _FUSED:
            if f"{experts}.{target}" not in expected or not all((experts, p) in found for p in parts):
                continue  # what is left per-expert is reported as unexpected names
            names = [_expert_names(path, experts, part, found[(experts, part)]) for part in parts]
            if len({len(n) for n in names}) > 1:
                raise InputError(f"checkpoint {path}: {experts} stores {parts} for different expert counts")
            per_expert = [torch.cat([state.pop(n) for n in row], dim=0) for row in zip(*names, strict=True)]
            state[f"{experts}.{target}"] = torch.stack(per_expert)
    return state


def _expert_names(path: Path, experts: str, part: str, by_index: dict[int, str]) -> list[str]:
    if sorted(by_index) != list(range(len(by_index))):
        raise InputError(
            f"checkpoint {path}: {experts}.*.{part} does not hold experts 0..{len(by_index) - 1}"
        )
    return [by_index[i] for i in range(len(by_index))]


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


def _load_weights(path: Path, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Check `state` against the model's tensors, fill tied aliases, then load strictly."""
    expected = model.state_dict(keep_vars=True)
    _fill_tied(expected, state)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
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
