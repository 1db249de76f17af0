"""`install_state_mixers`: switch a model's recurrent mixers to kvchain's forwards, which read and
write their conv and SSM/delta state in the pool by state slot (`deltanet.py`, `mamba1.py`,
`mamba2.py`, `shortconv.py`, `rglru.py`, `lightning.py`, `zamba.py`, `kda.py`).

A mixer takes the step's `ForwardBatch` from the `kvchain_batch` keyword the model passes down to
it. Some transformers blocks call their mixer with the hidden states, cache and mask only (Mamba's,
Falcon-Mamba's and Jamba's drop the other keywords), so the keyword is also caught where the model
itself is called and relayed to the mixers of that call (`BatchRelay`)."""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable

import torch

from ..errors import InputError
from .batch import ForwardBatch
from .deltanet import deltanet_forward, deltanet_module_types
from .kda import kda_forward, kda_module_types
from .lightning import lightning_forward, lightning_module_types
from .mamba1 import mamba1_forward, mamba1_module_types
from .mamba2 import mamba2_forward, mamba2_module_types
from .rglru import rglru_forward, rglru_module_types
from .shortconv import shortconv_forward, shortconv_module_types
from .speculative_state import stepped_mixer_forward
from .zamba import zamba_forward, zamba_module_types


@functools.cache
def served_mixer_types() -> tuple[type, ...]:
    """Every recurrent mixer class kvchain's engine serves (those the installed transformers has;
    looked up once: the TP shard asks it of every module of a model)."""
    return (deltanet_module_types() + mamba1_module_types() + mamba2_module_types() + shortconv_module_types()
            + rglru_module_types() + lightning_module_types() + zamba_module_types() + kda_module_types())


@functools.cache
def paired_output_types() -> tuple[type, ...]:
    """Served mixers whose callers unpack `(output, weights)` (RecurrentGemma's recurrent block,
    MiniMax's lightning attention, which sit where an attention module would): kvchain's forward
    returns the output, and the installed forward pairs it with None for these."""
    return rglru_module_types() + lightning_module_types()


def install_state_mixers(model: torch.nn.Module) -> int:
    """Replace the `forward` of every recurrent mixer in `model` (Qwen3-Next gated DeltaNet, Mamba,
    Falcon-Mamba and Jamba Mamba1, Nemotron-H Mamba2, LFM2/LFM3 short conv, RecurrentGemma RG-LRU,
    MiniMax lightning attention, Zamba's multi-head Mamba1, Kimi Linear's KDA) with kvchain's, which
    reads and writes the state in the pool through the `kvchain_batch` keyword of the model's call.
    Returns how many were installed."""
    kinds = [(deltanet_module_types(), deltanet_forward), (mamba1_module_types(), mamba1_forward),
             (mamba2_module_types(), mamba2_forward), (shortconv_module_types(), shortconv_forward),
             (rglru_module_types(), rglru_forward), (lightning_module_types(), lightning_forward),
             (zamba_module_types(), zamba_forward), (kda_module_types(), kda_forward)]
    number_mixer_layers(model)
    found = [(module, next((forward for types, forward in kinds if types and isinstance(module, types)), None))
             for module in model.modules()]
    found = [(module, forward) for module, forward in found if forward is not None]
    if found:
        relay = BatchRelay.of(model)
        for module, forward in found:
            module.forward = _bound(module, forward, relay)
    return len(found)


#: a decoder layer's index in a module's qualified name (`model.layers.3.temporal_block`)
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def number_mixer_layers(model: torch.nn.Module) -> None:
    """Give each served mixer that does not keep its layer's index (RecurrentGemma's recurrent block)
    the index of the decoder layer it sits in: its state is addressed in the pool by layer, and
    `check_state_layers_served` finds a layer's mixers by it. Idempotent. A fused draft must be
    numbered before its layers are offset after the target's (`fuse_draft_layers`), which moves
    only the indices a module already has."""
    served = served_mixer_types()
    for name, module in model.named_modules():
        if not served or not isinstance(module, served) or isinstance(getattr(module, "layer_idx", None), int):
            continue
        layer = layer_in_name(name)
        if layer is None:
            raise InputError(f"{type(module).__name__} at {name!r} keeps no layer_idx and sits in no `layers.<i>`")
        module.layer_idx = layer


def layer_in_name(name: str) -> int | None:
    """The decoder layer a module's qualified name places it in (`model.layers.3.temporal_block`: 3),
    or None outside `layers.<i>`."""
    found = _LAYER_NAME.search(name)
    return None if found is None else int(found.group(1))


class BatchRelay:
    """The `kvchain_batch` of the model call running on this thread, for a mixer whose block does
    not pass the keyword down. Set by a pre-hook on the model and cleared by a hook that runs even
    when the forward raises, so a later call without the keyword finds none rather than a stale one.
    A copy (or an unpickled one) starts empty: a thread's batch is never carried over."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self) -> tuple[type, tuple]:
        return (BatchRelay, ())

    @property
    def batch(self) -> ForwardBatch | None:
        return getattr(self._local, "batch", None)

    @classmethod
    def of(cls, model: torch.nn.Module) -> BatchRelay:
        """`model`'s relay, hooked on the first call (installing twice keeps one)."""
        relay = model.__dict__.get("_kvchain_batch_relay")
        if relay is None:
            relay = model.__dict__["_kvchain_batch_relay"] = cls()
            model.register_forward_pre_hook(relay._catch, with_kwargs=True)
            model.register_forward_hook(relay._release, always_call=True)
        return relay

    def _catch(self, _model: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        batch = kwargs.get("kvchain_batch")
        self._local.batch = batch if isinstance(batch, ForwardBatch) else None

    def _release(self, *_unused: object) -> None:
        self._local.batch = None


def relay_batch_to_attention(model: torch.nn.Module) -> int:
    """Hand the model call's `kvchain_batch` to every attention module of `model` called without it
    (StableLM's and Nemotron's decoder layers pass their attention no keywords; the attention
    passes its own on to the attention function). Idempotent; returns how many modules it hooks."""
    relay = BatchRelay.of(model)
    hooked = 0
    for module in model.modules():
        if hasattr(module, "o_proj") and isinstance(getattr(module, "layer_idx", None), int):
            if not module.__dict__.get("_kvchain_batch_hook"):
                module.register_forward_pre_hook(_with_batch(relay), with_kwargs=True, prepend=True)
                module.__dict__["_kvchain_batch_hook"] = True
            hooked += 1
    return hooked


def _with_batch(relay: BatchRelay):
    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "kvchain_batch" in kwargs or relay.batch is None:
            return None
        return args, {**kwargs, "kvchain_batch": relay.batch}
    return hook


def _bound(module: torch.nn.Module, forward: Callable[..., torch.Tensor],
           relay: BatchRelay) -> Callable[..., torch.Tensor]:
    def run(hidden_states: torch.Tensor, cache: object = None, attention_mask: object = None,
            **kwargs: object) -> torch.Tensor:
        batch = kwargs.get("kvchain_batch", relay.batch)
        if not isinstance(batch, ForwardBatch):
            raise InputError(f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) runs on "
                             "kvchain's pool and needs kvchain_batch=<ForwardBatch> in the forward's kwargs")
        if batch.verify is not None:  # a speculative round: token by token into scratch slots
            out = stepped_mixer_forward(forward, module, hidden_states, batch)
        else:
            out = forward(module, hidden_states, batch)
        return (out, None) if paired else out

    paired = isinstance(module, paired_output_types())
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
