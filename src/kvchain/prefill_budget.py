"""`ChainPrefillBudget`: one admission pass over the waiting queue.

Each request is charged what `request_demand(ADMIT)` prices: its full-attention tokens (input plus
expected output, beyond its cached prefix, ADM-1), for each window at most what it retains plus this
pass's transient tail (ADM-2), its state slots in full (ADM-3). The pass adds up what it admitted
and what running requests still need, and asks `ChainAllocator.admits` with what the prefix cache
could evict credited (ADM-6): one layout search, never a scalar count.

A request that fits an empty pool but no chunk of which fits now waits only while something will
give memory back (ADM-9); otherwise it takes the largest chunk limit at which all of it fits now
(ADM-10), and when none does it is aborted as unschedulable with its numbers (ADM-11).

How much of a request's output is charged is the caller's choice (`output_len`: all of it under
exact admission, an estimate under optimistic admission); `chunk_only` charges only the chunk the
pass schedules, as engines that allocate on demand and preempt admit."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .alloc.demand import DemandPurpose, KVDemand, request_demand
from .alloc.npfast import unique_sorted
from .capacity import capacity_decision
from .errors import InputError
from .storage import KVStorage
from .units import is_integer


class Decision(enum.Enum):
    ADMIT = "admit"
    WAIT = "wait"
    ABORT = "abort"


@dataclass(frozen=True)
class Admission:
    decision: Decision
    chunk_len: int = 0
    demand: KVDemand | None = None
    reason: str = ""
    #: admitted at a chunk smaller than the token budget because only at that size does all of the
    #: request fit (ADM-10): its later chunks stay within it, or the next one may not fit and a
    #: request alone in the pool would be retracted and admitted again forever
    chunk_cap: int | None = None


def mamba_prefill_chunk_grid(start: int, limit: int, prompt_len: int, interval: int | None) -> int:
    """How many prompt tokens from `start` the next chunk takes under a `limit`: every chunk but a
    prompt's last ends on the checkpoint grid, so each one leaves a checkpoint to track (WIN-15,
    WIN-16). Returns 0 when the limit does not reach the next grid point. `interval` None or 0: no
    grid. InputError for an argument that is not an integer, a negative interval and a start
    outside 0..prompt_len."""
    if (type(start) is not int or type(limit) is not int or type(prompt_len) is not int
            or (interval is not None and type(interval) is not int)):
        _check_integers("mamba_prefill_chunk_grid", start=start, limit=limit, prompt_len=prompt_len,
                        **({} if interval is None else {"interval": interval}))
    remaining = prompt_len - start
    if remaining < 0 or start < 0 or (interval is not None and interval < 0):
        if interval is not None and interval < 0:
            raise InputError(f"a checkpoint interval is a number of tokens >= 1 (None or 0: no grid), got {interval}")
        raise InputError(f"a prefill chunk's start {start} lies outside the prompt (0..{prompt_len})")
    if remaining <= limit or not interval:
        return min(remaining, limit)
    end = ((start + limit) // interval) * interval
    return max(0, end - start)


@dataclass
class ChainPrefillBudget:
    """One pass: `reserve` is what running requests still need; `frees_coming` whether work other
    than this pass will give memory back (a forward or a host copy in flight, rows other requests
    hold)."""

    storage: KVStorage
    reserve: KVDemand
    frees_coming: bool
    checkpoint_interval: int | None = None
    shares_prefixes: bool = False
    reclaimable: tuple[int, ...] | None = None
    #: charge only the scheduled chunk (allocate-on-demand admission), not the prompt and output
    chunk_only: bool = False
    #: whether the pool takes a tracking state slot with each request (None: as the plan declares)
    tracking_slot: bool | None = None
    admitted: KVDemand = field(init=False)
    admitted_count: int = 0

    def __post_init__(self) -> None:
        self.admitted = KVDemand.zero(len(self.storage.plan.sub_pools))
        # the longest input a row holds (None: a storage without a row table, a test's stand-in)
        table = getattr(self.storage, "table", None)
        self._context_len: int | None = table.context_len if table is not None else None

    def _demand(self, input_len: int, output_len: int, cached_len: int, chunk_len: int) -> KVDemand:
        if self.chunk_only:
            input_len, output_len = cached_len + chunk_len, 0
        return request_demand(
            self.storage.plan, DemandPurpose.ADMIT, input_len=input_len, output_len=output_len,
            cached_len=cached_len, chunk_len=chunk_len, checkpoint_interval=self.checkpoint_interval,
            shares_prefixes=self.shares_prefixes, tracking_slot=self.tracking_slot,
        )

    @capacity_decision
    def _fits(self, demand: KVDemand) -> bool:
        total = self.admitted + self.reserve + demand
        return self.storage.allocator.admits(total, self.reclaimable)

    def took(self, a: Admission, taken: KVDemand) -> None:
        """The pool took `taken` of an admitted request's demand right away (its first chunk, its
        state slots): those pages are live now, so the pass stops counting them as still to come."""
        if a.demand is None:
            return
        self.admitted = KVDemand(
            tuple(x - min(d, t) for x, d, t in zip(self.admitted.pages, a.demand.pages, taken.pages)),
            self.admitted.virtual_pages - min(a.demand.virtual_pages, taken.virtual_pages),
            self.admitted.state_slots - min(a.demand.state_slots, taken.state_slots))

    def withdraw(self, a: Admission) -> None:
        """Undo an ADMIT this pass decided (the pool could not take its first chunk after all)."""
        if a.demand is not None:
            self.admitted = KVDemand(tuple(x - y for x, y in zip(self.admitted.pages, a.demand.pages)),
                                     self.admitted.virtual_pages - a.demand.virtual_pages,
                                     self.admitted.state_slots - a.demand.state_slots)
        self.admitted_count -= 1

    def _waiting_frees_memory(self) -> bool:
        """Work admitted earlier in this pass, a forward or host copy in flight, or a row other work
        holds will give memory back (ADM-9)."""
        return self.admitted_count > 0 or self.frees_coming

    def consider(self, input_len: int, output_len: int, cached_len: int, token_limit: int) -> Admission:
        """Admit a request's first chunk (up to `token_limit` prompt tokens), make it wait, or abort it
        (an input past the pool's context length is aborted at once). InputError, with nothing
        counted, for a length that is not an integer, a negative output, and a request with nothing
        to prefill: no input, or a cached prefix that is negative or reaches the input."""
        if not (type(input_len) is int and type(output_len) is int and type(cached_len) is int
                and type(token_limit) is int):
            _check_integers("consider", input_len=input_len, output_len=output_len, cached_len=cached_len,
                            token_limit=token_limit)
        if input_len <= 0 or output_len < 0 or not 0 <= cached_len < input_len:
            if input_len <= 0:
                raise InputError(f"a request to admit needs input tokens: input_len {input_len}")
            if output_len < 0:
                raise InputError(f"a request to admit has a negative output: output_len {output_len}")
            raise InputError(f"a request to admit has input left to prefill: cached_len {cached_len} must lie "
                             f"in 0..{input_len - 1} (input_len {input_len})")
        context = self._context_len
        if context is not None and input_len > context:
            return Admission(Decision.ABORT, reason=f"unschedulable: {input_len} input tokens are past the "
                                                    f"context length {context}")
        chunk = mamba_prefill_chunk_grid(cached_len, token_limit, input_len, self.checkpoint_interval)
        if chunk <= 0:
            return Admission(Decision.WAIT, reason="the token budget left does not reach the next checkpoint")
        demand = self._demand(input_len, output_len, cached_len, chunk)
        if self._fits(demand):
            self.admitted = self.admitted + demand
            self.admitted_count += 1
            return Admission(Decision.ADMIT, chunk, demand)
        if self._waiting_frees_memory():
            return Admission(Decision.WAIT, reason="memory is coming back from running work")
        # nothing will give memory back: the largest chunk at which all of it fits now
        limit = chunk - 1
        while limit > 0:
            smaller = mamba_prefill_chunk_grid(cached_len, limit, input_len, self.checkpoint_interval)
            if smaller <= 0:
                break
            d = self._demand(input_len, output_len, cached_len, smaller)
            if self._fits(d):
                self.admitted = self.admitted + d
                self.admitted_count += 1
                return Admission(Decision.ADMIT, smaller, d, chunk_cap=smaller)
            limit = smaller - 1
        pages = ", ".join(f"{p.name} {n}" for p, n in zip(self.storage.plan.sub_pools, demand.pages) if n)
        return Admission(
            Decision.ABORT,
            reason=(f"unschedulable: {input_len} input + {output_len} output tokens ({cached_len} cached) need "
                    f"{pages} pages and no chunk of it fits while nothing else will free memory"),
        )


def _check_integers(where: str, **values) -> None:
    """The slow path of a check that found a value not a plain int: a numpy integer counts, a bool,
    a float or anything else does not."""
    for name, value in values.items():
        if not is_integer(value):
            raise InputError(f"{where} {name} must be an integer, got {value!r}")


def peak_pages(lengths: np.ndarray, remaining: np.ndarray, page_size: int) -> int:
    """The most full-attention pages a set of requests holds at once, when request `i` holds
    `lengths[i]` tokens, grows one token a step for `remaining[i]` more and is then freed. Between
    two finishes the total only grows, so the peak falls at a step where some request is about to
    finish: at `k = remaining[j]`, every request with `remaining >= k` holds `lengths + k` tokens.
    Vectorised: one [requests x finishes] comparison."""
    lengths = np.asarray(lengths, dtype=np.int64)
    remaining = np.asarray(remaining, dtype=np.int64)
    if not len(lengths):
        return 0
    ks = unique_sorted(remaining)
    pages = (lengths[:, None] + ks[None, :] + page_size - 1) // page_size
    live = remaining[:, None] >= ks[None, :]
    now = int(((lengths + page_size - 1) // page_size).sum())
    return max(int((pages * live).sum(axis=0).max()), now)


@dataclass
class ProjectedPrefillBudget(ChainPrefillBudget):
    """Admission that charges full attention at its projected peak instead of the sum of every
    request's whole remaining output: each request (running, admitted in this pass, and the one
    considered) is taken to hold its prompt and grow one token a step until its known or estimated
    output ends, when it is freed (`peak_pages`; a request still prefilling starts to decode later
    than that, so the projection is an estimate, not a guarantee). Windows and state are charged as in
    `ChainPrefillBudget`. With each request's real output length (the `ideal` bound) nothing it
    admits is ever retracted; with an estimate, the estimate decides."""

    #: per running request: the tokens it holds once its prompt is in, and the output it has left
    lengths: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    #: full-attention pages the running requests hold now
    held: int = 0
    #: with `chunk_only`, how many requests this pass may admit on a first chunk that leaves part
    #: of the prompt unscheduled (charged the chunk only); every other one is charged its prompt
    partial_slots: int = 1
    _candidate: tuple[int, int, int] = (0, 0, 0)
    _chunk: int = 0
    _taken: list[int] = field(default_factory=list)

    def _projected_len(self, input_len: int, cached_len: int, chunk_len: int) -> int:
        """What a request admitted now is taken to hold: its whole prompt or, with `chunk_only`
        while a partial slot is left, the chunk this pass schedules (the rest is charged once it
        runs, as a running prefill's prompt). One prompt at a time is admitted in part, so a long
        prompt never waits for its whole KV to be free, and prefills that hold memory they cannot
        yet use do not pile up (each would pause the others and crowd the prefix cache out)."""
        if self.chunk_only and self.partial_slots > 0:
            return cached_len + chunk_len
        return input_len

    def consider(self, input_len: int, output_len: int, cached_len: int, token_limit: int) -> Admission:
        previous = self._candidate
        self._candidate = (input_len, output_len, cached_len)
        try:
            a = super().consider(input_len, output_len, cached_len, token_limit)
        except InputError:
            self._candidate = previous  # a refused request leaves the pass as it was
            raise
        if a.decision is Decision.ADMIT:
            ps = self.storage.plan.page_size
            self.lengths.append(self._projected_len(input_len, cached_len, a.chunk_len))
            if self.lengths[-1] < input_len:
                self.partial_slots -= 1
            self.remaining.append(output_len)
            self._taken.append((cached_len + a.chunk_len + ps - 1) // ps)
            self.held += self._taken[-1]
        return a

    def withdraw(self, a: Admission) -> None:
        super().withdraw(a)
        if self.lengths[-1] < self._candidate[0]:
            self.partial_slots += 1
        self.lengths.pop()
        self.remaining.pop()
        self.held -= self._taken.pop()

    def _demand(self, input_len: int, output_len: int, cached_len: int, chunk_len: int) -> KVDemand:
        # full attention is charged by the projection in `_fits`: price windows and state only
        self._chunk = chunk_len
        return super()._demand(input_len, 0, cached_len, chunk_len)

    @capacity_decision
    def _fits(self, demand: KVDemand) -> bool:
        plan = self.storage.plan
        ps = plan.page_size
        input_len, output_len, cached_len = self._candidate
        length = self._projected_len(input_len, cached_len, self._chunk)
        peak = peak_pages(np.array([*self.lengths, length]), np.array([*self.remaining, output_len]), ps)
        full = max(peak - self.held - (cached_len + ps - 1) // ps, 0)
        total = self.admitted + self.reserve + demand
        owner = plan.owner.index
        pages = tuple(full if i == owner else n for i, n in enumerate(total.pages))
        return self.storage.allocator.admits(KVDemand(pages, full, total.state_slots), self.reclaimable)
