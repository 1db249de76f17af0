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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decl import KVLayerDecl, KVPart, StateLifetime
from ..errors import CapacityError, InputError
from ..plan import KVStoragePlan, PoolKind, plan_kv_storage
from ..storage import KVStorage
from .batch import ForwardBatch
from .metadata import MetadataBuffers
from .model_pool import ModelPool, StepOutputs, _group_futures
from .pool import PoolFull
from .request import ScheduledRequest
from .runner import ModelRunner
from .speculative_state import ForwardStateSlots, StepChain, commit_states_after_verify, state_stores
from .steps import Forward, Launched, MetadataUpload


def plan_with_draft(decls: Sequence[KVLayerDecl], draft: Sequence[KVLayerDecl], *, page_size: int,
                    checkpoint_interval: int | None) -> KVStoragePlan:
    """The target's plan with a fused draft. `checkpoint_interval`: the prefix cache's grid for the
    target's recurrent state (None: no checkpoint policy), declared on the target's state lifetime,
    which a draft with recurrent layers needs (`plan_kv_storage` refuses it otherwise, PlanError)."""
    if checkpoint_interval is not None:
        def with_grid(part: KVPart) -> KVPart:
            if isinstance(part.lifetime, StateLifetime):
                return dataclasses.replace(part, lifetime=StateLifetime(checkpoint_interval))
            return part

        decls = [KVLayerDecl(d.layer_id, tuple(with_grid(p) for p in d.parts)) for d in decls]
    return plan_kv_storage(decls, page_size=page_size, draft=draft)


def draft_layer_offset(decls: Sequence[KVLayerDecl]) -> int:
    """Where a fused draft's layer ids start: one past the target's last declared layer."""
    return max(d.layer_id for d in decls) + 1


def fuse_draft_layers(model: torch.nn.Module, offset: int) -> None:
    """Number the draft's layers after the target's (`layer_idx += offset` on every module that has
    one), so its attention and mixers address the draft's layers of the fused plan."""
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx += offset


