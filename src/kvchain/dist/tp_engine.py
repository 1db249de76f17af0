"""Tensor-parallel ranks of the engine: a checkpoint's heads split across processes, each rank
serving its shard of every layer from its own pool, outputs identical to one process.

Each rank process loads the checkpoint and keeps its shard of the weights, as engines split them
(`tp_shard.shard_model`: attention, MLPs, MoE experts, Mamba1, Mamba2, Zamba, gated DeltaNet, KDA,
lightning and RG-LRU mixers by heads or inner rows, each layer's output projection by columns with an
all-reduce after it). So each rank
computes its own heads and writes only their keys, values and state into its own pool, planned at
`tp_size` (`model_from_config(..., tp_size=N)`: its KV and state heads split). The ranks size
for the least budget of any of them and check their layouts agree; after every step each rank
digests its allocator's decisions and the units it holds, and the ranks compare their digests
(`tp.rank_agreement`). A rank runs each forward to its end before it
schedules the next (no collective overlaps another). A draft splits as the target does: its layers
are layers of each rank's fused plan, its heads sharded the same way, and every rank verifies and
accepts the same proposals (the logits are whole on every rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..alloc.stage_capacity import StageGeometry, shared_counts
from ..build import build_kv_storage
from ..engine.checkpoint import LoadedCheckpoint
from ..engine.model_pool import ModelPool
from ..engine.runner import ModelRunner
from ..engine.serve import (
    Engine,
    EngineConfig,
    GenerateRequest,
    GenerateResult,
    check_host_tier,
    check_process_plans,
    engine_plan,
    handed_out,
    open_checkpoint,
    pool_options,
)
from ..engine.speculative_setup import speculative_pool
from ..errors import InputError
from ..sizing import size_plan
from .pp import failures, run_stage_processes
from .pp_engine import _as_tensors, _by_value, _stage_error
from .tp import RankLink, check_rank_agreement, check_same_layout, digest
from .tp_shard import check_split, shard_model


def check_tp_split(checkpoint: LoadedCheckpoint, config: EngineConfig, n: int, plans: bool = True) -> None:
    """Refuse, in one line and before any rank starts, what the ranks cannot split: the KV and
    state heads the pool plans per rank, and every layer's heads and inner rows, the fused draft's
    too; with `plans`, also what a rank's engine would refuse as it starts (`check_process_plans`:
    the budget, the step's tokens, the host budget; under pipeline stages a rank's plan is its
    stage's, checked with the stages)."""
    if config.device != "cpu":
        raise InputError("tensor-parallel ranks run on --device cpu (one process per rank over gloo)")
    planned = engine_plan(checkpoint, config, torch.device("cpu"), tp_size=n)  # as each rank plans it
    check_split(checkpoint.model, n, planned.spec.decls)
    if planned.draft is not None:
        check_split(planned.draft.checkpoint.model, n, planned.draft.fused_decls)
    if plans:
        check_process_plans([planned.plan], config, planned.context, planned.interval)


