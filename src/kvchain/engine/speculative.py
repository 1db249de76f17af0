"""Speculative decoding on the unified pool: a draft proposes, the target verifies in one forward.

A fused draft's layers live in the target's plan (`plan_with_draft`, numbered after the target's
layers), so its KV takes pages of the same bands (or a band of its own for a window the target
lacks) and sizing, the memory clip and admission price its bytes with the target's. Each decoding
request's round, in one forward on the forward stream:

1. the draft reads the last accepted token and proposes `k` tokens, one draft step at a time (and
   one more step over the last proposal, so its KV and state cover every token verify may accept);
2. the target verifies the last accepted token and the `k` proposals in one batched forward,
   writing their KV at slots reserved before launch, and greedy acceptance keeps the proposals
   up to the first one the target would not have chosen, plus the target's own next token;
3. after the forward's shared-read end, the post-verify commit copies the state after the
   accepted prefix into the request's slot, from the slots resolved when the forward's metadata
   was prepared (`ForwardStateSlots`, LIFE-10..12); the rejected tokens' pages are freed when the
   forward is processed, as any other free, and nothing is moved back.

A round's writes (its scratch state slots, and KV at lengths the host learns only at processing)
are recorded as unknown (`Forward(ids=None)`), so compaction moves nothing in any band until the
forward retires (LIFE-36). Under the overlap loop a request whose round is in flight is held back
from scheduling (its length is unknown until then) while every other request's work overlaps it;
when nothing else is scheduled, the loop processes the round (`idle_step`)."""

from __future__ import annotations

import numpy as np
import torch

from ..alloc.demand import KVDemand
from ..errors import CapacityError, InputError
from ..plan import PoolKind
from ..storage import KVStorage
from .logprobs import token_logprobs
from .model_pool import ModelPool, stops
from .pool import PoolFull
from .request import ScheduledRequest
from .runner import ModelRunner
from .speculative_forward import prepare_speculative_forward
from .speculative_plan import draft_layer_offset, fuse_draft_layers, plan_with_draft
from .speculative_round import Round, SpecCounters, SpecOutputs, SpecPayload, truncate_rows
from .speculative_state import state_stores
from .steps import Forward, Launched

__all__ = [
    "SpecCounters",
    "SpeculativePool",
    "draft_layer_offset",
    "fuse_draft_layers",
    "plan_with_draft",
    "truncate_rows",
]


