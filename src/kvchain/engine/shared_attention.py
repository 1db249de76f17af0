"""Attention blocks a model runs at several decoder layers (Zamba's and Zamba2's shared transformer).

transformers builds such a block once per use and ties the uses' weights (or could reuse one
instance); its attention module keeps no layer index of its own (None, or -1) and is told the
layer it runs at by the `layer_idx` argument of each call. The pool keeps KV per layer, so every
call must reach the attention function with its own layer: a forward pre-hook on each such module
relays the call's `layer_idx` as the `kvchain_layer` keyword, which the module hands on to the
attention function with its other keywords. Modules that keep their index are left alone, so the
common path gains nothing but one keyword default."""

from __future__ import annotations

import inspect

import torch

from ..errors import InputError
from .mixers import layer_in_name

#: the keyword `paged_attention` takes the layer of a shared block's call from
LAYER_KEYWORD = "kvchain_layer"
_HOOKED = "_kvchain_shared_layer_hook"
#: what a fused draft's block adds to the layer its call names (`offset_layers`)
_OFFSET = "_kvchain_layer_offset"


def _layer_arg(module: torch.nn.Module) -> int | None:
    """The position of `layer_idx` among `module.forward`'s arguments, when the module is an
    attention module (it has `o_proj`) that keeps no layer index of its own but takes one per call;
    None for any other module."""
    own = getattr(module, "layer_idx", None)
    if not hasattr(module, "o_proj") or (isinstance(own, int) and own >= 0):
        return None
    names = list(inspect.signature(module.forward).parameters)
    return names.index("layer_idx") if "layer_idx" in names else None


def is_shared_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is an attention module told its layer per call (`_layer_arg`)."""
    return _layer_arg(module) is not None


def offset_layers(module: torch.nn.Module, offset: int) -> None:
    """Relay the layers of `module`'s calls `offset` further: a fused draft's decoder loop numbers its
    own layers from 0, the pool holds them after the target's (`speculative_plan.fuse_draft_layers`).
    Idempotent for one offset."""
    module.__dict__[_OFFSET] = offset


def install_shared_attention(model: torch.nn.Module) -> set[int]:
    """Hook every shared attention module of `model` to relay its call's layer (idempotent), and
    return the layers of the pool they run at: those whose `layers.<i>` holds one (every name of a
    module reused under several layers), offset as a fused draft's (`offset_layers`)."""
    layers: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        position = _layer_arg(module)
        if position is None:
            continue
        layer = layer_in_name(name)
        if layer is None:
            raise InputError(f"{type(module).__name__} at {name!r} takes its layer per call but sits in no "
                             "`layers.<i>`: the pool cannot tell which layers' KV it keeps")
        layers.add(layer + module.__dict__.get(_OFFSET, 0))
        if not module.__dict__.get(_HOOKED):
            module.register_forward_pre_hook(_relay(position), with_kwargs=True)
            module.__dict__[_HOOKED] = True
    return layers


def _relay(position: int):
    """A pre-hook passing the call's `layer_idx` (keyword, or positional at `position`) on as
    `kvchain_layer`."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        layer = kwargs["layer_idx"] if "layer_idx" in kwargs else args[position] if position < len(args) else None
        if not isinstance(layer, int):
            raise InputError(f"{type(module).__name__} was called without its layer (layer_idx={layer!r})")
        return args, {**kwargs, LAYER_KEYWORD: layer + module.__dict__.get(_OFFSET, 0)}
    return hook
