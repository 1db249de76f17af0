"""Tensor-parallel ranks of the engine: a checkpoint's heads split across processes, each rank
serving its shard of every layer from its own pool, outputs identical to one process.

Each rank process loads the checkpoint and keeps its shard of the weights, as engines split them
(`shard_model`): the query, key and value projections by heads and the MLP's gate and up
projections by rows (column-parallel), the attention output and the MLP's down projection by
columns (row-parallel), whose partial outputs are summed over the ranks by an all-reduce
(`RowParallelLinear`). So each rank computes its own heads' attention and writes only their keys and
values into its own pool, planned at `tp_size` (`model_from_config(..., tp_size=N)`: its KV heads
split). The ranks size for the least budget of any of them and check their layouts agree; after
every step each rank digests its allocator's decisions and the units it holds, and the ranks
compare their digests (`tp.rank_agreement`). A rank runs each forward to its end before it
schedules the next (no collective overlaps another)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..alloc.stage_capacity import StageGeometry, shared_counts
from ..build import build_kv_storage
from .pp import run_stage_processes
from .tp import RankLink, check_rank_agreement, check_same_layout, digest
from ..errors import InputError
from ..models.registry import model_from_config
from ..plan import plan_kv_storage
from ..sizing import size_plan
from ..units import dtype_name
from ..engine.checkpoint import LoadedCheckpoint
from ..engine.model_pool import ModelPool
from .pp_engine import _as_tensors, _by_value, _stage_error
from ..engine.runner import ModelRunner
from ..engine.serve import Engine, EngineConfig, GenerateRequest, GenerateResult, open_checkpoint, pool_options

#: the families whose layers are attention (q/k/v/o projections) and a dense gated MLP only
TP_FAMILIES = ("llama", "gemma3")


class RowParallelLinear(torch.nn.Module):
    """A linear layer's column shard: this rank's partial output, summed over the ranks. The bias
    is added on rank 0 only, so the sum holds it once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        #: the ranks that sum their shards (None: the whole process group)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        dist.all_reduce(out, group=self.group)
        return out


def _column_shard(linear: torch.nn.Linear, lo: int, hi: int) -> torch.nn.Linear:
    """Output rows lo..hi of `linear` (a column-parallel shard)."""
    out = torch.nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None,
                          device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[lo:hi])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[lo:hi])
    return out.requires_grad_(False)


def _row_shard(linear: torch.nn.Linear, lo: int, hi: int, rank: int, group: Any = None) -> RowParallelLinear:
    bias = linear.bias.detach().clone() if linear.bias is not None and rank == 0 else None
    return RowParallelLinear(linear.weight.detach()[:, lo:hi].clone(), bias, group)


def _split(total: int, n: int, what: str) -> int:
    if total % n:
        raise InputError(f"--tp {n}: {what} ({total}) do not split evenly over {n} ranks")
    return total // n


