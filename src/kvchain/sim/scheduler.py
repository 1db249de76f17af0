"""A model-free serving loop: it admits, chunks, decodes and finishes requests through any `Pool`.

Each step: arrivals join the waiting queue (or are rejected at arrival); running requests get their
next prefill chunk or one decode token (on a full pool the newest running request is preempted and
recomputes later); waiting requests are admitted first come first served under a token budget and
a running cap; then the step's "forward" happens (tokens appear; no model runs), the pool takes
checkpoints and retires window rows, and finished requests are cached and freed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..prefill_budget import Decision
from .protocol import Pool, PoolFull
from .request import Phase, SimRequest


@dataclass
class StepRecord:
    step: int
    running: int
    waiting: int
    output_tokens: int
    prefill_tokens: int
    utilisation: float


@dataclass
class SchedulerStats:
    steps: int = 0
    output_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    peak_running: int = 0
    history: list[StepRecord] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: Pool, *, max_batched_tokens: int = 8192, max_running: int = 256,
                 max_wait_steps: int | None = None) -> None:
        if max_batched_tokens <= 0 or max_running <= 0:
            raise ValueError("max_batched_tokens and max_running must be positive")
        self.pool = pool
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        #: a request admitted nowhere for this many steps while nothing runs is a scheduler bug
        self.max_wait_steps = max_wait_steps
        self.pending: deque[SimRequest] = deque()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.done: list[SimRequest] = []
        self.stats = SchedulerStats()
        self.step_no = 0

    def add(self, requests: list[SimRequest]) -> None:
        for req in sorted(requests, key=lambda r: (r.arrival, r.rid)):
            req.phase = Phase.PENDING
            self.pending.append(req)

    @property
    def idle(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------

    def _arrivals(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step_no:
            req = self.pending.popleft()
            reason = self.pool.arrival_check(req)
            if reason is not None:
                req.phase, req.reason = Phase.REJECTED, reason
                self.stats.rejected += 1
                self.done.append(req)
            else:
                req.phase = Phase.WAITING
                self.waiting.append(req)

    def _grow_running(self, budget: int) -> tuple[list[tuple[SimRequest, int]], int]:
        """Next chunk for running prefills, one token for decodes. On a full pool, prefill chunks
        shrink first (down to the pool's smallest chunk); then the newest request is preempted."""
        prefill_cap = budget
        min_chunk = getattr(self.pool, "min_chunk", 1)
        while True:
            plan: list[tuple[SimRequest, int]] = []
            left = budget
            prefills = 0
            for req in self.running:
                if req.prefilling:
                    chunk = self.pool.next_chunk(req, min(left, prefill_cap))
                    if chunk > 0:
                        prefills += 1
                        plan.append((req, req.computed + chunk))
                        left -= chunk
                elif left > 0:
                    plan.append((req, req.computed + 1))
                    left -= 1
            if not plan:
                return plan, left
            try:
                self.pool.extend([r for r, _ in plan], [n for _, n in plan])
                return plan, left
            except PoolFull:
                if prefills and prefill_cap > min_chunk:
                    prefill_cap = max(min_chunk, prefill_cap // 2)
                    continue
                victim = max(self.running, key=lambda r: (r.admitted_step, r.rid))
                self._preempt(victim)
                prefill_cap = budget

    def _preempt(self, req: SimRequest) -> None:
        self.pool.preempt(req)
        self.running.remove(req)
        req.phase = Phase.WAITING
        req.computed = 0
        req.row = -1
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, budget: int) -> list[tuple[SimRequest, int]]:
        admitted: list[tuple[SimRequest, int]] = []
        if not self.waiting:
            return admitted
        ctx = self.pool.begin_pass(self.running, frees_coming=bool(self.running))
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            a = self.pool.try_admit(ctx, req, budget)
            if a.decision is Decision.WAIT:
                break  # first come first served
            self.waiting.popleft()
            if a.decision is Decision.ABORT:
                req.phase, req.reason = Phase.ABORTED, a.reason
                self.stats.aborted += 1
                self.done.append(req)
                continue
            req.phase = Phase.RUNNING
            req.admitted_step = self.step_no
            self.running.append(req)
            self.stats.cached_tokens += req.cached
            admitted.append((req, req.computed))  # the pool already took cached + first chunk
            budget -= a.chunk_len
        return admitted

    def step(self) -> StepRecord:
        self._arrivals()
        plan, budget = self._grow_running(self.max_batched_tokens)
        admitted = self._admit(budget)
        # the forward: every planned request advances to its new length; the last prompt chunk
        # samples the first output token (a recomputed request already has its tokens)
        out_tokens = prefill_tokens = 0
        stepped: list[SimRequest] = []
        for req, new_len in plan:
            was_prefilling = req.prefilling
            grown = new_len - req.computed
            req.computed = new_len
            if was_prefilling:
                prefill_tokens += grown
                if not req.prefilling and req.generated == 0:
                    req.generated = 1
                    out_tokens += 1
            else:
                req.generated += 1
                out_tokens += 1
            stepped.append(req)
        for req, _ in admitted:
            prefill_tokens += req.computed - req.cached
            if not req.prefilling and req.generated == 0:
                req.generated = 1
                out_tokens += 1
            stepped.append(req)
        if stepped:
            self.pool.processed(stepped)
        for req in list(self.running):
            if not req.prefilling and req.done:
                self.pool.finish(req)
                self.running.remove(req)
                req.phase = Phase.FINISHED
                req.finished_step = self.step_no
                self.stats.finished += 1
                self.done.append(req)
        stats = self.pool.stats()
        record = StepRecord(self.step_no, len(self.running), len(self.waiting), out_tokens, prefill_tokens,
                            stats.utilisation)
        self.stats.history.append(record)
        self.stats.output_tokens += out_tokens
        self.stats.prefill_tokens += prefill_tokens
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        self.stats.steps += 1
        self.step_no += 1
        if self.max_wait_steps and not self.running and self.waiting and not admitted:
            head = self.waiting[0]
            if self.step_no - head.arrival > self.max_wait_steps:
                raise RuntimeError(f"request {head.rid} waited {self.step_no - head.arrival} steps with nothing running")
        return record

    def run(self, max_steps: int = 10**7, progress=None) -> SchedulerStats:
        while not self.idle and self.step_no < max_steps:
            self.step()
            if progress is not None:
                progress(self)
        return self.stats
