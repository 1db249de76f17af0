"""`ChainPrefillBudget`: one admission pass over the waiting queue.

Each request is charged what `request_demand(ADMIT)` prices: its full-attention tokens (input plus
expected output, beyond its cached prefix, ADM-1), for each window at most what it retains plus this
pass's transient tail (ADM-2), its state slots in full (ADM-3). The pass adds up what it admitted
and what running requests still need, and asks `ChainAllocator.admits` with what the prefix cache
could evict credited (ADM-6): one layout search, never a scalar count.

A request that fits an empty pool but no chunk of which fits now waits only while something will
give memory back (ADM-9); otherwise it takes the largest chunk limit at which all of it fits now
(ADM-10), and when none does it is aborted as unschedulable with its numbers (ADM-11)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .alloc.demand import DemandPurpose, KVDemand, request_demand
from .capacity import capacity_decision
from .storage import KVStorage


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


def mamba_prefill_chunk_grid(start: int, limit: int, prompt_len: int, interval: int | None) -> int:
    """How many prompt tokens from `start` the next chunk takes under a `limit`: every chunk but a
    prompt's last ends on the checkpoint grid, so each one leaves a checkpoint to track (WIN-15,
    WIN-16). Returns 0 when the limit does not reach the next grid point."""
    remaining = prompt_len - start
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
    admitted: KVDemand = field(init=False)
    admitted_count: int = 0

    def __post_init__(self) -> None:
        self.admitted = KVDemand.zero(len(self.storage.plan.sub_pools))

    def _demand(self, input_len: int, output_len: int, cached_len: int, chunk_len: int) -> KVDemand:
        return request_demand(
            self.storage.plan, DemandPurpose.ADMIT, input_len=input_len, output_len=output_len,
            cached_len=cached_len, chunk_len=chunk_len, checkpoint_interval=self.checkpoint_interval,
            shares_prefixes=self.shares_prefixes,
        )

    @capacity_decision
    def _fits(self, demand: KVDemand) -> bool:
        total = self.admitted + self.reserve + demand
        return self.storage.allocator.admits(total, self.reclaimable)

    def _waiting_frees_memory(self) -> bool:
        """Work admitted earlier in this pass, a forward or host copy in flight, or a row other work
        holds will give memory back (ADM-9)."""
        return self.admitted_count > 0 or self.frees_coming

    def consider(self, input_len: int, output_len: int, cached_len: int, token_limit: int) -> Admission:
        """Admit a request's first chunk (up to `token_limit` prompt tokens), make it wait, or abort it."""
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
                return Admission(Decision.ADMIT, smaller, d)
            limit = smaller - 1
        pages = ", ".join(f"{p.name} {n}" for p, n in zip(self.storage.plan.sub_pools, demand.pages) if n)
        return Admission(
            Decision.ABORT,
            reason=(f"unschedulable: {input_len} input + {output_len} output tokens ({cached_len} cached) need "
                    f"{pages} pages and no chunk of it fits while nothing else will free memory"),
        )