def shard_model(model: torch.nn.Module, rank: int, n: int, group: Any = None) -> None:
    """Keep rank `rank`'s shard of every attention layer and every dense MLP of `model`; the
    row-parallel sums run over `group` (None: the whole process group)."""
    for module in list(model.modules()):
        if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            head_dim = int(module.head_dim)
            heads = _split(module.q_proj.out_features // head_dim, n, "attention heads")
            kv_heads = _split(module.k_proj.out_features // head_dim, n, "key-value heads")
            q, kv = heads * head_dim, kv_heads * head_dim
            module.q_proj = _column_shard(module.q_proj, rank * q, (rank + 1) * q)
            module.k_proj = _column_shard(module.k_proj, rank * kv, (rank + 1) * kv)
            module.v_proj = _column_shard(module.v_proj, rank * kv, (rank + 1) * kv)
            module.o_proj = _row_shard(module.o_proj, rank * q, (rank + 1) * q, rank, group)
        elif all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")):
            inner = _split(module.gate_proj.out_features, n, "MLP intermediate rows")
            module.gate_proj = _column_shard(module.gate_proj, rank * inner, (rank + 1) * inner)
            module.up_proj = _column_shard(module.up_proj, rank * inner, (rank + 1) * inner)
            module.down_proj = _row_shard(module.down_proj, rank * inner, (rank + 1) * inner, rank, group)


def check_tp_split(checkpoint: LoadedCheckpoint, config: EngineConfig, n: int) -> None:
    """Refuse, in one line and before any rank starts, what the ranks cannot split."""
    if config.device != "cpu":
        raise InputError("tensor-parallel ranks run on --device cpu (one process per rank over gloo)")
    spec = checkpoint.model_spec()
    if spec.family not in TP_FAMILIES:
        raise InputError(f"--tp {n}: the {spec.family} family is not split over ranks here (tensor-parallel "
                         f"generate serves {', '.join(TP_FAMILIES)}: attention and a dense MLP)")
    text = checkpoint.model.config.get_text_config()
    _split(int(text.num_attention_heads), n, "attention heads")
    _split(int(getattr(text, "num_key_value_heads", text.num_attention_heads)), n, "key-value heads")
    _split(int(text.intermediate_size), n, "MLP intermediate rows")


class RankEngine(Engine):
    """One tensor-parallel rank of an `Engine`: its shard of the weights, a pool of its shard of the
    KV heads, sized for the group's least budget; its decisions compared after every step."""

    def __init__(self, checkpoint: LoadedCheckpoint | str, config: EngineConfig, link: RankLink) -> None:
        config = replace(config, overlap=False)
        self.config = config
        backend, torch_device, checkpoint = open_checkpoint(checkpoint, config)
        self.checkpoint = checkpoint
        self.link = link
        shard_model(checkpoint.model, link.rank, link.n_ranks)
        spec = model_from_config(checkpoint.config_dict, kv_dtype=dtype_name(checkpoint.dtype), tp_size=link.n_ranks)
        context = config.context_len or min(spec.max_context or 4096, 4096)
        budget = link.min_reduce(config.budget_bytes)
        self.plan = plan_kv_storage(spec.decls, page_size=config.page_size)
        sizing = size_plan(self.plan, budget, context_len=context, max_running_requests=config.max_running)
        self.storage = build_kv_storage(self.plan, sizing, torch_device, backend=backend)
        self.layout = StageGeometry.of_chain(self.storage.allocator, 0)
        check_same_layout(link.all_gather(self.layout.to_dict()))
        self.runner = ModelRunner(checkpoint.model, self.plan)
        self.pool = ModelPool(self.storage, self.runner,
                              **pool_options(config, checkpoint, self.plan, overlap=False))
        self._rid = 0
        self.storage.allocator.decisions = []
        self.digests: list[str] = []

    def generate(self, requests: Sequence[GenerateRequest],
                 progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Serve every request; after each step the ranks compare their decision digests."""
        chain, link = self.storage.allocator, self.link

        def step_done(done: int, total: int) -> None:
            log, chain.decisions = chain.decisions, []
            counts = shared_counts(chain)
            log.append(("held", counts.held, counts.virtual_held, counts.slots_held, done))
            self.digests.append(digest(log))
            check_rank_agreement(link.all_gather(self.digests[-1]), len(self.digests) - 1,
                                 lambda: link.all_gather(log))
            if progress is not None:
                progress(done, total)

        return super().generate(requests, progress=step_done)


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
    out = run_stage_processes(generate_rank_process, n_ranks, (path, config, requests), timeout_s=timeout_s,
                              env=env)
    for rank in range(n_ranks):
        status, value = out[rank]
        if status != "ok":
            text = str(value).splitlines()[0] if value else "no answer within the time allowed"
            raise _stage_error(rank, status, text, "rank")
    runs = [out[r][1] for r in range(n_ranks)]
    for run in runs:
        _as_tensors(run.result)
    return runs
