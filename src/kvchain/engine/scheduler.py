"""A model-free serving loop: it admits, chunks, decodes and finishes requests through any `Pool`.

Each step, as the engines schedule: arrivals join the waiting queue (or are rejected at arrival);
running decodes get one token each, then running prefills their next chunk, all within one token
budget; when the step cannot grow, the pool's policy decides who gives way (running prefills pause
first where it says so, then running requests are retracted in its order, as few as make room,
and recompute later; a step that paused or retracted admits nothing); waiting requests are admitted first come first served (by priority, then
arrival, under priority scheduling) under the budget left and the running cap, a more important
request preempting less important running work when admission says that makes room; then the
step's "forward" happens (tokens appear; no model runs), the pool takes checkpoints and retires
window rows, and finished requests are cached and freed."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InputError, KVChainError
from ..prefill_budget import Decision
from ..units import is_integer
from .policies import ExactPolicy, SchedulePolicy
from .pool import PoolFull
from .protocol import Pool
from .request import Phase, ScheduledRequest


class SchedulerStuck(KVChainError):
    """The loop cannot make progress: a scheduler or pool bug, never an outcome of a workload."""


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
    #: KV tokens computed again after a retraction (prefill tokens spent twice), cache hits excluded
    recomputed_tokens: int = 0
    #: prompt tokens a retracted request found cached when it came back (not counted as hits)
    recompute_cached_tokens: int = 0
    #: admissions that preempted less important running work
    priority_preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    peak_running: int = 0
    history: list[StepRecord] = field(default_factory=list)


def check_token_budget(pool: Pool, max_batched_tokens: int, max_running: int) -> None:
    """Refuse a step budget under which some request could never be scheduled (`check_step_budget`),
    for `pool`'s checkpoint interval."""
    check_step_budget(max_batched_tokens, max_running, getattr(pool, "checkpoint_interval", None),
                      getattr(pool, "name", None), getattr(pool, "uniform", None) is not None)


def check_step_budget(max_batched_tokens: int, max_running: int, interval: int | None, name: str | None = None,
                      uniform: bool = False) -> None:
    """Refuse a step budget under which some request could never be scheduled: non-positive limits,
    and a token budget below the checkpoint `interval`. Every prefill chunk of a prompt but its last
    ends on the checkpoint grid (`mamba_prefill_chunk_grid`), so under a smaller budget no chunk of
    a longer prompt would ever fit a step, and it would wait forever. `name`: the pool's, to say
    whose budget; `uniform`: a uniform-page layout, whose grid is its block size."""
    if not (is_integer(max_batched_tokens) and is_integer(max_running)) or max_batched_tokens <= 0 or max_running <= 0:
        raise InputError(f"max_batched_tokens and max_running must be positive integers, got {max_batched_tokens!r} "
                         f"and {max_running!r}")
    if interval and max_batched_tokens < interval:
        # a uniform-page layout's grid is its block size, which no checkpoint flag changes
        grid = "its block size" if uniform else "the checkpoint interval"
        raise InputError(f"{name + ': ' if name else ''}max_batched_tokens {max_batched_tokens} is below {grid} "
                         f"{interval}: a prefill chunk of a model with recurrent state ends on the checkpoint grid; "
                         f"give at least {interval} tokens a step{'' if uniform else ', or checkpoint more often'}")


