"""`install_state_mixers`: switch a model's recurrent mixers to kvchain's forwards, which read and
write their conv and SSM/delta state in the pool by state slot (`deltanet.py`, `mamba2.py`,
`shortconv.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import InputError
from .batch import ForwardBatch
from .deltanet import deltanet_forward, deltanet_module_types
from .mamba2 import mamba2_forward, mamba2_module_types
from .shortconv import shortconv_forward, shortconv_module_types
from .speculative_state import stepped_mixer_forward


def served_mixer_types() -> tuple[type, ...]:
    """Every recurrent mixer class kvchain's engine serves (those the installed transformers has)."""
    return deltanet_module_types() + mamba2_module_types() + shortconv_module_types()


def install_state_mixers(model: torch.nn.Module) -> int:
    """Replace the `forward` of every recurrent mixer in `model` (Qwen3-Next gated DeltaNet,
    Nemotron-H Mamba2, LFM2/LFM3 short conv) with kvchain's, which reads and writes the state in the pool through the
    `kvchain_batch` keyword the model passes down. Returns how many were installed."""
    kinds = [(deltanet_module_types(), deltanet_forward), (mamba2_module_types(), mamba2_forward),
             (shortconv_module_types(), shortconv_forward)]
    installed = 0
    for module in model.modules():
        for types, forward in kinds:
            if types and isinstance(module, types):
                module.forward = _bound(module, forward)
                installed += 1
                break
    return installed


def _bound(module: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(hidden_states: torch.Tensor, cache: object = None, attention_mask: object = None,
            **kwargs: object) -> torch.Tensor:
        batch = kwargs.get("kvchain_batch")
        if not isinstance(batch, ForwardBatch):
            raise InputError(f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) runs on "
                             "kvchain's pool and needs kvchain_batch=<ForwardBatch> in the forward's kwargs")
        if batch.verify is not None:  # a speculative round: token by token into scratch slots
            return stepped_mixer_forward(forward, module, hidden_states, batch)
        return forward(module, hidden_states, batch)

    return run


def check_state_layers_served(model: torch.nn.Module, state_layers: set[int]) -> None:
    """Refuse a model with a layer the plan gives recurrent state whose mixer kvchain does not
    serve: transformers' own mixer would run on without the pool's state (it is called with no
    cache) and every token after the first would be wrong, silently."""
    served = served_mixer_types()
    classes: dict[int, set[str]] = {}  # per state layer of this model, its modules' classes
    served_layers: set[int] = set()
    for module in model.modules():
        lid = getattr(module, "layer_idx", None)
        if isinstance(lid, int) and lid in state_layers:
            classes.setdefault(lid, set()).add(type(module).__name__)
            if served and isinstance(module, served):
                served_layers.add(lid)
    unserved = sorted(set(classes) - served_layers)
    if unserved:
        names = ", ".join(sorted(set().union(*(classes[lid] for lid in unserved))))
        known = ", ".join(sorted(t.__name__ for t in served)) or "none in this transformers"
        raise InputError(f"layers {unserved} keep recurrent state in {names}, a mixer kvchain's engine does "
                         f"not serve (it serves {known}); kvchain can plan this model's pool (`kvchain plan`) "
                         "but not run it")
