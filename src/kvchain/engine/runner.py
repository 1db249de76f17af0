"""`ModelRunner`: a transformers model whose every KV and state path goes through the pool.

The model's own module tree runs (embeddings, norms, MLPs, experts, projections, rotary); kvchain
replaces only what touches KV or recurrent state: the attention function (registered with
transformers' `AttentionInterface` and selected on every config of the model) and the forward of
each recurrent mixer instance. One call serves a whole step: every scheduled request's new tokens
packed into one sequence, with the translated ids in a `ForwardBatch`."""

from __future__ import annotations

import functools
import inspect

import torch

from ..errors import InputError, KVChainError
from ..plan import KVStoragePlan, PoolKind
from .attention import ATTENDED, register
from .attention import NAME as ATTENTION_NAME
from .batch import ForwardBatch
from .latent import install_latent_caches
from .mixers import check_state_layers_served, install_state_mixers, relay_batch_to_attention
from .shared_attention import install_shared_attention, is_shared_attention


def _configs(model: torch.nn.Module):
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None:
            continue
        stack = [config]
        while stack:
            cfg = stack.pop()
            if id(cfg) in seen:
                continue
            seen.add(id(cfg))
            yield cfg
            for key in ("text_config", "decoder"):
                sub = getattr(cfg, key, None)
                if sub is not None and hasattr(sub, "to_dict"):
                    stack.append(sub)


class _NoMasks(dict):
    """Every layer type's mask: none. Handed to the model as its precomputed mask mapping, so it skips
    building masks (and probing the packed positions for sequence boundaries) on every forward; the
    attention function takes the mask from the batch's positions instead."""

    def __missing__(self, key: str) -> None:
        return None


_NO_MASKS = _NoMasks()


@functools.cache
def takes_mask_mapping(model_class: type) -> bool:
    """Whether `model_class`'s forward takes a precomputed mask mapping in `attention_mask`: the
    transformers 5 families that test `isinstance(attention_mask, dict)` then skip building masks.
    Read once per class from its modeling module's source; a family that does not (or whose source
    cannot be read) builds its masks, which the attention function ignores: slower, never wrong."""
    module = inspect.getmodule(model_class)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


class ModelRunner:
    """Runs one batched forward of `model` over the pool `plan` lays out.

    Construction switches the model to kvchain's paged attention and installs the state mixers; a
    model with layers the plan does not place is refused, since its KV would live nowhere, and one
    whose state layers (the fused plan's draft layers, for a `draft`) run a mixer kvchain does not
    serve, since its state would live nowhere either."""

    #: whether `logits` returns None and the logits come later, relayed (a pipeline stage before the
    #: last under speculative decoding, `dist/pp_spec.py`); a plain runner returns them
    relays_logits: bool = False

    def __init__(self, model: torch.nn.Module, plan: KVStoragePlan, *, draft: bool = False) -> None:
        register()
        for config in _configs(model):
            config._attn_implementation = ATTENTION_NAME
        self.model = model.eval()
        self.mixers = install_state_mixers(model)
        self.latent_layers = install_latent_caches(model)
        relay_batch_to_attention(model)
        if plan.state is not None:
            # a fused plan numbers a draft's layers after the target's last layer with KV or state,
            # so a draft layer's id may be a target's layer without any (an MLP block)
            drafts = set(plan.state.draft_layer_ids)
            check_state_layers_served(model, drafts if draft else set(plan.state.layer_ids) - drafts)
        self._masks = {"attention_mask": _NO_MASKS} if takes_mask_mapping(type(model)) else {}
        # a layer's KV sub-pool where it has one: a layer that keeps state beside its KV (Falcon-H1)
        # finds its state through `ForwardBatch.state_pool_of`
        kv_last = sorted(plan.sub_pools, key=lambda pool: pool.kind is not PoolKind.STATE)
        self.layer_pool = {lid: pool.name for pool in kv_last for lid in pool.layer_ids}
        # a block run at several layers (Zamba's shared transformer) is told its layer per call
        attention_layers = install_shared_attention(model) | {
            m.layer_idx for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj") and not is_shared_attention(m)}
        missing = sorted(attention_layers - set(self.layer_pool))
        if missing:
            raise InputError(f"attention layers {missing} have no sub-pool in the plan (it places layers "
                             f"{sorted(self.layer_pool)}): plan from this checkpoint's own config")
        kv_pools = [pool for pool in plan.sub_pools if pool.kind is not PoolKind.STATE]
        drafts = {lid for pool in kv_pools for lid in pool.draft_layer_ids}
        #: the layers whose K/V the plan keeps (the draft's, for a draft): each must reach the
        #: attention function once a forward
        self.kv_layers = frozenset(drafts if draft else {lid for pool in kv_pools for lid in pool.layer_ids} - drafts)
        self._classes = {m.layer_idx: type(m).__name__ for m in model.modules()
                         if isinstance(getattr(m, "layer_idx", None), int)}
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
               sample_at: torch.Tensor) -> torch.Tensor:
        """Logits `[len(sample_at), vocab]` at the packed positions `sample_at`, after writing every
        new token's KV and state into the pool."""
        try:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None],
                             logits_to_keep=sample_at, use_cache=False, kvchain_batch=batch, **self._masks)
        except Exception as error:
            if isinstance(error, KVChainError):
                raise
            self.check_attended(batch, error)
            raise
        self.check_attended(batch)
        return out.logits[0].float()

    def check_attended(self, batch: ForwardBatch, raised: Exception | None = None) -> None:
        """Every layer whose K/V the pool keeps went through the attention function in this forward:
        a module that attends its own way (over only the step's tokens) would serve wrong tokens
        without a word. A forward that `raised` before the first layer reached it is refused the
        same way, naming what it raised (Falcon's attention adds a mask the engine does not build)."""
        attended = batch.__dict__.get(ATTENDED, frozenset())
        skipped = self.kv_layers - attended
        if raised is not None and attended:
            return  # it got as far as the attention function: the error is the model's own
        if skipped:
            classes = sorted({self._classes.get(lid, type(self.model).__name__) for lid in skipped})
            why = "" if raised is None else f" (the forward raised {type(raised).__name__}: {raised})"
            raise InputError(f"attention layers {sorted(skipped)} ({', '.join(classes)}) never called the attention "
                             f"function{why}: they attend without the pool's K/V, which kvchain cannot serve") from raised