class SpeculativePool(ModelPool):
    """`ModelPool` whose decodes are speculative rounds of `num_speculative_tokens` proposals from
    `draft` (a `ModelRunner` over the draft's layers of the same fused plan).

    `resolve_commit_slots_late` is a deliberate fault for the test that shows it: the post-verify
    commit looks its rows' state slots up in the request table when it runs, after the shared-read
    end, instead of using the slots resolved at metadata time (LIFE-10, LIFE-12)."""

    name = "kvchain-engine-speculative"

    def __init__(self, storage: KVStorage, runner: ModelRunner, draft: ModelRunner, *,
                 num_speculative_tokens: int, resolve_commit_slots_late: bool = False, **kwargs) -> None:
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise InputError(f"num_speculative_tokens must be a positive integer, not {num_speculative_tokens!r}")
        super().__init__(storage, runner, **kwargs)
        self.draft = draft
        self.k = num_speculative_tokens
        self.spec = SpecCounters()
        self.resolve_commit_slots_late = resolve_commit_slots_late
        #: requests whose round is in flight (their length is known only once it is processed)
        self._held: set[int] = set()
        self._stores = state_stores(storage.views, self.plan)
        rows = storage.table.rows
        self.buffers.sample_at = torch.zeros(rows * (self.k + 1), dtype=torch.int64, device=runner.device)

    # -- scheduling hooks ------------------------------------------------------------------------------

    def held_back(self) -> set[int]:
        """`id`s of the running requests the scheduler must not step now (their round is in flight)."""
        return self._held

    def idle_step(self) -> None:
        """A step that scheduled nothing: process the oldest forward in flight (a held round), then
        flush, so the held requests come back."""
        if self.steps.in_flight:
            self.steps.process_oldest()
            self.steps.flush()

    def preempt(self, req: ScheduledRequest) -> None:
        """Retract a request, even one whose round is in flight: its row goes back at once (and may
        name a new request before the round's commit runs, which is why the commit never looks the
        row up, LIFE-10), its round's results are dropped, and what the tree caches of it stops
        before the round's first token, whose successors are not verified."""
        self._drop_round(req)
        super().preempt(req)

    def finish(self, req: ScheduledRequest) -> None:
        """Finish a request, even one whose round is in flight: under the overlap loop a round can
        be launched on a token not yet read back that turns out to end the request (an end-of-
        sequence token). The round's results are dropped as a retraction's are, and the row is cut
        back to its verified tokens first, so the prefix tree never caches the KV of proposals."""
        self._drop_round(req)
        super().finish(req)

    def _drop_round(self, req: ScheduledRequest) -> None:
        """A request leaving while its round is in flight: the round's results will be dropped
        (`_finish_rounds`), and its row is cut back to the round's start, the tokens verified."""
        if id(req) in self._held:
            self._held.discard(id(req))
            start = req.pool_state["kv_len"]
            req.pool_state.pop("spec_round", None)  # its results will be dropped
            truncate_rows(self.storage, np.array([req.row]), np.array([start]))

    def _reserve(self, running: list[ScheduledRequest]) -> KVDemand:
        """What running requests may still take (`KVChainPool._reserve`), plus the scratch state
        slots of every one that holds no round's now: its next round takes them, and admission
        charged them (`StateLifetime.speculative_slots`), so nothing admitted later may."""
        demand = super()._reserve(running)
        per = self.plan.state.lifetime.speculative_slots if self.has_state else 0
        if not per:
            return demand
        idle = sum(1 for r in running if "spec_chain" not in r.pool_state and id(r) not in self._held)
        state = self.plan.state.index
        pages = tuple(idle * per if i == state else 0 for i in range(len(self.plan.sub_pools)))
        return demand + KVDemand(pages, 0, idle * per)

    def extend(self, reqs: list[ScheduledRequest], new_lens: list[int]) -> None:
        """Grow the step's requests; each decode by its round's `k + 1` tokens (and `k + 1` scratch
        state slots), reserved before launch. Admission priced the scratch slots (the plan's
        `speculative_slots`, held back by `_reserve`), so they are there; only a pool over a plan
        that does not price them, or a step whose pages do not fit, decodes plainly
        (`SpecCounters.fallbacks`)."""
        storage = self.storage
        context = storage.table.context_len
        lens = list(new_lens)
        rounds: list[tuple[int, int, np.ndarray | None]] = []
        for i, (req, n) in enumerate(zip(reqs, new_lens)):
            if req.prefilling or n != req.computed + 1:
                continue
            k = min(self.k, req.output_len - req.generated - 1, context - n)
            if k < 1:
                continue
            chain = None
            if self.has_state:
                chain = self._take_slots(k + 1)
                if chain is None:
                    self.spec.fallbacks += 1
                    continue
            rounds.append((i, k, chain))
            lens[i] = n + k
        try:
            super().extend(reqs, lens)
        except PoolFull:
            self._free_chains(rounds)
            if lens == list(new_lens):
                raise
            self.spec.fallbacks += len(rounds)
            super().extend(reqs, new_lens)
            return
        for i, k, chain in rounds:
            reqs[i].pool_state["spec_k"] = k
            reqs[i].pool_state["spec_chain"] = chain

    def _take_slots(self, n: int) -> np.ndarray | None:
        try:
            return self.storage.alloc_state_slots(n)
        except CapacityError:
            if not self._make_room([n if p.kind is PoolKind.STATE else 0 for p in self.plan.sub_pools]):
                return None
            try:
                return self.storage.alloc_state_slots(n)
            except CapacityError:
                return None

    def _free_chains(self, rounds) -> None:
        chains = [c for _i, _k, c in rounds if c is not None]
        if chains:
            self.storage.free_state_slots(np.concatenate(chains))

    def processed(self, reqs: list[ScheduledRequest]) -> None:
        """Checkpoints and window retirement for the requests whose length is known now; a round's
        requests get theirs when the round is processed (`_finish_rounds`)."""
        super().processed([r for r in reqs if "spec_round" not in r.pool_state])

    # -- the forward -----------------------------------------------------------------------------------

    def _prepare(self, reqs: list[ScheduledRequest]) -> tuple[Forward, SpecPayload]:
        return prepare_speculative_forward(self, reqs)

    # -- processing ------------------------------------------------------------------------------------

    def _record_outputs(self, launched: Launched[SpecPayload]) -> None:
        payload = launched.payload
        super()._record_outputs(Launched(launched.record, launched.done, payload.outputs))
        if payload.spec.rounds:
            self._finish_rounds(payload.spec)

    def _finish_rounds(self, spec: SpecOutputs) -> None:
        """A processed forward's rounds: the accepted tokens reach their requests, each request's
        length becomes what verify accepted, the rejected tokens' pages and the scratch slots are
        freed, then the requests' checkpoints and window retirement run at their true lengths."""
        tokens = spec.tokens.cpu().tolist()
        accepted = spec.accepted.cpu().tolist()
        keep = self.keep_logits and spec.logits is not None
        done: list[ScheduledRequest] = []
        for r, rd in enumerate(spec.rounds):
            req = rd.req
            if req.pool_state.get("spec_round") != rd.round_no:  # retracted while the round ran
                self._free_chain(rd)
                self.spec.dropped += 1
                continue
            self._held.discard(id(req))
            a = int(accepted[r])
            emitted = 0
            for i in range(a + 1):
                j = rd.out_index + i
                if j >= req.output_len:
                    break
                token = int(tokens[r][i])
                req.output[j] = token
                emitted += 1
                if keep:
                    self.counters.logits[(req.rid, j)] = spec.logits[r, i].cpu()
                if req.logprobs is not None:
                    self.counters.logprobs[(req.rid, j)] = token_logprobs(spec.logprobs[r, i], token, req.logprobs)
                if stops(req, token, self._eos_set):
                    req.output_len = j + 1
                    break
            self._known[req.rid] = max(self._known.get(req.rid, 0), rd.out_index + emitted)
            req.generated = rd.out_index + emitted
            req.computed = rd.start + emitted
            req.pool_state["kv_len"] = req.computed
            req.pool_state.pop("spec_round", None)
            truncate_rows(self.storage, np.array([rd.row]), np.array([req.computed]))
            self._checkpoints_passed(rd)
            self._free_chain(rd)
            self.spec.rounds += 1
            self.spec.proposed += rd.k
            self.spec.accepted += a
            done.append(req)
        self.processed(done)

    def _checkpoints_passed(self, rd: Round) -> None:
        """The checkpoints at the grid points a processed round went past (the one it ends on is
        `processed`'s): the state at grid point g is in the round's scratch slot `chain[g - start - 1]`
        (the state after the token at position g - 1), so the tree takes it from there, as plain
        decoding would have taken it from the row's own slot at g."""
        interval, req = self.checkpoint_interval, rd.req
        if not interval or self.tree is None or rd.chain is None:
            return
        st = req.pool_state
        g = (max(rd.start, st["checkpoint"]) // interval + 1) * interval
        while g < req.computed:
            self.checkpoint_into_tree(req, g, int(rd.chain[g - rd.start - 1]))
            st["checkpoint"] = g  # taken or abandoned, as `processed` does
            g += interval

    def _free_chain(self, rd: Round) -> None:
        if rd.chain is not None:
            self.storage.free_state_slots(rd.chain)
