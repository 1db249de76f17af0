"""Speculative serving for the engine tests: a draft made from each tiny target (its own first
layers, or the whole target for a draft that is always right) and a tight budget over the fused
plan, so the draft's KV is part of what only a few requests fit in."""

from __future__ import annotations

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig, GenerateResult
from kvchain.engine.speculative import plan_with_draft
from kvchain.plan import PoolKind
from kvchain.sizing import pages_for, size_plan
from support.engine import INTERVAL, PAGE, checkpoint_dir, draft_dir, workload

SPEC_FAMILIES = ("gemma3", "qwen3_next", "nemotron_h")


def fused_budget(family: str, at_once: int, whole: bool = False, tree_slots: int = 0) -> int:
    """`support.engine.tight_budget` over the fused plan: about `at_once` of the longest requests,
    their pages in every token sub-pool (draft layers included) and six state slots each (the
    running and tracking slots and a round's four scratch slots, all of which admission prices),
    plus `tree_slots` each for the prefix tree's state checkpoints, which running requests' rounds
    otherwise evict."""
    target = load_checkpoint(checkpoint_dir(family)).model_spec()
    draft = load_checkpoint(draft_dir(family, whole)).model_spec()
    plan = plan_with_draft(target.decls, draft.decls, page_size=PAGE, checkpoint_interval=INTERVAL)
    fixed = size_plan(plan, 2**30, context_len=128, max_running_requests=8).fixed.total
    token_pages = sum(p.page_bytes for p in plan.sub_pools if p.kind is not PoolKind.STATE)
    state = plan.state.page_bytes if plan.state is not None else 0
    return fixed + at_once * (pages_for(92, PAGE) * token_pages + (6 + tree_slots) * state)


def serve_spec(family: str, n: int, *, k: int = 3, at_once: int = 4, whole: bool = False, poison: bool = True,
               requests=None, **overrides) -> GenerateResult:
    """`support.engine.serve` with the family's draft proposing `k` tokens per round, from a pool
    whose tree has room for six state checkpoints per request (so the requests find prefix hits);
    `requests` in place of `workload(n)`."""
    cfg = dict(budget_bytes=fused_budget(family, at_once, whole, tree_slots=6), page_size=PAGE, max_running=8,
               max_batched_tokens=48, context_len=128, checkpoint_interval=INTERVAL, ignore_eos=True,
               keep_logits=True, overlap=True, draft_model_path=str(draft_dir(family, whole)),
               num_speculative_tokens=k)
    cfg.update(overrides)
    with Engine(load_checkpoint(checkpoint_dir(family)), EngineConfig(**cfg)) as engine:
        if poison:
            engine.storage.arena.data.fill_(0xFF)
        return engine.generate(workload(n) if requests is None else requests)