class Scheduler:
    def __init__(self, pool: Pool, *, max_batched_tokens: int = 8192, max_running: int = 256,
                 max_wait_steps: int | None = None, priority: bool = False) -> None:
        check_token_budget(pool, max_batched_tokens, max_running)
        if not isinstance(priority, bool):
            raise InputError(f"priority must be a bool, got {priority!r}")
        if max_wait_steps is not None and (not is_integer(max_wait_steps) or max_wait_steps < 1):
            raise InputError(f"max_wait_steps must be None or a positive integer, got {max_wait_steps!r}")
        self.pool = pool
        self.policy: SchedulePolicy = getattr(pool, "policy", None) or ExactPolicy()
        #: order the waiting queue by priority and let important requests preempt less important ones
        self.priority = priority
        self._retracted = self._paused = False
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        #: a request admitted nowhere for this many steps while nothing runs is a scheduler bug
        self.max_wait_steps = max_wait_steps
        self.pending: deque[ScheduledRequest] = deque()
        #: closed-loop sessions' next turns, by the rid of the turn whose finish releases them
        self.held: dict[int, list[ScheduledRequest]] = {}
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self.done: list[ScheduledRequest] = []
        self.stats = SchedulerStats()
        self.step_no = 0
        #: tokens a running decode yields this step (None: one); the simulator's speculative mode
        #: sets it (`sim/speculative.py::SpecSteps`)
        self.decode_tokens: Callable[[ScheduledRequest], int] | None = None

    def add(self, requests: list[ScheduledRequest]) -> None:
        """Requests to serve: each arrives at its `arrival` step, except a closed-loop session's
        next turn (`follows`), held until the turn it follows has finished (or been rejected) and
        `gap` steps more have passed: a user sends the next turn only after reading the answer."""
        known = {r.rid for r in requests} | {r.rid for r in self.done}
        for req in requests:
            if req.follows >= 0 and req.follows not in known:
                raise InputError(f"request {req.rid} follows request {req.follows}, which is not served here")
        finished = {r.rid: r for r in self.done}
        for req in sorted(requests, key=lambda r: (r.arrival, r.rid)):
            req.phase = Phase.PENDING
            if req.follows >= 0:
                before = finished.get(req.follows)
                if before is None:
                    self.held.setdefault(req.follows, []).append(req)
                    continue
                req.arrival = max(req.arrival, before.finished_step + 1 + req.gap)
            self.pending.append(req)

    @property
    def idle(self) -> bool:
        return not (self.pending or self.waiting or self.running or self.held)

    # -- one step ---------------------------------------------------------------------------------

    def _arrivals(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step_no:
            req = self.pending.popleft()
            reason = self.pool.arrival_check(req)
            if reason is not None:
                req.phase, req.reason = Phase.REJECTED, reason
                self.stats.rejected += 1
                self.done.append(req)
                self._release_next_turns(req)
            else:
                req.phase = Phase.WAITING
                self.waiting.append(req)

    def _release_next_turns(self, req: ScheduledRequest) -> None:
        """The turns held for `req` (a closed-loop session's next) arrive `gap` steps after this one,
        in arrival order among the pending requests."""
        for nxt in self.held.pop(req.rid, ()):
            nxt.arrival = self.step_no + 1 + nxt.gap
            keys = [(r.arrival, r.rid) for r in self.pending]
            self.pending.insert(bisect.bisect(keys, (nxt.arrival, nxt.rid)), nxt)

    def _plan(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest], paused: set[int],
              budget: int) -> tuple[list[tuple[ScheduledRequest, int]], int]:
        plan: list[tuple[ScheduledRequest, int]] = []
        left = budget
        for req in decodes:
            if left <= 0:
                break
            n = 1 if self.decode_tokens is None else max(1, min(self.decode_tokens(req), req.output_len - req.generated))
            plan.append((req, req.computed + n))
            left -= 1
        for req in prefills:
            if left <= 0:
                break
            if id(req) in paused:
                continue
            chunk = self.pool.next_chunk(req, left if req.chunk_cap is None else min(left, req.chunk_cap))
            if chunk > 0:
                plan.append((req, req.computed + chunk))
                left -= chunk
        return plan, left

    def _grow_running(self, budget: int) -> tuple[list[tuple[ScheduledRequest, int]], int]:
        """One token for each running decode, then the next chunk of each running prefill, within
        the token budget. When the pool cannot grow them all: a waiting request's hold on cached
        pages is given up; running prefills pause (newest first) where the policy says so, while
        something else still grows; then the fewest running requests, in the policy's victim
        order, whose retraction lets the rest grow (the pool asks `fits_after_frees`) are
        retracted. Retracting every grower always makes room, so the walk always ends."""
        paused: set[int] = set()
        held = self.pool.held_back() if hasattr(self.pool, "held_back") else ()  # speculative rounds in flight
        while True:
            decodes = [r for r in self.running if not r.prefilling and id(r) not in held]
            prefills = [r for r in self.running if r.prefilling]
            plan, left = self._plan(decodes, prefills, paused, budget)
            if not plan:
                return plan, left
            try:
                self.pool.extend([r for r, _ in plan], [n for _, n in plan])
                return plan, left
            except PoolFull:
                pass
            relieve = getattr(self.pool, "relieve", None)
            if relieve is not None and relieve():  # a waiting request's hold on cached pages goes first
                continue
            if self.policy.pauses_prefills and len(plan) > 1:  # something else still grows
                growing = [r for r, _ in plan if r.prefilling]
                if growing:
                    paused.add(id(max(growing, key=lambda r: (r.admitted_step, r.rid))))
                    self._paused = True
                    continue
            victims = self.pool.retract_victims(plan, self.policy.victim_order(self.running))
            if not victims:
                raise SchedulerStuck(f"step {self.step_no}: {len(plan)} running requests cannot grow and no "
                                     f"retraction of the {len(self.running)} running makes room")
            for victim in victims:
                self._preempt(victim)
            self.policy.on_retract(victims, self.running)

    def _preempt(self, req: ScheduledRequest) -> None:
        self.pool.preempt(req)
        self.running.remove(req)
        req.phase = Phase.WAITING
        req.lost_tokens = max(req.lost_tokens, req.computed)
        req.computed = 0
        req.row = -1
        req.preemptions += 1
        self.stats.preemptions += 1
        self._retracted = True
        self.waiting.appendleft(req)

    def _next_waiting(self) -> ScheduledRequest:
        if self.priority and len(self.waiting) > 1:
            best = min(self.waiting, key=lambda r: (r.priority, r.arrival, r.rid))
            if best is not self.waiting[0]:
                self.waiting.remove(best)
                self.waiting.appendleft(best)
        return self.waiting[0]

    def _admit(self, budget: int) -> list[tuple[ScheduledRequest, int]]:
        admitted: list[tuple[ScheduledRequest, int]] = []
        if not self.waiting or ((self._retracted or self._paused) and not self.policy.admit_after_retract):
            return admitted  # memory is overcommitted already: new work would only add to it
        if budget <= 0 or (len(self.running) >= self.max_running and not self.priority):
            return admitted  # no admission could run this step: the pass is not priced
        ctx = self.pool.begin_pass(self.running, frees_coming=bool(self.running))
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self._next_waiting()
            a = self.pool.try_admit(ctx, req, budget)
            # a more important request preempts less important work (first in a pass only, so the
            # rebuilt pass loses nothing admitted before it)
            if a.decision is Decision.WAIT and self.priority and not admitted and self._preempt_for(req, budget):
                ctx = self.pool.begin_pass(self.running, frees_coming=bool(self.running))
                a = self.pool.try_admit(ctx, req, budget)
            if a.decision is Decision.WAIT:
                break  # first come first served
            self.waiting.popleft()
            if a.decision is Decision.ABORT:
                req.phase, req.reason = Phase.ABORTED, a.reason
                self.stats.aborted += 1
                self.done.append(req)
                self._release_next_turns(req)
                continue
            req.phase = Phase.RUNNING
            req.admitted_step = self.step_no
            req.chunk_cap = a.chunk_cap
            self.running.append(req)
            if req.preemptions:
                self.stats.recompute_cached_tokens += req.cached  # its own pages, cached at retraction
            else:
                self.stats.cached_tokens += req.cached
            admitted.append((req, req.computed))  # the pool already took cached + first chunk
            budget -= a.chunk_len
        return admitted

    def _preempt_for(self, req: ScheduledRequest, budget: int) -> bool:
        """Preempt less important running requests for `req` when admission says that makes room
        (the pool asks `admits` for each prefix of the victims); nothing when none does."""
        lower = [r for r in self.policy.victim_order(self.running) if r.priority > req.priority]
        victims = self.pool.admit_victims(self.running, req, lower, budget) if lower else None
        if not victims:
            return False
        for victim in victims:
            self._preempt(victim)
        self.stats.priority_preemptions += 1
        self.waiting.remove(req)
        self.waiting.appendleft(req)
        return True

    def step(self) -> StepRecord:
        self._arrivals()
        self._retracted = self._paused = False
        self.policy.on_step()
        plan, budget = self._grow_running(self.max_batched_tokens)
        admitted = self._admit(budget)
        if self._retracted:  # a priority preemption in admission retracted part of the plan
            # a victim admitted again in the same pass steps once, as the admission it now is
            readmitted = {id(r) for r, _ in admitted}
            plan = [(r, n) for r, n in plan if r.phase is Phase.RUNNING and id(r) not in readmitted]
        # the forward: every planned request advances to its new length; the last prompt chunk
        # samples the first output token (a recomputed request already has its tokens)
        out_tokens = prefill_tokens = 0
        stepped: list[ScheduledRequest] = []
        for req, new_len in plan:
            was_prefilling = req.prefilling
            grown = new_len - req.computed
            if req.lost_tokens:
                self.stats.recomputed_tokens += max(0, min(new_len, req.lost_tokens) - req.computed)
            req.computed = new_len
            if was_prefilling:
                prefill_tokens += grown
                if not req.prefilling and req.generated == 0:
                    req.generated = 1
                    req.first_token_step = self.step_no
                    out_tokens += 1
            else:
                req.generated += grown
                out_tokens += grown
            stepped.append(req)
        for req, _ in admitted:
            prefill_tokens += req.computed - req.cached
            if req.lost_tokens:
                self.stats.recomputed_tokens += max(0, min(req.computed, req.lost_tokens) - req.cached)
            if not req.prefilling and req.generated == 0:
                req.generated = 1
                req.first_token_step = self.step_no
                out_tokens += 1
            stepped.append(req)
        if stepped:
            self.pool.forward(stepped)
        elif hasattr(self.pool, "idle_step"):  # nothing to step: the pool processes what is in flight
            self.pool.idle_step()
        for req in [r for r in self.running if r.done and not r.prefilling]:
            self.pool.finish(req)
            self.policy.on_finish(req)
            self.running.remove(req)
            req.phase = Phase.FINISHED
            req.finished_step = self.step_no
            self.stats.finished += 1
            self.done.append(req)
            self._release_next_turns(req)
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
                raise SchedulerStuck(f"request {head.rid} waited {self.step_no - head.arrival} steps with nothing running")
        return record

    def run(self, max_steps: int = 10**7, progress=None) -> SchedulerStats:
        """Step until every request has left; a run that reaches `max_steps` with work left raises
        `SchedulerStuck` (a loop that cannot make progress, never an outcome to return quietly)."""
        while not self.idle and self.step_no < max_steps:
            self.step()
            if progress is not None:
                progress(self)
        if not self.idle:
            raise SchedulerStuck(f"{len(self.waiting) + len(self.running) + len(self.pending) + len(self.held)} "
                                 f"requests still unserved after {self.step_no:,} steps ({len(self.running)} running, "
                                 f"{len(self.waiting)} waiting)")
        return self.stats
