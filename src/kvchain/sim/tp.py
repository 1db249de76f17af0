"""Tensor-parallel ranks served by the scheduler loop: each rank its shard of the heads in its own
arena, every rank the same operations, every iteration's decisions digested and compared.

Each rank's plan is the model's plan at `tp_size` (`model_from_config(..., tp_size=N)`: KV heads
split across ranks, or replicated one per rank when there are fewer; Mamba and linear-attention
state heads split as engines split them). The ranks share one layout, so each sizes its plan for
the least budget of any rank (`RankLink.min_reduce`), and the layouts are all-gathered and compared
before the loop starts (`check_same_layout`). Every rank then runs the same scheduler iterations on
its own modeled device, whose completion timing differs per rank; after each iteration a rank
digests its decision log (`RankDecisions`: the allocator's logged decisions, the scheduler's
admissions, retractions and finishes, the units it holds) and the digests are compared
(`dist/tp.py::check_rank_agreement`), in one process (`run_ranks_in_process`) or one process per
rank over gloo (`tp_rank_process`, `run_rank_processes`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ..alloc.stage_capacity import StageGeometry, shared_counts
from ..build import build_kv_storage
from ..decl import KVLayerDecl
from ..device import ModeledDevice
from ..dist.pp import run_stage_processes
from ..dist.tp import RankLink, check_rank_agreement, check_same_layout, digest
from ..engine.policies import admission_policy
from ..engine.pool import KVChainPool
from ..engine.request import ScheduledRequest
from ..engine.scheduler import Scheduler
from ..errors import InputError
from ..plan import KVStoragePlan, plan_kv_storage
from ..sizing import PlanSizing, size_plan


@dataclass(frozen=True)
class RankSpec:
    """How a tensor-parallel group plans and sizes one rank: the same on every rank's process.
    `budgets` is each rank's own budget (what its device has free); the ranks size for the least."""

    config: dict
    tp_size: int
    budgets: tuple[int, ...]
    page_size: int = 4
    context_len: int = 256
    max_running_requests: int = 16
    #: mean forward duration of each rank's modeled device: ranks see completions at other times
    forward_durations: tuple[float, ...] = ()
    #: kvchain's admission on every rank (`engine.policies.admission_policy`): `exact` never
    #: retracts a decode, `optimistic` retracts when a step cannot grow
    admission: str = "exact"

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise InputError(f"tp_size must be >= 1, got {self.tp_size}")
        if len(self.budgets) != self.tp_size:
            raise InputError(f"{len(self.budgets)} rank budgets for {self.tp_size} ranks: give one per rank")

    def decls(self) -> tuple[KVLayerDecl, ...]:
        """One rank's declarations: its shard of every layer's heads."""
        from ..models.registry import model_from_config

        return model_from_config(self.config, tp_size=self.tp_size).decls

    def plan(self) -> KVStoragePlan:
        return plan_kv_storage(self.decls(), page_size=self.page_size)

    def sizing(self, budget_bytes: int) -> PlanSizing:
        return size_plan(self.plan(), budget_bytes, context_len=self.context_len,
                         max_running_requests=self.max_running_requests)

    def device(self, rank: int) -> ModeledDevice:
        """Rank `rank`'s modeled device: its own seed and forward duration, so its timing differs."""
        mean = self.forward_durations[rank] if self.forward_durations else 2.0 + 3.0 * (rank % 2)
        return ModeledDevice(seed=100 + rank, durations={"forward": mean})


def build_rank(spec: RankSpec, rank: int, budget_bytes: int) -> KVChainPool:
    """Rank `rank`'s pool over its own arena, sized for `budget_bytes` (the group's least)."""
    plan = spec.plan()
    storage = build_kv_storage(plan, spec.sizing(budget_bytes), "cpu", backend=spec.device(rank))
    return KVChainPool(storage, prefix_cache=True, policy=admission_policy(spec.admission))


def layout_of(pool: KVChainPool) -> dict:
    """What ranks sharing a layout must agree on: the arena and every band's grid."""
    return StageGeometry.of_chain(pool.chain, 0).to_dict()


# -- the decision log ----------------------------------------------------------------------------


class RankDecisions:
    """One rank's decision log, one iteration at a time: what the allocator logged
    (`ChainAllocator.decisions`: takes, moves, waits), the scheduler's admissions, retractions and
    finishes, and, at the end of the iteration, the units the rank holds."""

    def __init__(self, pool: KVChainPool, sched: Scheduler) -> None:
        self.pool = pool
        self.sched = sched
        pool.chain.decisions = []
        self._running: set[int] = set()
        self._done = 0

    def take(self) -> list:
        """This iteration's decisions (the log starts over)."""
        chain = self.pool.chain
        out, chain.decisions = chain.decisions, []
        running = {r.rid for r in self.sched.running}
        out += [("admit", rid) for rid in sorted(running - self._running)]
        done = self.sched.done[self._done:]
        self._done = len(self.sched.done)
        finished = {r.rid for r in done}
        out += [("retract", rid) for rid in sorted(self._running - running - finished)]
        out += [("finish", r.rid, r.phase.value) for r in done]
        self._running = running
        counts = shared_counts(chain)
        out.append(("held", counts.held, counts.virtual_held, counts.slots_held, self.sched.idle))
        return out


