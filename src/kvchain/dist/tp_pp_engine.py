"""Tensor-parallel ranks within pipeline stages: `kvchain generate --tp N --pp M`, N x M processes.

Process `stage * N + rank` is rank `rank` of stage `stage`. Each keeps its stage's layers (the
others pass the hidden states through) and its rank's shard of their weights; its pool plans its
stage's layers at `tp_size` N (its shard of their KV heads). Two dimensions of groups:

* the ranks of one stage (`tp_group`) sum the row-parallel outputs (`RowParallelLinear`), reduce the
  budget to their least, refuse to start when their layouts differ, and compare their decision
  digests after every step (`tp.rank_agreement`), as `--tp` ranks do;
* the stages of one rank (`pp_group`) all-gather their geometries and install them (PP-6), pass the
  hidden states from stage to stage and the last stage's logits back (rank r of a stage talks to
  rank r of the next), and check each step's capacity digest against the previous stage's
  (`chain.stage_capacity_agreement`, PP-15, PP-16), as `--pp` stages do.

Every process samples the same tokens, those of one process."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from ..alloc.stage_capacity import StageGeometry, check_stage_agreement
from ..build import build_kv_storage
from ..engine.checkpoint import LoadedCheckpoint
from ..engine.serve import (
    Engine,
    EngineConfig,
    GenerateRequest,
    GenerateResult,
    check_host_tier,
    handed_out,
    open_checkpoint,
)
from ..errors import InputError
from ..sizing import size_stages
from .pp import StageLink, failures, loopback_env, run_stage_processes
from .pp_engine import (
    StageRunner,
    _as_tensors,
    _by_value,
    _stage_error,
    check_stage_split,
    enable_stage_host_tier,
    plan_stage_pools,
    stage_pool,
)
from .tp import RankLink, check_same_layout
from .tp_engine import agree_with_ranks, check_tp_split, shard_model


class GroupRankLink(RankLink):
    """A rank's link to the other ranks of its stage: the collectives of `RankLink` over the stage's
    own group."""

    def __init__(self, rank: int, n_ranks: int, group: Any) -> None:
        super().__init__(rank, n_ranks)
        self.group = group

    def min_reduce(self, value: int) -> int:
        import torch

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.n_ranks
        dist.all_gather_object(out, obj, group=self.group)
        return out


def join_grid(process: int, n_ranks: int, n_stages: int, port: int,
              timeout_s: float) -> tuple[GroupRankLink, StageLink]:
    """Join the group of `n_ranks * n_stages` processes on 127.0.0.1:`port` over gloo and build both
    dimensions' groups (every process creates every group, in the same order)."""
    os.environ.update(loopback_env(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=process,
                            world_size=n_ranks * n_stages, timeout=datetime.timedelta(seconds=timeout_s))
    stage, rank = divmod(process, n_ranks)
    tp_groups = [dist.new_group([s * n_ranks + r for r in range(n_ranks)]) for s in range(n_stages)]
    pp_ranks = [[s * n_ranks + r for s in range(n_stages)] for r in range(n_ranks)]
    pp_groups = [dist.new_group(ranks) for ranks in pp_ranks]
    return (GroupRankLink(rank, n_ranks, tp_groups[stage]),
            StageLink(stage, n_stages, timeout_s, ranks=pp_ranks[rank], group=pp_groups[rank]))


class StageRankEngine(Engine):
    """Rank `rank` of pipeline stage `stage`: its stage's layers, its shard of their weights, and a
    pool of its shard of their KV heads, sized for its stage's least budget."""

    def __init__(self, checkpoint: LoadedCheckpoint | str, config: EngineConfig, ranks: GroupRankLink,
                 stages: StageLink, partition: Sequence[int] | None = None) -> None:
        check_host_tier(config)
        config = replace(config, overlap=False)
        self.config = config
        backend, torch_device, checkpoint = open_checkpoint(checkpoint, config)
        self.checkpoint = checkpoint
        self.ranks, self.link = ranks, stages
        stage, n_stages, n_ranks = stages.stage, stages.n_stages, ranks.n_ranks
        shard_model(checkpoint.model, ranks.rank, n_ranks, group=ranks.group)
        # every stage runs the whole draft (as on `--pp` stages), each rank its share of its heads
        stages_plan = plan_stage_pools(checkpoint, config, n_stages, partition, torch_device, tp_size=n_ranks)
        plans, draft, ranges = stages_plan.plans, stages_plan.draft, stages_plan.ranges
        if draft is not None:
            shard_model(draft.checkpoint.model, ranks.rank, n_ranks, group=ranks.group)
        self.sizing = size_stages(plans, ranks.min_reduce(config.budget_bytes), context_len=stages_plan.context,
                                  max_running_requests=config.max_running)
        self.plan = plans[stage]
        self.layers = ranges[stage]
        self.storage = build_kv_storage(self.plan, self.sizing.stages[stage], torch_device, backend=backend)
        self.layout = StageGeometry.of_chain(self.storage.allocator, stage)
        check_same_layout(ranks.all_gather(self.layout.to_dict()))
        self.runner = StageRunner(checkpoint.model, self.plan, stage, ranges, stages, relay=draft is not None)
        self.pool = stage_pool(self.storage, self.runner, checkpoint, config, draft, stages_plan.interval)
        self._rid = 0
        self.geometries = stages.all_gather(self.layout)
        self.storage.allocator.install_stage_capacity(self.geometries, stage)
        if config.host_budget is not None:  # as on `--pp` stages; the ranks' shards are alike
            enable_stage_host_tier(self.pool, plans, config.host_budget)
        self.storage.allocator.decisions = []
        self.stage_digests: list[str] = []
        self.rank_digests: list[str] = []

    def generate(self, requests: Sequence[GenerateRequest],
                 progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Serve every request; after each step the capacity digest goes to the next stage and the
        previous stage's is checked, then the stage's ranks compare their decision digests."""
        chain, stages, ranks = self.storage.allocator, self.link, self.ranks

        def step_done(done: int, total: int) -> None:
            mine = chain.stage_capacity.take_digest()
            self.stage_digests.append(mine)
            previous = stages.recv_previous()
            if previous is not None:
                check_stage_agreement(mine, previous, stages.stage, len(self.stage_digests) - 1)
            stages.send_next(mine)
            agree_with_ranks(chain, ranks, self.rank_digests, done)
            if progress is not None:
                progress(done, total)

        return super().generate(requests, progress=step_done)


@dataclass(frozen=True)
class GridRun:
    """What one process of the grid reports: its stage and rank, the outputs (every process samples
    the same), its layers, bytes per token and digests."""

    stage: int
    rank: int
    result: GenerateResult
    first_layer: int
    last_layer: int
    arena_bytes: int
    bytes_per_token: int
    stage_digests: list[str]
    rank_digests: list[str]


def generate_grid_process(process: int, n_processes: int, port: int, n_ranks: int, path: str,
                          config: EngineConfig, requests: list[GenerateRequest],
                          partition: tuple[int, ...] | None = None, timeout_s: float = 60.0) -> GridRun:
    """One process of `kvchain generate --tp N --pp M`."""
    ranks, stages = join_grid(process, n_ranks, n_processes // n_ranks, port, timeout_s)
    with StageRankEngine(path, config, ranks, stages, partition) as engine:
        result = _by_value(engine.generate(requests))
        run = GridRun(stages.stage, ranks.rank, result, engine.layers.start, engine.layers.stop - 1,
                      engine.storage.sizing.arena_bytes, engine.layout.bytes_per_token(), engine.stage_digests,
                      engine.rank_digests)
    stages.close()
    return run


def check_grid_split(checkpoint: LoadedCheckpoint, config: EngineConfig, n_ranks: int, n_stages: int,
                     partition: Sequence[int] | None = None) -> None:
    """Refuse, in one line and before any process starts, what the ranks or the stages cannot split."""
    check_tp_split(checkpoint, config, n_ranks, plans=False)  # a rank's plan is its stage's: checked below
    check_stage_split(checkpoint, config, n_stages, partition, tp_size=n_ranks)


def generate_in_grid(path: str, config: EngineConfig, requests: list[GenerateRequest], n_ranks: int,
                     n_stages: int, partition: tuple[int, ...] | None = None, *, timeout_s: float = 300.0,
                     env: dict[str, str] | None = None) -> list[GridRun]:
    """Serve `requests` from the checkpoint at `path` on `n_stages` stages of `n_ranks` ranks each,
    one process per (stage, rank) over gloo on 127.0.0.1; every process's report, stage-major."""
    check_host_tier(config)  # in the parent, before any process starts
    requests = handed_out(path, requests)  # checked and seeded once, here: every process samples alike
    if config.device != "cpu":
        raise InputError("tensor-parallel ranks and pipeline stages run on --device cpu (one process each over gloo)")
    if n_ranks < 2 or n_stages < 2:
        raise InputError(f"--tp {n_ranks} --pp {n_stages}: a grid needs 2 or more of each")
    n = n_ranks * n_stages
    out = run_stage_processes(generate_grid_process, n, (n_ranks, path, config, requests, partition),
                              timeout_s=timeout_s, env=env)
    for process, status, text in failures(out)[:1]:  # the first to fail: the others failed after it
        stage, rank = divmod(process, n_ranks)
        raise _stage_error(stage, status, text, f"rank {rank} of stage")
    runs = [out[p][1] for p in range(n)]
    for run in runs:
        _as_tensors(run.result)
    return runs
