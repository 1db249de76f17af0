"""Draft models for speculative decoding: a target's own first layers, written as a checkpoint.

A draft must share the target's vocabulary, and it proposes well when it computes what the target
computes early on. The simplest such draft is the target itself cut to a few layers: its
embeddings, the layers kept (by default the first layer and the first full-attention layer, so
the draft has the target's layer kinds and a full-attention owner of its own), its final norm and
its head, with the same weights. `make_draft_checkpoint` writes one next to the target."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import InputError

#: config keys that list each layer's mixer kind, in the families the engine serves
_LAYER_LISTS = ("layer_types", "layers_block_type")
#: config keys that list one entry per layer: the kinds, and others a draft keeps for its layers
#: (Kimi Linear's dense or sparse MLP per layer)
_PER_LAYER_LISTS = (*_LAYER_LISTS, "mlp_layer_types")
#: config keys that list the indices of the attention layers (the others recurrent)
_INDEX_LISTS = ("attn_layer_indices", "full_attn_idxs")
_FULL_KINDS = ("full_attention", "attention", "hybrid")  # Zamba's hybrid layers run its shared attention


def _text_config(model: torch.nn.Module):
    config = model.config
    return getattr(config, "text_config", None) or config


def default_draft_layers(model: torch.nn.Module) -> list[int]:
    """The first layer and the first full-attention layer of `model` (one layer when they coincide
    or when the config does not name its layer kinds)."""
    config = _text_config(model)
    for key in _LAYER_LISTS:
        kinds = getattr(config, key, None)
        if kinds:
            full = next((i for i, kind in enumerate(kinds) if kind in _FULL_KINDS), 0)
            return sorted({0, full})
    for key in _INDEX_LISTS:
        indices = getattr(config, key, None)
        if indices:
            return sorted({0, min(int(i) for i in indices)})
    return [0]


def make_draft(model: torch.nn.Module, layers: Sequence[int] | None = None) -> torch.nn.Module:
    """A model of `model`'s class with only `layers` (target layer indices, in order), sharing
    every other weight (embeddings, final norm, head)."""
    from transformers import AutoModelForCausalLM

    config = _text_config(model)
    n = int(config.num_hidden_layers)
    keep = list(default_draft_layers(model) if layers is None else layers)
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= n:
        raise InputError(f"draft layers must be increasing target layer indices in [0, {n}), got {keep}")
    fields = config.to_dict()
    fields["num_hidden_layers"] = len(keep)
    for key in _PER_LAYER_LISTS:
        if fields.get(key):
            fields[key] = [fields[key][i] for i in keep]
    where = {old: new for new, old in enumerate(keep)}
    for key in _INDEX_LISTS:
        if fields.get(key):
            fields[key] = [where[int(i)] for i in fields[key] if int(i) in where]
    model_type = fields.pop("model_type")
    from transformers import AutoConfig

    draft_config = AutoConfig.for_model(model_type, **fields)
    draft = AutoModelForCausalLM.from_config(draft_config, dtype=next(model.parameters()).dtype)
    pattern = re.compile(r"(^|\.)layers\.(\d+)\.")
    state = {}
    for name, tensor in model.state_dict().items():
        m = pattern.search(name)
        if m is None:
            state[name] = tensor
        elif int(m.group(2)) in where:
            state[name[:m.start(2)] + str(where[int(m.group(2))]) + name[m.end(2):]] = tensor
    try:
        draft.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # the config laid the kept layers out as other kinds
        first = str(exc).strip().splitlines()[0]
        raise InputError(f"a {model_type} draft of layers {keep} does not keep their kinds (its config lays layer "
                         f"kinds out by a rule the cut does not follow): {first}") from None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(draft.generation_config, key, getattr(model.generation_config, key, None))
    return draft.eval()


def make_draft_checkpoint(target_dir: Path | str, out_dir: Path | str, layers: Sequence[int] | None = None) -> Path:
    """Write the draft of the checkpoint in `target_dir` (its `layers`, by default
    `default_draft_layers`) into `out_dir`, with the target's tokenizer files."""
    from .checkpoint import load_checkpoint
    from .tiny import save_checkpoint

    target = load_checkpoint(target_dir)
    return save_checkpoint(make_draft(target.model, layers), Path(out_dir))
