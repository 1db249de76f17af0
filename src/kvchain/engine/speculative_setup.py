"""Start-up of speculative decoding: load the draft, fuse it into the target's plan, build its pool.

Everything a draft can get wrong is refused here, before any memory is taken: a draft without a
proposal count (or the reverse), a vocabulary other than the target's, and a draft with recurrent
layers when the target's state band has no checkpoint policy (`plan_kv_storage` raises PlanError:
the prefix cache must checkpoint the target's state, whose slots then hold the draft's too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache.checkpoints import default_checkpoint_interval
from ..decl import KVLayerDecl
from ..errors import InputError, PlanError
from ..plan import KVStoragePlan, plan_kv_storage
from ..storage import KVStorage
from .checkpoint import LoadedCheckpoint, kv_cache_dtype, load_checkpoint
from .runner import ModelRunner
from .speculative import SpeculativePool
from .speculative_plan import draft_layer_offset, fuse_draft_layers, plan_with_draft

#: `serve.EngineConfig` (not imported: `serve` imports this module)
EngineConfig = Any


@dataclass(frozen=True)
class DraftSetup:
    """The loaded draft (its layers renumbered after the target's), the fused plan, and the
    checkpoint grid declared on the target's state (None: no recurrent state or no prefix cache)."""

    checkpoint: LoadedCheckpoint
    plan: KVStoragePlan
    checkpoint_interval: int | None
    #: the draft's own declarations (its layers numbered from 0; a rank's share under `tp_size`) and
    #: where its layers start once fused, after the target's
    decls: tuple = ()
    offset: int = 0

    @property
    def fused_decls(self) -> tuple[KVLayerDecl, ...]:
        """The draft's declarations as its model is numbered once fused: what ranks check its split against."""
        return tuple(KVLayerDecl(d.layer_id + self.offset, d.parts) for d in self.decls)


def _vocab(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def load_draft(config: EngineConfig, target: LoadedCheckpoint, device: torch.device, tp_size: int = 1) -> DraftSetup:
    """Load `config.draft_model_path` and plan it fused with `target` (refusals: see the module);
    `tp_size`: the plan of one of that many tensor-parallel ranks, each keeping its share of both
    models' heads."""
    k = config.num_speculative_tokens
    if config.draft_model_path is None or not isinstance(k, int) or k < 1:
        raise InputError("speculative decoding needs both a draft model path and a positive number of "
                         f"speculative tokens (got {config.draft_model_path!r} and {k!r})")
    draft = load_checkpoint(config.draft_model_path, device=device, dtype=target.dtype)  # the target's precision
    if _vocab(draft.model) != _vocab(target.model):
        raise InputError(f"the draft's vocabulary ({_vocab(draft.model)} ids) is not the target's "
                         f"({_vocab(target.model)} ids): a draft must share the target's tokenizer")
    kv = kv_cache_dtype(config.kv_cache_dtype)
    decls = target.model_spec(kv, tp_size=tp_size).decls
    draft_decls = draft.model_spec(kv, tp_size=tp_size).decls
    alone = plan_kv_storage(decls, page_size=config.page_size)
    interval = None
    if alone.state is not None and config.prefix_cache:
        interval = config.checkpoint_interval or default_checkpoint_interval(alone)
    try:
        plan = plan_with_draft(decls, draft_decls, page_size=config.page_size,
                               checkpoint_interval=interval, num_speculative_tokens=k)
    except PlanError:
        if alone.state is None or config.prefix_cache:
            raise
        raise InputError("a draft with recurrent layers steps its state on the prefix cache's checkpoint grid, "
                         "which prefix_cache=False removes (on the command line: drop --no-prefix-cache)") from None
    offset = draft_layer_offset(decls)
    fuse_draft_layers(draft.model, offset)
    return DraftSetup(draft, plan, interval, tuple(draft_decls), offset)


def speculative_pool(storage: KVStorage, runner: ModelRunner, draft: DraftSetup, config: EngineConfig,
                     kwargs: dict, cls: type[SpeculativePool] = SpeculativePool) -> SpeculativePool:
    """The engine's pool (`cls`) with the draft's runner over the same plan; the metadata buffers
    take a round's `k + 1` tokens per running request."""
    k = config.num_speculative_tokens
    kwargs = {**kwargs, "max_tokens": config.max_batched_tokens + config.max_running * (k + 1)}
    return cls(storage, runner, ModelRunner(draft.checkpoint.model, storage.plan, draft=True), num_speculative_tokens=k, **kwargs)
