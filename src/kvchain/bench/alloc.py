"""`kvchain bench alloc`: host microseconds per decode iteration, chain allocator vs a static pool.

Both replay the same seeded stream of requests (batch 256, page size 64, a hybrid model with full,
window and state sub-pools; requests finish and new ones arrive) on a `meta` arena, so only host
work is timed: pages for the new tokens, window retirement, frees, arrivals' prefills, write
locations and batch page tables per sub-pool, and (for kvchain) translation and opportunistic
compaction. Only time inside the pools counts.

Two profiles, timed in one process: `roomy` gives kvchain a budget four times what the workload
needs (no band ever meets another: nothing moves), `pressure` the least budget at which the
chain holds `pressure` (default 0.9) of the bytes the workload's requests would hold at their peak
if none were ever refused: a scheduler admits arrivals while their prefill fits and preempts the
youngest request when a decode step does not, so the pool runs above 90% utilisation, bands meet,
and relief compacts and relocates every few iterations. The static pool is sized, in both, to the workload's own peak per
sub-pool (a dry run through `PeakTrackingPool`), as an engine with fixed per-kind pools must be to
serve it. Every driver runs in alternating blocks of iterations (round robin over profiles and
pools) so machine noise hits all alike; a block of kvchain and the block of the static pool beside
it replay the same iterations, so their quotient is a like-for-like ratio, and the median over
blocks is reported. After the timed run, each profile's chain driver runs on to price the API
boundary's checks (`boundary_cost`: their own time where they run, in the thread's CPU time)."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..build import build_kv_storage
from ..decl import MHA, State, StateTensor
from ..errors import CapacityError, InputError
from ..memory.arena import arena_layout
from ..models.small import small_hybrid
from ..plan import KVStoragePlan, plan_kv_storage
from ..sizing import fixed_allocations, size_plan
from . import DEFAULT_PRESSURE
from .boundary_cost import TimerCost, measure_boundary_cost, measure_twin_cost, pool_time_step
from .static_pool import PeakTrackingPool, StaticPagedPool
from .workload import BenchRequest, decode_heavy

PROFILES = ("roomy", "pressure")
#: the roomy profile's budget over the workload's peak bytes
ROOMY_HEADROOM = 4.0
CONTEXT_LEN = 8192
WARMUP_ITERS = 100
#: rounds (one checked and one bypassed iteration each) of the boundary's cost, per profile, run
#: after the timed iterations on the same chain driver (`bench.boundary_cost`)
BOUNDARY_ROUNDS = 500
#: the boundary's cost counts the thread's CPU time: descheduled time is neither the checks' nor the pool's
BOUNDARY_CLOCK = time.thread_time_ns


def bench_plan(page_size: int = 64) -> KVStoragePlan:
    """A 32-layer hybrid: 8 full-attention layers, 8 sliding-window (1024) layers, 16 Mamba2 layers."""
    mamba = State((StateTensor("conv", (2304, 3)), StateTensor("ssm", (32, 64, 16), "float32")))
    decls = small_hybrid(MHA(8, 128), (1024,), state=mamba, state_layers=True, blocks=8)  # F S W S, 8 times
    return plan_kv_storage(decls, page_size=page_size)


@dataclass
class _Driver:
    """Keeps up to `batch` requests running on one pool, replaying the shared request stream, as a
    scheduler that admits what memory allows does: arrivals are admitted in order while their
    prefill fits, and a decode step that does not fit preempts the youngest request, which
    returns to the head of the queue to be recomputed (prompt and output so far). `pool_ns`
    accumulates the time spent inside the pool only (failed takes included), not in this driver's
    own bookkeeping.

    Each step's decisions (requests preempted, arrivals admitted) go to `log`. A driver given a
    `script` makes those decisions instead of finding them: the static pool replays the chain's,
    so both serve the same requests in the same iterations."""

    pool: object
    kvchain: bool
    batch: int
    stream: list[BenchRequest]
    script: list[tuple[int, int]] | None = None
    next_req: int = 0
    pool_ns: int = 0
    block_us: list[float] = field(default_factory=list)
    utilisation: list[float] = field(default_factory=list)
    log: list[tuple[int, int]] = field(default_factory=list)
    #: takes the pool refused (CapacityError): an admission or a decode step that did not fit
    refused: int = 0
    #: `_counters` when timing began: the reported counts are the timed iterations' alone
    counted_from: dict[str, int] = field(default_factory=dict)
    #: what `pool_ns` is timed with: wall time, or the thread's CPU time for the boundary's cost
    clock: Callable[[], int] = time.perf_counter_ns

    def __post_init__(self) -> None:
        self.rows: list[int] = []
        self.remaining: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.queue: deque[BenchRequest] = deque()
        self.blocked = False
        self.log.append((0, self._admit(self._scripted(1))))

    def _scripted(self, k: int) -> int | None:
        return None if self.script is None else self.script[len(self.log)][k]

    def _arrival(self) -> BenchRequest:
        if not self.queue:
            self.queue.append(self.stream[self.next_req % len(self.stream)])
            self.next_req += 1
        return self.queue[0]

    def _admit(self, scripted: int | None) -> int:
        """Admit arrivals in order, one take each: `scripted` of them, or as many as fit. After a
        take that did not fit, none is tried again until a request has left (memory only shrinks
        while nothing leaves), as a scheduler that knows its pool is full."""
        want = self.batch - len(self.rows) if scripted is None else scripted
        if scripted is None and self.blocked:
            return 0
        admitted = 0
        while admitted < want:
            if not self.queue:
                self.queue.append(self.stream[self.next_req % len(self.stream)])
                self.next_req += 1
            if not self._try_admit(self.queue[0], scripted is not None):
                self.blocked = True
                break
            admitted += 1
        return admitted

    def _try_admit(self, req: BenchRequest, must: bool) -> bool:
        t0 = self.clock()
        row = self.pool.alloc_row()
        rows = np.array([row])
        try:
            self.pool.alloc_extend(rows, np.array([req.prompt]))
        except CapacityError:
            self.pool.free_rows(rows)
            self.pool_ns += self.clock() - t0
            self.refused += 1
            if must:
                raise
            return False
        self.pool_ns += self.clock() - t0
        self.queue.popleft()
        self.rows.append(row)
        self.remaining[row] = req.output
        self.lengths[row] = req.prompt
        return True

    def _preempt(self) -> None:
        """The youngest request leaves; it comes back first, to recompute what it had."""
        row = self.rows.pop()
        t0 = self.clock()
        self.pool.free_rows(np.array([row]))
        self.pool_ns += self.clock() - t0
        self.blocked = False
        self.queue.appendleft(BenchRequest(self.lengths.pop(row), self.remaining.pop(row)))

    def _decode(self) -> int:
        pool = self.pool
        preempted = 0
        for _ in range(self._scripted(0) or 0):
            self._preempt()
            preempted += 1
        while True:
            rows = np.array(self.rows, dtype=np.int64)
            t0 = self.clock()
            try:
                if self.kvchain:
                    vtok = pool.alloc_decode(rows)
                    pool.iteration_ids(vtok, rows)
                    pool.runner_ids(rows)
                    pool.advance(rows)
                else:
                    pool.alloc_decode(rows)
                    pool.page_tables(rows)
                    pool.advance(rows)
            except CapacityError:
                self.pool_ns += self.clock() - t0
                self.refused += 1
                if self.script is not None or len(self.rows) <= 1:
                    raise
                self._preempt()
                preempted += 1
                continue
            self.pool_ns += self.clock() - t0
            return preempted

    def step(self) -> None:
        preempted = self._decode()
        done = []
        for row in self.rows:
            self.remaining[row] -= 1
            self.lengths[row] += 1
            if self.remaining[row] <= 0:
                done.append(row)
        if done:
            t0 = self.clock()
            self.pool.free_rows(np.array(done))
            self.pool_ns += self.clock() - t0
            self.blocked = False
            for row in done:
                self.rows.remove(row)
                del self.remaining[row], self.lengths[row]
        admitted = self._admit(self._scripted(1))
        self.log.append((preempted, admitted))
        if self.kvchain:
            t0 = self.clock()
            self.pool.flush_opportunistic()
            self.pool_ns += self.clock() - t0

    def run_block(self, n: int, sample: bool) -> None:
        """`n` steps, their mean pool time appended to `block_us`; with `sample`, the chain's
        utilisation after every step (read outside the timing)."""
        start = self.pool_ns
        for _ in range(n):
            self.step()
            if sample:
                self.utilisation.append(self.pool.stats().utilisation)
        self.block_us.append((self.pool_ns - start) / n / 1e3)


def dry_run(pool, kvchain: bool, batch: int, stream: list[BenchRequest], steps: int,
            script: list[tuple[int, int]] | None = None) -> _Driver:
    """Drive `steps` iterations untimed: a kvchain dry run finds the decisions (`log`) the timed
    run will make again, a `PeakTrackingPool` one the pages each sub-pool needs for them."""
    driver = _Driver(pool, kvchain, batch, stream, script)
    for _ in range(steps):
        driver.step()
    return driver


def roomy_static(plan: KVStoragePlan, batch: int) -> tuple[object, dict[str, int]]:
    """A sizing for the static pool's rows and context, and pools no workload runs dry."""
    sizing = size_plan(plan, 2**40, context_len=CONTEXT_LEN, max_running_requests=batch)
    return sizing, {p.name: batch * -(-CONTEXT_LEN // plan.page_size) for p in plan.sub_pools}


def budget_for_chain(plan: KVStoragePlan, chain_bytes: int, batch: int) -> int:
    """The least budget whose arena's chain holds at least `chain_bytes` (fixed allocations and the
    sink region come first)."""
    fixed = fixed_allocations(plan, CONTEXT_LEN, batch).total
    budget = fixed + chain_bytes
    while True:
        have = arena_layout(plan, budget - fixed).chain_bytes
        if have >= chain_bytes:
            return budget
        budget += chain_bytes - have


def block_ratios(kv_blocks: list[float], static_blocks: list[float]) -> list[float]:
    return [k / s for k, s in zip(kv_blocks, static_blocks)]


def _counters(kv: _Driver) -> dict[str, int]:
    stats = kv.pool.stats()
    return {"reliefs": kv.pool.allocator.reliefs, "moves": stats.moves, "relocations": stats.relocations,
            "moved_bytes": kv.pool.allocator.copier.bytes_moved, "refused_takes": kv.refused}


def summarise(name: str, budget: int, kv: _Driver, static: _Driver, iters: int) -> dict:
    """One profile's figures: medians over blocks, the ratio the median of per-block ratios."""
    util = kv.utilisation
    return {
        "profile": name,
        "budget_bytes": budget,
        "static_pool_bytes": static.pool.pool_bytes(),
        "kvchain_us_per_iter": round(statistics.median(kv.block_us), 2),
        "static_us_per_iter": round(statistics.median(static.block_us), 2),
        "ratio": round(statistics.median(block_ratios(kv.block_us, static.block_us)), 3),
        "kvchain_mean_us_per_iter": round(kv.pool_ns / iters / 1e3, 2),
        "static_mean_us_per_iter": round(static.pool_ns / iters / 1e3, 2),
        "kvchain_block_us": [round(x, 2) for x in kv.block_us],
        "static_block_us": [round(x, 2) for x in static.block_us],
        "utilisation_mean": round(float(np.mean(util)), 4) if util else None,
        "utilisation_min": round(float(np.min(util)), 4) if util else None,
        **{key: n - kv.counted_from.get(key, 0) for key, n in _counters(kv).items()},
        "requests_served": kv.next_req,
        "preemptions": sum(p for p, _a in kv.log[-iters:]),
        "admissions": sum(a for _p, a in kv.log[-iters:]),
    }


def run_alloc_bench(iters: int = 2000, batch: int = 256, page_size: int = 64, seed: int = 0,
                    profiles: tuple[str, ...] = PROFILES, pressure: float = DEFAULT_PRESSURE, block: int = 50,
                    progress=None) -> dict:
    """Every profile in one process, all drivers interleaved in blocks of `block` iterations.
    Counters (reliefs, moves, utilisation) cover the timed iterations only."""
    if not 0.0 < pressure <= 1.0:
        raise InputError(f"pressure must lie in (0, 1], got {pressure}")
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown or not profiles:
        raise InputError(f"profiles must be among {', '.join(PROFILES)}, got {', '.join(profiles) or 'none'}")
    plan = bench_plan(page_size)
    stream = decode_heavy(4096, seed, CONTEXT_LEN)
    warmup = min(WARMUP_ITERS, iters)
    steps = warmup + iters
    big_sizing, big_pages = roomy_static(plan, batch)
    peak = dry_run(PeakTrackingPool(plan, big_sizing, big_pages), False, batch, stream, steps).pool.peak_bytes
    pairs = {}
    #: per profile, three twins of the chain driver for the whole run's boundary cost
    twins: dict[str, list[_Driver]] = {}
    for name in profiles:
        chain_bytes = int(peak * ROOMY_HEADROOM) if name == "roomy" else int(peak * pressure)
        budget = budget_for_chain(plan, chain_bytes, batch)
        sizing = size_plan(plan, budget, context_len=CONTEXT_LEN, max_running_requests=batch)
        script = dry_run(build_kv_storage(plan, sizing, "meta"), True, batch, stream, steps).log
        tracker = dry_run(PeakTrackingPool(plan, big_sizing, big_pages), False, batch, stream, steps, script).pool
        kv = _Driver(build_kv_storage(plan, sizing, "meta"), True, batch, stream)
        static = _Driver(StaticPagedPool(plan, sizing, tracker.peak_pages), False, batch, stream, script)
        pairs[name] = (budget, kv, static)
        twins[name] = [_Driver(build_kv_storage(plan, sizing, "meta"), True, batch, stream, clock=BOUNDARY_CLOCK)
                       for _ in range(3)]
    for _ in range(warmup):
        for _budget, kv, static in pairs.values():
            kv.step()
            static.step()
    for _budget, kv, _static in pairs.values():
        kv.counted_from = _counters(kv)
    # Serving engines freeze the objects that live for the whole process after start-up, so a
    # full collection does not walk torch's module graph in the middle of a step; do the same.
    gc.collect()
    gc.freeze()
    try:
        for _budget, kv, static in pairs.values():
            kv.pool_ns = static.pool_ns = 0
        done = 0
        while done < iters:
            n = min(block, iters - done)
            for _budget, kv, static in pairs.values():
                kv.run_block(n, sample=True)
                static.run_block(n, sample=False)
            done += n
            if progress is not None:
                progress(n)
    finally:
        gc.unfreeze()
    for name, (_budget, kv, static) in pairs.items():
        if kv.log != static.script[: len(kv.log)]:
            raise RuntimeError(f"{name}: the timed chain run decided otherwise than its dry run")
    results = {name: summarise(name, budget, kv, static, iters) for name, (budget, kv, static) in pairs.items()}
    timer = TimerCost.measure(clock=BOUNDARY_CLOCK)
    gc.collect()
    gc.freeze()
    try:
        for name, (_budget, kv, _static) in pairs.items():
            # The API boundary's checks, measured on the chain driver as it left the timed run, in
            # the thread's CPU time: their own time inside checked iterations (the headline), and
            # checked against bypassed iterations.
            kv.clock = BOUNDARY_CLOCK
            cost = measure_boundary_cost(pool_time_step(kv), kv.pool, rounds=min(BOUNDARY_ROUNDS, iters),
                                         timer=timer, clock=BOUNDARY_CLOCK)
            results[name]["boundary"] = cost.as_dict()
            checked, bypassed, control = twins[name]
            for _ in range(warmup):
                for twin in twins[name]:
                    twin.step()
            twin_cost = measure_twin_cost(pool_time_step(checked), (pool_time_step(bypassed), bypassed.pool),
                                          pool_time_step(control), rounds=min(BOUNDARY_ROUNDS, iters))
            if not checked.log == bypassed.log == control.log:
                raise RuntimeError(f"{name}: the boundary's twins decided otherwise than each other")
            results[name]["boundary"]["twins"] = twin_cost.as_dict()
            results[name]["boundary_ratio"] = results[name]["boundary"]["own_ratio"]
    finally:
        gc.unfreeze()
    worst = max(results.values(), key=lambda r: r["ratio"])
    costliest = max(results.values(), key=lambda r: r["boundary_ratio"])
    return {
        "headline": {
            "worst_profile": worst["profile"],
            "ratio": worst["ratio"],
            "kvchain_us_per_iter": worst["kvchain_us_per_iter"],
            "static_us_per_iter": worst["static_us_per_iter"],
            "boundary_ratio": costliest["boundary_ratio"],
            "boundary_profile": costliest["profile"],
        },
        "iters": iters,
        "batch": batch,
        "page_size": page_size,
        "block": block,
        "pressure": pressure,
        "workload_peak_bytes": peak,
        "profiles": results,
    }
