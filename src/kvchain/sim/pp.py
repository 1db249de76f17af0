"""Pipeline stages served by the scheduler loop: each stage its own arena of its own layers, every
stage the same logical operations, every capacity question asked of every stage's geometry.

`build_stage` plans, sizes and builds one stage's pool; `install_stages` hands every stage's
geometry to its chain (PP-6); `StageLoop` drives one stage's scheduler one iteration at a time and
returns the iteration's capacity digest (PP-15), which `run_stages_in_process` (one process, the
stages side by side) or `dist/pp.py` (one process per stage) compares against the previous stage's
(PP-16). `StageLoop` processes each step at once; `sim/pp_microbatch.py` keeps `pp_size`
micro-batches in flight on a stage's device, with the barrier after each iteration's result
processing (LIFE-7)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..alloc.stage_capacity import StageGeometry, check_stage_agreement
from ..build import build_kv_storage
from ..decl import KVLayerDecl
from ..device.base import Device
from ..engine.policies import admission_policy
from ..engine.pool import KVChainPool
from ..engine.request import ScheduledRequest
from ..engine.scheduler import Scheduler
from ..errors import InputError
from ..plan import plan_stages
from ..sizing import PipelineSizing, size_stages


@dataclass(frozen=True)
class StageSpec:
    """How a pipeline splits and sizes a model: the same on every stage's process."""

    decls: tuple[KVLayerDecl, ...]
    n_stages: int
    budget_bytes: int
    page_size: int = 4
    partition: tuple[int, ...] | None = None
    context_len: int = 256
    max_running_requests: int = 16
    #: the receive interval of the loop: the digest checks need one receive per iteration (PP-17)
    recv_interval: int = 1
    #: kvchain's admission on every stage (`engine.policies.admission_policy`): `exact` never
    #: retracts a decode, `optimistic` retracts when a step cannot grow
    admission: str = "exact"

    def sizing(self) -> tuple[list, PipelineSizing]:
        plans = plan_stages(self.decls, self.n_stages, page_size=self.page_size, partition=self.partition)
        return plans, size_stages(plans, self.budget_bytes, context_len=self.context_len,
                                  max_running_requests=self.max_running_requests)


def build_stage(spec: StageSpec, stage: int, device: str = "cpu", backend: Device | None = None) -> KVChainPool:
    """Stage `stage`'s pool over its own arena (no stage capacity installed yet), on `backend`
    (None: the device string's own)."""
    plans, sizing = spec.sizing()
    storage = build_kv_storage(plans[stage], sizing.stages[stage], device, backend=backend)
    return KVChainPool(storage, prefix_cache=True, policy=admission_policy(spec.admission))


def install_stages(pools: Sequence[KVChainPool], geometries: Sequence[StageGeometry] | None = None) -> None:
    """Install every stage's geometry on every stage's chain (the all-gather, in one process)."""
    if geometries is None:
        geometries = [StageGeometry.of_chain(p.chain, i) for i, p in enumerate(pools)]
    for i, pool in enumerate(pools):
        pool.chain.install_stage_capacity(geometries, i)


@dataclass
class StageLoop:
    """One stage's scheduler over a copy of the workload, stepped one iteration at a time; between
    iterations an opportunistic flush compacts the ends (the engine's idle-time compaction)."""

    pool: KVChainPool
    requests: list[ScheduledRequest]
    max_batched_tokens: int = 256
    flush: bool = True
    recv_interval: int = 1
    digests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from .. import env

        if self.recv_interval != 1 and env.invariant_level():
            raise InputError(f"stage digest checks need a receive interval of 1, got {self.recv_interval} "
                             "(KVCHAIN_INVARIANT_CHECK is on)")
        self.sched = Scheduler(self.pool, max_batched_tokens=self.max_batched_tokens,
                               max_running=self.pool.storage.sizing.max_running_requests)
        self.sched.add([copy.deepcopy(r) for r in self.requests])
        self.moves = 0

    @property
    def done(self) -> bool:
        return self.sched.idle

    def iterate(self) -> str:
        """One scheduler iteration (the step's requests), then this stage's digest of it."""
        if not self.sched.idle:
            self.sched.step()
        if self.flush:
            self.moves += self.pool.storage.flush_opportunistic()
        digest = self.pool.chain.stage_capacity.take_digest()
        self.digests.append(digest)
        return digest

    def summary(self) -> dict:
        st = self.sched.stats
        return {"steps": st.steps, "finished": st.finished, "aborted": st.aborted, "rejected": st.rejected,
                "preemptions": st.preemptions, "output_tokens": st.output_tokens, "moves": self.moves,
                "relocations": self.pool.chain.relocations,
                "decisions": [(r.rid, r.admitted_step, r.finished_step, r.phase.value) for r in self.sched.done]}


def run_stages_in_process(pools: Sequence[KVChainPool], requests: list[ScheduledRequest], iterations: int,
                          **loop_kwargs) -> list[StageLoop]:
    """Every stage's loop side by side in one process: after each iteration each stage's digest is
    checked against the previous stage's (`chain.stage_capacity_agreement`)."""
    loops = [StageLoop(p, requests, **loop_kwargs) for p in pools]
    for it in range(iterations):
        digests = [loop.iterate() for loop in loops]
        for stage in range(1, len(loops)):
            check_stage_agreement(digests[stage], digests[stage - 1], stage, it)
        if all(loop.done for loop in loops):
            break
    return loops


def stage_process(stage: int, n_stages: int, port: int, spec: StageSpec, requests: list[ScheduledRequest],
                  iterations: int, corrupt: tuple[int, int] | None = None, timeout_s: float = 20.0) -> dict:
    """One stage of a pipeline in its own process: build the stage's pool, all-gather every stage's
    geometry and install it (PP-6), then run `iterations` scheduler iterations, receiving the previous
    stage's digest and sending this stage's to the next after each (PP-15, PP-16). `corrupt`, a
    (stage, iteration), corrupts that stage's count of live owner pages before that iteration (a
    test of the check)."""
    from ..dist.pp import StageLink

    if spec.n_stages != n_stages:
        raise InputError(f"the stage spec splits {spec.n_stages} stages, the group has {n_stages}")
    link = StageLink.join(stage, n_stages, port, timeout_s)
    # on an error the group is left as it is: a teardown would wait on the peers' unmatched sends,
    # and the process ends anyway
    pool = build_stage(spec, stage)
    geometries = link.all_gather(StageGeometry.of_chain(pool.chain, stage))
    pool.chain.install_stage_capacity(geometries, stage)
    loop = StageLoop(pool, requests, recv_interval=spec.recv_interval)
    for it in range(iterations):
        if corrupt == (stage, it):
            pool.chain.owner.n_live += 1
        digest = loop.iterate()
        previous = link.recv_previous()
        if previous is not None:
            check_stage_agreement(digest, previous, stage, it)
        link.send_next(digest)
    link.close()
    return {**loop.summary(), "digests": loop.digests, "geometries": [g.to_dict() for g in geometries]}