@dataclass
class SpecCounters:
    """Speculative rounds verified, draft tokens proposed and accepted, draft forwards run."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_forwards: int = 0
    #: rounds whose request was retracted while they ran: their results are dropped
    dropped: int = 0


@dataclass
class _Round:
    """One request's round in a forward: its row, first position `start`, `k` proposals, the output
    number its first verified token takes, and its virtual scratch state slots."""

    req: ScheduledRequest
    row: int
    start: int
    k: int
    out_index: int
    chain: np.ndarray | None
    round_no: int = -1


@dataclass
class SpecOutputs:
    """What a forward's rounds produce on the forward stream: `tokens[r, i]` the target's greedy
    token after round token i, `accepted[r]` how many proposals it kept."""

    rounds: list[_Round]
    tokens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    proposed: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass
class SpecPayload:
    outputs: StepOutputs
    spec: SpecOutputs
    slots: ForwardStateSlots | None = None
    held: list[int] = field(default_factory=list)


def _t(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    return t if device.type == "cpu" else t.to(device)


def truncate_rows(storage: KVStorage, rows: np.ndarray, new_lens: np.ndarray) -> int:
    """Shorten rows to `new_lens` (never into a tree-shared prefix): the pages past the new lengths
    are freed as any other free (they pend under a forward in flight). Returns the pages freed."""
    table = storage.table
    ps = storage.page_size
    old = table.seq_lens[rows].copy()
    if (new_lens > old).any() or (new_lens < table.shared_pages[rows] * ps).any():
        raise InputError(f"truncate to {new_lens.tolist()} from {old.tolist()}: only within a row's own tokens")
    keep = (new_lens + ps - 1) // ps
    have = (old + ps - 1) // ps
    table.seq_lens[rows] = new_lens
    freed = []
    for row, lo, hi in zip(rows.tolist(), keep.tolist(), have.tolist()):
        if hi > lo:
            freed.append(table.page_table[row, lo:hi].copy())
            table.page_table[row, lo:hi] = 0  # the null page, never a freed id another row may take
    if freed:
        storage.free_virtual_pages(np.concatenate(freed))
    return int(sum(len(f) for f in freed))


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
        if id(req) in self._held:
            self._held.discard(id(req))
            start = req.pool_state["kv_len"]
            req.pool_state.pop("spec_round", None)  # its results will be dropped
            truncate_rows(self.storage, np.array([req.row]), np.array([start]))
        super().preempt(req)

    def extend(self, reqs: list[ScheduledRequest], new_lens: list[int]) -> None:
        """Grow the step's requests; each decode by its round's `k + 1` tokens (and `k + 1` scratch
        state slots), reserved before launch. When the pool cannot hold the rounds, plain decodes."""
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
                    continue
            rounds.append((i, k, chain))
            lens[i] = n + k
        try:
            super().extend(reqs, lens)
        except PoolFull:
            self._free_chains(rounds)
            if lens == list(new_lens):
                raise
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
        storage = self.storage
        table = storage.table
        ps = self.page_size
        n = len(reqs)
        rows = np.fromiter((r.row for r in reqs), np.int64, n)
        ks = np.array([r.pool_state.pop("spec_k", 0) for r in reqs], np.int64)
        starts = np.fromiter((r.pool_state.get("kv_len", r.cached) for r in reqs), np.int64, n)
        ends = np.where(ks > 0, starts + ks + 1, np.fromiter((r.computed for r in reqs), np.int64, n))
        counts = ends - starts
        if (counts <= 0).any() or (ends[ks > 0] != table.seq_lens[rows[ks > 0]]).any():
            raise InputError(f"a step's lengths disagree with its rows ({counts.tolist()})")
        q_starts = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=q_starts[1:])
        n_tokens = int(q_starts[-1])
        positions = np.repeat(starts - q_starts[:-1], counts) + np.arange(n_tokens)
        ids = np.zeros(n_tokens, np.int64)
        futures: list[tuple[int, StepOutputs, int]] = []
        sample_reqs, sample_index, sample_at = [], [], []
        spec_idx = np.flatnonzero(ks > 0)
        rounds: list[_Round] = []
        for i, req in enumerate(reqs):
            lo = int(q_starts[i])
            s, e = int(starts[i]), int(ends[i])
            p = req.prompt_len
            if s < p:
                ids[lo: lo + min(e, p) - s] = req.prompt[s: min(e, p)]
            fed_end = s + 1 if ks[i] else e  # a round feeds its last accepted token; proposals follow
            for pos in range(max(s, p), fed_end):
                j = pos - p
                if j < self._known.get(req.rid, 0):
                    ids[lo + pos - s] = req.output[j]
                else:
                    fut = self._future.get(req.rid)
                    if fut is None or fut[1] != j:
                        raise InputError(f"request {req.rid}: output {j} is neither known nor in flight")
                    futures.append((lo + pos - s, fut[0], fut[2]))
            if ks[i]:
                rounds.append(_Round(req, int(rows[i]), s, int(ks[i]), s - p + 1,
                                     req.pool_state.pop("spec_chain", None)))
                continue
            req.pool_state["kv_len"] = e
            if e >= req.input_len:
                sample_reqs.append(req)
                sample_index.append(req.generated - 1)
                sample_at.append(int(q_starts[i + 1]) - 1)
        n_plain = len(sample_at)
        kmax = int(ks.max()) if len(spec_idx) else 0
        gidx = np.zeros((len(rounds), kmax + 1), np.int64)
        for r, b in enumerate(spec_idx):
            at = len(sample_at)
            sample_at.extend(range(int(q_starts[b]), int(q_starts[b + 1])))
            gidx[r] = at + np.minimum(np.arange(kmax + 1), ks[b])
        outputs = StepOutputs(sample_reqs, sample_index)
        for k_, req in enumerate(sample_reqs):
            self._future[req.rid] = (outputs, sample_index[k_], k_)
        round_no = self.counters.forwards
        for rd in rounds:
            rd.round_no = round_no
            rd.req.pool_state["spec_round"] = round_no
            self._held.add(id(rd.req))

        meta, views, written = self._step_metadata(rows, counts, positions, ids, starts, sample_at)
        device = self.runner.device

        slots = None
        if rounds and self.has_state:  # resolved now, at metadata time (LIFE-11)
            state = self.plan.state.name
            own = written.state_slots[spec_idx]
            chain = np.stack([storage.physical_pages(state, rd.chain)[np.minimum(np.arange(kmax + 1), rd.k)]
                              for rd in rounds])
            slots = ForwardStateSlots(_t(own, device), _t(chain, device))
        verify = None
        if slots is not None:
            verify = StepChain(spec_idx, slots.own, slots.chain, ks[spec_idx] + 1)
        batch = ForwardBatch(
            q_starts=q_starts, prefix_lens=starts, seq_lens=ends, page_size=ps, views=storage.views,
            layer_pool=self.layer_pool, page_tables=views.page_tables, write_locs=views.write_locs,
            state_slots=views.state_slots, state_fresh=views.state_fresh, verify=verify)
        drafts = self._draft_batches(views, q_starts, starts, counts, ks, spec_idx, slots, device)
        spec = SpecOutputs(rounds)
        payload = SpecPayload(outputs, spec, slots)
        runner, draft, keep, fed = self.runner, self.draft, self.keep_logits, _group_futures(futures, device)
        valid = _t(np.arange(kmax)[None, :] < ks[spec_idx][:, None], device, torch.bool)
        g_index = _t(gidx, device)

        def run() -> None:
            tokens = views.input_ids
            for src, dst, idx in fed:  # forwards run in order on this stream: `src` has run
                tokens[dst] = src.tokens[idx]
            proposals = []
            for step, (make_batch, rows_in, sample, live) in enumerate(drafts):
                dbatch = make_batch()
                if step == 0:
                    inputs = tokens[rows_in]
                else:  # the proposal of the step before, into the draft and into the verify rows
                    inputs = proposals[-1][live]
                    tokens[rows_in] = inputs
                dlogits = draft.logits(dbatch, inputs, views.positions[rows_in], sample)
                nxt = torch.zeros(len(rounds), dtype=torch.long, device=tokens.device)
                nxt[live] = dlogits.argmax(-1)
                proposals.append(nxt)
            logits = runner.logits(batch, tokens, views.positions, views.sample_at)
            greedy = logits.argmax(-1)
            outputs.tokens = greedy[:n_plain]
            if keep:
                outputs.logits = logits[:n_plain]
            if rounds:
                target = greedy[g_index]  # [R, K+1]
                proposed = torch.stack(proposals[:kmax], dim=1) if kmax else target[:, :0]
                match = (proposed == target[:, :kmax]) & valid
                spec.accepted = torch.cumprod(match.long(), dim=1).sum(dim=1)
                spec.proposed = proposed
                spec.tokens = target
                if keep:
                    spec.logits = logits[g_index]

        stores, late, table_ = self._stores, self.resolve_commit_slots_late, storage.table
        spec_rows = rows[spec_idx]

        def commit() -> None:  # after the shared-read end: the slots resolved at metadata time
            use = slots
            if late:  # the deliberate fault: the request table read again, after the shared reads
                own_now = storage.physical_pages(self.plan.state.name, table_.state_slot[spec_rows])
                use = ForwardStateSlots(_t(own_now, device), slots.chain)
            commit_states_after_verify(stores, use, spec.accepted)

        device_ = storage.device

        def launch(step: int) -> None:
            device_.launch(device_.forward_stream, run, label=f"forward:{step}")

        def launch_commit(step: int) -> None:
            device_.launch(device_.forward_stream, commit, label=f"forward:{step}:commit")

        upload = MetadataUpload(lambda: MetadataBuffers.upload(views, meta), label="metadata upload")
        self.counters.forwards += 1
        self.spec.draft_forwards += len(drafts)
        # a round writes scratch slots and KV at lengths known only at processing: unknown writes
        ids_written = None if rounds else written
        return Forward(launch, launch_commit if slots is not None else None, ids_written, upload), payload

    def _draft_batches(self, views, q_starts, starts, counts, ks, spec_idx, slots, device):
        """The draft's steps: step 0 over every request (a round's last accepted token only), then
        step i over the rounds with at least i proposals. Each: (batch, packed rows it reads,
        sample rows, which rounds it samples)."""
        n = len(counts)
        is_spec = ks > 0
        counts0 = np.where(is_spec, 1, counts)
        q0 = np.zeros(n + 1, np.int64)
        np.cumsum(counts0, out=q0[1:])
        rows0 = np.concatenate([np.arange(q_starts[b], q_starts[b] + counts0[b]) for b in range(n)])
        rows0_t = _t(rows0, device)
        r = len(spec_idx)
        chain0 = None
        if slots is not None:
            chain0 = StepChain(spec_idx, slots.own, slots.chain[:, :1], np.ones(r, np.int64))
        pool_views, layer_pool, ps = self.storage.views, self.draft.layer_pool, self.page_size

        def batch0() -> ForwardBatch:  # gathers from the uploaded buffers: run on the forward stream
            return ForwardBatch(
                q_starts=q0, prefix_lens=starts, seq_lens=starts + counts0, page_size=ps, views=pool_views,
                layer_pool=layer_pool, page_tables=views.page_tables,
                write_locs={k: v[rows0_t] for k, v in views.write_locs.items()},
                state_slots=views.state_slots, state_fresh=views.state_fresh, verify=chain0)

        every = _t(np.arange(r), device)
        out = [(batch0, rows0_t, _t(q0[spec_idx], device), every)]
        kmax = int(ks.max()) if r else 0
        for i in range(1, kmax + 1):
            live = np.flatnonzero(ks[spec_idx] >= i)
            reqs = spec_idx[live]
            rows_i = _t(q_starts[reqs] + i, device)
            reqs_t = _t(reqs, device)
            live_t = _t(live, device)
            step_slots, chain_i = None, None
            if slots is not None:
                step_slots = slots.chain[live_t, i]
                chain_i = StepChain(np.arange(len(live)), slots.chain[live_t, i - 1], slots.chain[live_t, i:i + 1],
                                    np.ones(len(live), np.int64))
            out.append((self._step_batch(views, starts[reqs] + i, reqs_t, rows_i, step_slots, chain_i), rows_i,
                        _t(np.arange(len(live)), device), live_t))
        return out

    def _step_batch(self, views, prefix: np.ndarray, reqs_t: torch.Tensor, rows_t: torch.Tensor,
                    slots: torch.Tensor | None, chain: StepChain | None):
        """A draft step after the first: one token for each of `reqs_t`, at packed rows `rows_t`; the
        batch is built on the forward stream, since it gathers from the uploaded buffers."""
        pool_views, layer_pool, ps = self.storage.views, self.draft.layer_pool, self.page_size
        n = len(prefix)

        def make() -> ForwardBatch:
            return ForwardBatch(
                q_starts=np.arange(n + 1, dtype=np.int64), prefix_lens=prefix, seq_lens=prefix + 1,
                page_size=ps, views=pool_views, layer_pool=layer_pool,
                page_tables={k: v[reqs_t] for k, v in views.page_tables.items()},
                write_locs={k: v[rows_t] for k, v in views.write_locs.items()},
                state_slots=slots, state_fresh=None, verify=chain)

        return make

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
            if rd.chain is not None:
                self.storage.free_state_slots(rd.chain)
            if req.pool_state.get("spec_round") != rd.round_no:  # retracted while the round ran
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
                if token in self._eos_set:
                    req.output_len = j + 1
                    break
            self._known[req.rid] = max(self._known.get(req.rid, 0), rd.out_index + emitted)
            req.generated = rd.out_index + emitted
            req.computed = rd.start + emitted
            req.pool_state["kv_len"] = req.computed
            req.pool_state.pop("spec_round", None)
            truncate_rows(self.storage, np.array([rd.row]), np.array([req.computed]))
            self.spec.rounds += 1
            self.spec.proposed += rd.k
            self.spec.accepted += a
            done.append(req)
        self.processed(done)
