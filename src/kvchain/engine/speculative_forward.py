"""A speculative forward: the step's rounds drafted, verified and accepted in one forward.

Translated once, on the host: the step's packed ids and positions (a round feeds its last accepted
token; the draft fills its proposals in on the forward stream), the metadata, and for a model with
recurrent state the rounds' own and chain slots (`ForwardStateSlots`, resolved at metadata time,
LIFE-11). On the forward stream: the draft's steps, the target's verify over every token, greedy
acceptance on the device. After the shared-read end: the post-verify commit from the slots resolved
at metadata time, never from the request table (LIFE-10, LIFE-12). A round writes scratch slots and
KV at lengths known only at processing, so the forward is recorded with unknown writes (LIFE-36)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError
from .batch import ForwardBatch
from .metadata import MetadataBuffers
from .model_pool import ModelPool, StepOutputs, _group_futures, wants_logprobs
from .request import ScheduledRequest
from .sampling import drawn, sample_rows
from .speculative_draft_steps import DraftStep, draft_steps
from .speculative_round import Acceptance, Round, SpecOutputs, SpecPayload, accept, chain_slots, host_tensor
from .speculative_state import ForwardStateSlots, StepChain, commit_states_after_verify
from .steps import Forward, MetadataUpload


def prepare_speculative_forward(pool: ModelPool, reqs: list[ScheduledRequest]) -> tuple[Forward, SpecPayload]:
    """The step's forward (plain chunks and decodes, and each round of `spec_k` proposals) and its
    payload; the rounds' requests are held back until the forward is processed. `pool` is the
    `speculative.SpeculativePool` (typed by its base: that module imports this one)."""
    storage = pool.storage
    table = storage.table
    ps = pool.page_size
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
    rounds: list[Round] = []
    for i, req in enumerate(reqs):
        lo = int(q_starts[i])
        s, e = int(starts[i]), int(ends[i])
        p = req.prompt_len
        if s < p:
            ids[lo: lo + min(e, p) - s] = req.prompt[s: min(e, p)]
        fed_end = s + 1 if ks[i] else e  # a round feeds its last accepted token; proposals follow
        for pos in range(max(s, p), fed_end):
            j = pos - p
            if j < pool._known.get(req.rid, 0):
                ids[lo + pos - s] = req.output[j]
            else:
                fut = pool._future.get(req.rid)
                if fut is None or fut[1] != j:
                    raise InputError(f"request {req.rid}: output {j} is neither known nor in flight")
                futures.append((lo + pos - s, fut[0], fut[2]))
        if ks[i]:
            rounds.append(Round(req, int(rows[i]), s, int(ks[i]), s - p + 1, req.pool_state.pop("spec_chain", None)))
            continue
        req.pool_state["kv_len"] = e
        if e >= req.input_len:
            sample_reqs.append(req)
            sample_index.append(req.generated - 1)
            sample_at.append(int(q_starts[i + 1]) - 1)
    n_plain = len(sample_at)
    kmax = int(ks.max()) if len(spec_idx) else 0
    gidx = np.zeros((len(rounds), kmax + 1), np.int64)
    # the logits rows drawn rather than argmaxed: a sampled plain row, and each verify position of a
    # sampled round, whose output index seeds its draw as plain decoding's would
    draws = [(k, req.sampling, sample_index[k]) for k, req in enumerate(sample_reqs) if drawn(req.sampling)]
    for r, b in enumerate(spec_idx):
        at = len(sample_at)
        sample_at.extend(range(int(q_starts[b]), int(q_starts[b + 1])))
        gidx[r] = at + np.minimum(np.arange(kmax + 1), ks[b])
        rd = rounds[r]
        if drawn(rd.req.sampling):
            draws.extend((at + i, rd.req.sampling, rd.out_index + i) for i in range(int(ks[b]) + 1))
    outputs = StepOutputs(sample_reqs, sample_index, lp_rows=wants_logprobs(sample_reqs))
    for k_, req in enumerate(sample_reqs):
        pool._future[req.rid] = (outputs, sample_index[k_], k_)
    round_no = pool.counters.forwards
    for rd in rounds:
        rd.round_no = round_no
        rd.req.pool_state["spec_round"] = round_no
        pool._held.add(id(rd.req))

    meta, views, written = pool._step_metadata(rows, counts, positions, ids, starts, sample_at)
    device = pool.runner.device

    slots = None
    if rounds and pool.has_state:  # resolved now, at metadata time (LIFE-11)
        own = written.state_slots[spec_idx]
        slots = ForwardStateSlots(host_tensor(own, device), host_tensor(chain_slots(storage, rounds, kmax), device))
    verify = None
    if slots is not None:
        verify = StepChain(spec_idx, slots.own, slots.chain, ks[spec_idx] + 1)
    batch = ForwardBatch(
        q_starts=q_starts, prefix_lens=starts, seq_lens=ends, page_size=ps, views=storage.views,
        layer_pool=pool.layer_pool, page_tables=views.page_tables, write_locs=views.write_locs,
        state_slots=views.state_slots, state_fresh=views.state_fresh, verify=verify)
    drafts = draft_steps(storage, pool.draft.layer_pool, views, q_starts, starts, counts, ks, spec_idx, slots, device)
    spec = SpecOutputs(rounds)
    valid = host_tensor(np.arange(kmax)[None, :] < ks[spec_idx][:, None], device, torch.bool)
    how = Acceptance(len(sample_at), n_plain, kmax, valid, host_tensor(gidx, device), rows[spec_idx], tuple(draws),
                     any(rd.req.logprobs is not None for rd in rounds))
    payload = SpecPayload(outputs, spec, slots, how=how)
    relayed = pool.runner.relays_logits
    draft_draws = _draft_draws(rounds, ks[spec_idx], kmax)
    run = _verify_run(pool, batch, views, drafts, _group_futures(futures, device), payload, draft_draws)
    # a stage whose acceptance is relayed commits when the relay comes (`dist/pp_spec.py`, LIFE-15)
    commit = None if relayed or slots is None else _commit(pool, slots, spec, rows[spec_idx], device)
    device_ = storage.device

    def launch(step: int) -> None:
        device_.launch(device_.forward_stream, run, label=f"forward:{step}")

    def launch_commit(step: int) -> None:
        device_.launch(device_.forward_stream, commit, label=f"forward:{step}:commit")

    upload = MetadataUpload(lambda: MetadataBuffers.upload(views, meta), label="metadata upload")
    pool.counters.forwards += 1
    pool.spec.draft_forwards += len(drafts)
    # a round writes scratch slots and KV at lengths known only at processing: unknown writes
    ids_written = None if rounds else written
    return Forward(launch, launch_commit if commit is not None else None, ids_written, upload), payload


def _draft_draws(rounds: list[Round], ks: np.ndarray, kmax: int) -> list[list[tuple]]:
    """Per draft step, the rows of its logits a sampled round draws its proposal from: step i's rows
    are the rounds with at least i proposals (all of them at step 0), and its proposal is for output
    `out_index + i`, drawn with the seed the target's draw of that output takes (similar
    distributions then draw alike, and the target keeps the proposals it would have drawn)."""
    out = []
    for i in range(kmax + 1):
        live = range(len(rounds)) if i == 0 else np.flatnonzero(ks >= i).tolist()
        out.append([(row, rounds[r].req.sampling, rounds[r].out_index + i)
                    for row, r in enumerate(live) if drawn(rounds[r].req.sampling)])
    return out


def _verify_run(pool: ModelPool, batch: ForwardBatch, views, drafts: list[DraftStep], fed, payload: SpecPayload,
                draft_draws: list[list[tuple]]):
    """The forward's kernels, on the forward stream: the draft's steps, the target's verify, and
    acceptance (`spec.accepted[r]`: the proposals up to the first the target did not choose, greedily
    or by its seeded draw).
    A runner that relays its logits (a pipeline stage before the last) returns none: the proposals
    wait in the payload for the relay."""
    runner, draft, keep, n_rounds = pool.runner, pool.draft, pool.keep_logits, len(payload.spec.rounds)
    kmax = payload.how.kmax

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
            nxt = torch.zeros(n_rounds, dtype=torch.long, device=tokens.device)
            nxt[live] = sample_rows(dlogits, draft_draws[step]) if draft_draws[step] else dlogits.argmax(-1)
            proposals.append(nxt)
        logits = runner.logits(batch, tokens, views.positions, views.sample_at)
        proposed = torch.stack(proposals[:kmax], dim=1) if kmax else None
        if logits is None:  # relayed: acceptance runs when the last stage's logits come
            payload.proposed = proposed
            return
        accept(logits, proposed, payload.outputs, payload.spec, payload.how, keep)

    return run


def _commit(pool: ModelPool, slots: ForwardStateSlots | None, spec: SpecOutputs, spec_rows: np.ndarray,
            device: torch.device):
    """The post-verify commit, run after the shared-read end: the slots resolved at metadata time
    (`resolve_commit_slots_late` is the deliberate fault that reads the request table instead)."""
    storage, stores, late = pool.storage, pool._stores, pool.resolve_commit_slots_late

    def commit() -> None:
        use = slots
        if late:  # the deliberate fault: the request table read again, after the shared reads
            own_now = storage.physical_pages(pool.plan.state.name, storage.table.state_slot[spec_rows])
            use = ForwardStateSlots(host_tensor(own_now, device), slots.chain)
        commit_states_after_verify(stores, use, spec.accepted)

    return commit