# -- the loop ------------------------------------------------------------------------------------


@dataclass
class RankLoop:
    """One rank's scheduler over a copy of the workload, stepped one iteration at a time, with an
    opportunistic flush between iterations; `iterate` returns the iteration's decisions."""

    pool: KVChainPool
    requests: list[ScheduledRequest]
    max_batched_tokens: int = 256
    digests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sched = Scheduler(self.pool, max_batched_tokens=self.max_batched_tokens,
                               max_running=self.pool.storage.sizing.max_running_requests)
        self.sched.add([copy.deepcopy(r) for r in self.requests])
        self.log = RankDecisions(self.pool, self.sched)
        self.moves = 0

    @property
    def done(self) -> bool:
        return self.sched.idle

    def iterate(self) -> list:
        if not self.sched.idle:
            self.sched.step()
        self.moves += self.pool.storage.flush_opportunistic()
        entries = self.log.take()
        self.digests.append(digest(entries))
        return entries

    def summary(self) -> dict:
        st = self.sched.stats
        return {"steps": st.steps, "finished": st.finished, "preemptions": st.preemptions, "moves": self.moves,
                "decisions": [(r.rid, r.admitted_step, r.finished_step, r.phase.value) for r in self.sched.done]}


def corrupt_count(pool: KVChainPool) -> None:
    """Corrupt one rank's count of live owner pages (a test of the agreement check)."""
    pool.chain.owner.n_live += 1


def run_ranks_in_process(spec: RankSpec, requests: list[ScheduledRequest], iterations: int,
                         corrupt: tuple[int, int] | None = None) -> list[RankLoop]:
    """Every rank side by side in one process (each its own arena and modeled device), sized for
    the least budget; after each iteration the digests are compared (`tp.rank_agreement`)."""
    budget = min(spec.budgets)
    pools = [build_rank(spec, r, budget) for r in range(spec.tp_size)]
    check_same_layout([layout_of(p) for p in pools])
    loops = [RankLoop(p, requests) for p in pools]
    for it in range(iterations):
        for r, loop in enumerate(loops):
            if corrupt == (r, it):
                corrupt_count(loop.pool)
        logs = [loop.iterate() for loop in loops]
        check_rank_agreement([loop.digests[-1] for loop in loops], it, lambda logs=logs: logs)
        if all(loop.done for loop in loops):
            break
    return loops


def tp_rank_process(rank: int, n_ranks: int, port: int, spec: RankSpec, requests: list[ScheduledRequest],
                    iterations: int, corrupt: tuple[int, int] | None = None, timeout_s: float = 20.0) -> dict:
    """One tensor-parallel rank in its own process: MIN-reduce the budget, build the rank's shard
    over its own arena, all-gather and compare the layouts, then run `iterations` scheduler
    iterations, all-gathering each iteration's decision digest (`tp.rank_agreement`). `corrupt`, a
    (rank, iteration), corrupts that rank's count of live owner pages before that iteration."""
    if spec.tp_size != n_ranks:
        raise InputError(f"the rank spec has {spec.tp_size} ranks, the group {n_ranks}")
    link = RankLink.join(rank, n_ranks, port, timeout_s)
    budget = link.min_reduce(spec.budgets[rank])
    pool = build_rank(spec, rank, budget)
    layouts = link.all_gather(layout_of(pool))
    check_same_layout(layouts)
    loop = RankLoop(pool, requests)
    for it in range(iterations):
        if corrupt == (rank, it):
            corrupt_count(pool)
        entries = loop.iterate()
        digests = link.all_gather(loop.digests[-1])
        check_rank_agreement(digests, it, lambda entries=entries: link.all_gather(entries))
        if loop.done:  # the digest folds whether the scheduler is idle: every rank leaves together
            break
    link.close()
    return {**loop.summary(), "digests": loop.digests, "budget": budget, "layout": layouts[rank],
            "bytes_per_token": StageGeometry.of_chain(pool.chain, 0).bytes_per_token()}


def run_rank_processes(spec: RankSpec, requests: list[ScheduledRequest], iterations: int,
                       corrupt: tuple[int, int] | None = None, *, timeout_s: float = 60.0,
                       env: dict[str, str] | None = None) -> dict[int, tuple[str, Any]]:
    """Run `spec.tp_size` rank processes over gloo on 127.0.0.1; each rank's ("ok", summary) or
    ("error", text). Every process started is ended before this returns."""
    return run_stage_processes(tp_rank_process, spec.tp_size, (spec, requests, iterations, corrupt),
                               timeout_s=timeout_s, env=env)