class RankEngine(Engine):
    """One tensor-parallel rank of an `Engine`: its shard of the weights, a pool of its shard of the
    KV heads, sized for the group's least budget; its decisions compared after every step."""

    def __init__(self, checkpoint: LoadedCheckpoint | str, config: EngineConfig, link: RankLink) -> None:
        check_host_tier(config)
        config = replace(config, overlap=False)
        self.config = config
        backend, torch_device, checkpoint = open_checkpoint(checkpoint, config)
        self.checkpoint = checkpoint
        self.link = link
        n = link.n_ranks
        planned = engine_plan(checkpoint, config, torch_device, tp_size=n)
        check_split(checkpoint.model, n, planned.spec.decls)
        shard_model(checkpoint.model, link.rank, n)
        draft = planned.draft
        if draft is not None:
            # the draft's heads split as the target's: its layers are layers of the rank's fused plan
            check_split(draft.checkpoint.model, n, draft.fused_decls)
            shard_model(draft.checkpoint.model, link.rank, n)
        budget = link.min_reduce(config.budget_bytes)
        self.plan = planned.plan
        sizing = size_plan(self.plan, budget, context_len=planned.context, max_running_requests=config.max_running)
        self.storage = build_kv_storage(self.plan, sizing, torch_device, backend=backend)
        self.layout = StageGeometry.of_chain(self.storage.allocator, 0)
        check_same_layout(link.all_gather(self.layout.to_dict()))
        self.runner = ModelRunner(checkpoint.model, self.plan)
        options = pool_options(config, checkpoint, self.plan, overlap=False,
                               interval=planned.interval)
        if draft is None:
            self.pool = ModelPool(self.storage, self.runner, **options)
        else:
            self.pool = speculative_pool(self.storage, self.runner, draft, config, options)
        if config.host_budget is not None:  # each rank backs up its own shard of the heads, in lockstep
            self.pool.enable_host_tier(config.host_budget)
            self.pool.hicache.lockstep = True
        self._rid = 0
        self.storage.allocator.decisions = []
        self.digests: list[str] = []

    def generate(self, requests: Sequence[GenerateRequest],
                 progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Serve every request; after each step the ranks compare their decision digests."""
        def step_done(done: int, total: int) -> None:
            agree_with_ranks(self.storage.allocator, self.link, self.digests, done)
            if progress is not None:
                progress(done, total)

        return super().generate(requests, progress=step_done)


def agree_with_ranks(chain, ranks, digests: list[str], done: int) -> None:
    """A step's end on one rank: its allocator's decisions and the units it holds digested (into
    `digests`) and compared with every rank of `ranks` (anything with `all_gather`), which
    `tp.rank_agreement` fails naming the first differing decision."""
    log, chain.decisions = chain.decisions, []
    counts = shared_counts(chain)
    log.append(("held", counts.held, counts.virtual_held, counts.slots_held, done))
    digests.append(digest(log))
    check_rank_agreement(ranks.all_gather(digests[-1]), len(digests) - 1, lambda: ranks.all_gather(log))


@dataclass(frozen=True)
class RankRun:
    """What one rank process reports: the outputs (every rank samples the same), its pool's bytes
    per token and arena, and its digests."""

    result: GenerateResult
    arena_bytes: int
    bytes_per_token: int
    digests: list[str]


def generate_rank_process(rank: int, n_ranks: int, port: int, path: str, config: EngineConfig,
                          requests: list[GenerateRequest], timeout_s: float = 60.0) -> RankRun:
    """One rank of `kvchain generate --tp N` in its own process."""
    link = RankLink.join(rank, n_ranks, port, timeout_s)
    with RankEngine(path, config, link) as engine:
        result = _by_value(engine.generate(requests))
        run = RankRun(result, engine.storage.sizing.arena_bytes, engine.layout.bytes_per_token(), engine.digests)
    link.close()
    return run


def generate_in_ranks(path: str, config: EngineConfig, requests: list[GenerateRequest], n_ranks: int, *,
                      timeout_s: float = 300.0, env: dict[str, str] | None = None) -> list[RankRun]:
    """Serve `requests` from the checkpoint at `path` with its heads split over `n_ranks` rank
    processes over gloo on 127.0.0.1; every rank's report, in rank order."""
    check_host_tier(config)  # in the parent, before any process starts
    requests = handed_out(path, requests)  # checked and seeded once, here: every process samples alike
    out = run_stage_processes(generate_rank_process, n_ranks, (path, config, requests), timeout_s=timeout_s,
                              env=env)
    for rank, status, text in failures(out)[:1]:  # the first to fail: the others failed after it
        raise _stage_error(rank, status, text, "rank")
    runs = [out[r][1] for r in range(n_ranks)]
    for run in runs:
        _as_tensors(run.result)
    return runs
