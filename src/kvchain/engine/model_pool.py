"""`ModelPool`: the scheduler's pool with a real forward, under the overlap scheduler.

The scheduler (`scheduler.py`) decides each step exactly as it does in the simulator: admission,
prefix matches, chunks on the checkpoint grid, decodes, finishes. Here each step's forward runs the
model through `ModelRunner` on the device's forward stream, and with `overlap` the loop launches
forward N+1 before it processes forward N (`StepSequence` at depth 1). The host never needs a
token before it schedules: a decode's input is the token the previous forward sampled, read on the
forward stream from that forward's output tensor (a future), since the forward stream runs forwards
in order.

What a step's processing did in the simulator is split here by when it is safe:
- right after the launch (and after the previous forward was processed, so every token a prefix
  insert names is known): the state checkpoints, whose copies on the schedule stream wait this
  forward's state writes and come before the next forward, and window retirement, whose frees pend
  under this forward (`KVChainPool.processed`);
- when the forward is processed: the sampled tokens reach their requests; an end-of-sequence token
  shortens the request, and the scheduler finishes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache.radix import CheckpointStrategy
from ..errors import InvariantError
from ..plan import PoolKind
from ..storage import KVStorage
from .batch import ForwardBatch
from .logprobs import log_softmax_rows, token_logprobs
from .metadata import MetadataBuffers, StepMetadata
from .pool import KVChainPool
from .request import Phase, ScheduledRequest
from .runner import ModelRunner
from .sampling import drawn, sample_rows
from .steps import Forward, Launched, MetadataUpload, StepSequence


@dataclass
class StepOutputs:
    """What one forward samples: `tokens[i]` is output number `index[i]` of `reqs[i]`, set on the
    forward stream by the forward itself; readable on the host once the forward is processed, and by
    later forwards (which run after it on that stream)."""

    reqs: list[ScheduledRequest]
    index: list[int]
    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    #: the log-probabilities of the rows whose requests ask for them (`lp_rows`, in that order)
    logprobs: torch.Tensor | None = None
    lp_rows: list[int] = field(default_factory=list)


@dataclass
class EngineCounters:
    forwards: int = 0
    #: logits of every sampled token, (request id, output index) -> [vocab], when kept
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    #: (request id, output index) -> that output's log-probabilities, for requests that ask
    logprobs: dict[tuple[int, int], dict] = field(default_factory=dict)


class ModelPool(KVChainPool):
    """`KVChainPool` whose `forward` runs the model. `overlap`: launch each forward before the
    previous one is processed (depth 1); `war_barrier`: only a test that shows what goes wrong
    without it turns it off; `eos`: token ids that end a request (empty: run to max_new);
    `keep_logits`: keep each sampled token's logits (tests compare them with transformers')."""

    name = "kvchain-engine"

    def __init__(self, storage: KVStorage, runner: ModelRunner, *, overlap: bool = True, war_barrier: bool = True,
                 eos: tuple[int, ...] = (), keep_logits: bool = False, prefix_cache: bool = True,
                 strategy: CheckpointStrategy = CheckpointStrategy.EXTRA_BUFFER,
                 checkpoint_interval: int | None = None, max_tokens: int = 1024) -> None:
        super().__init__(storage, prefix_cache=prefix_cache, strategy=strategy, checkpoint_interval=checkpoint_interval)
        self.runner = runner
        self.exact_checkpoints = True
        self.batch_checkpoints = True
        self.steps = StepSequence(storage, depth=1 if overlap else 0, war_barrier=war_barrier,
                                  on_processed=self._record_outputs)
        self.eos = np.asarray(sorted(set(eos)), dtype=np.int64)
        self._eos_set = frozenset(int(t) for t in self.eos)
        self.keep_logits = keep_logits
        self.counters = EngineCounters()
        self.layer_pool = runner.layer_pool
        self._attention = [p.name for p in self.plan.sub_pools if p.kind is not PoolKind.STATE]
        table = storage.table
        # a step carries at most every row's whole context: a larger step budget sizes no buffer past it
        max_tokens = min(max_tokens, table.rows * table.context_len)
        self.buffers = MetadataBuffers(self._attention, self.has_state, max_tokens=max_tokens,
                                       max_requests=table.rows, max_pages=-(-table.context_len // self.page_size),
                                       device=runner.device)
        #: per request id: outputs the host has read back, and the newest output still in flight
        #: (the forward's outputs, the output number, its index there); they outlive a preemption
        self._known: dict[int, int] = {}
        self._future: dict[int, tuple[StepOutputs, int, int]] = {}

    # -- the forward ---------------------------------------------------------------------------------

    def forward(self, reqs: list[ScheduledRequest]) -> None:
        """Launch this step's forward, process the one before it (overlap) or this one, then take
        this step's checkpoints and retire its window rows, then flush between steps."""
        forward, outputs = self._prepare(reqs)
        steps = self.steps
        steps.launch(forward, outputs)
        steps.process_until(steps.depth)
        self.processed(reqs)
        steps.flush()

    def drain(self) -> None:
        """Process every forward still in flight (the end of a run)."""
        self.steps.drain()

    def finish(self, req: ScheduledRequest) -> None:
        """The request leaves for good: what the host knew of its outputs goes with it (a
        preemption keeps it; a forward still in flight that sampled for it reads neither). Kept,
        a long-lived engine held an entry for every request it ever served."""
        super().finish(req)
        self._known.pop(req.rid, None)
        self._future.pop(req.rid, None)

    def _prepare(self, reqs: list[ScheduledRequest]) -> tuple[Forward, StepOutputs]:
        """Translate the step once: packed token ids and positions, page tables, write locations,
        state slots; the requests that sample and where their logits are."""
        storage = self.storage
        ps = self.page_size
        n = len(reqs)
        rows = np.fromiter((r.row for r in reqs), np.int64, n)
        starts = np.fromiter((r.pool_state.get("kv_len", r.cached) for r in reqs), np.int64, n)
        ends = np.fromiter((r.computed for r in reqs), np.int64, n)
        counts = ends - starts
        if (counts <= 0).any():
            raise InvariantError("engine.empty_chunk", f"a scheduled request adds no token ({counts.tolist()})")
        q_starts = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=q_starts[1:])
        n_tokens = int(q_starts[-1])
        # packed row r of request b sits at position starts[b] + (r - q_starts[b])
        positions = np.repeat(starts - q_starts[:-1], counts) + np.arange(n_tokens)
        ids = np.empty(n_tokens, np.int64)
        futures: list[tuple[int, StepOutputs, int]] = []
        sample_reqs: list[ScheduledRequest] = []
        sample_index: list[int] = []
        sample_at: list[int] = []
        known_outputs, in_flight = self._known, self._future
        bounds = q_starts.tolist()
        for i, (req, s, e) in enumerate(zip(reqs, starts.tolist(), ends.tolist())):
            lo = bounds[i]
            p = req.prompt_len
            if s < p:
                ids[lo: lo + min(e, p) - s] = req.prompt[s: min(e, p)]
            if e > p:  # output tokens fed back (decode): known ones from the host, the newest a future
                rid = req.rid
                known = known_outputs.get(rid, 0)
                for pos in range(max(s, p), e):
                    j = pos - p
                    if j < known:
                        ids[lo + pos - s] = req.output[j]
                    else:
                        fut = in_flight.get(rid)
                        if fut is None or fut[1] != j:
                            raise InvariantError("engine.future", f"request {rid}: output {j} is neither "
                                                 "known nor sampled by a forward in flight")
                        futures.append((lo + pos - s, fut[0], fut[2]))
            req.pool_state["kv_len"] = e
            if e >= req.input_len:  # this step samples the request's next output
                sample_reqs.append(req)
                sample_index.append(req.generated - 1)
                sample_at.append(bounds[i + 1] - 1)
        device = self.runner.device
        outputs = StepOutputs(sample_reqs, sample_index, lp_rows=wants_logprobs(sample_reqs))
        # rows sampled rather than argmaxed: (row, sampling, output index), which seeds the draw
        draws = [(k, req.sampling, sample_index[k]) for k, req in enumerate(sample_reqs) if drawn(req.sampling)]
        for k, req in enumerate(sample_reqs):
            self._future[req.rid] = (outputs, sample_index[k], k)
        meta, views, written = self._step_metadata(rows, counts, positions, ids, starts, sample_at)
        batch = ForwardBatch(
            q_starts=q_starts, prefix_lens=starts, seq_lens=ends, page_size=ps, views=storage.views,
            layer_pool=self.layer_pool, page_tables=views.page_tables, write_locs=views.write_locs,
            state_slots=views.state_slots, state_fresh=views.state_fresh)
        runner, keep = self.runner, self.keep_logits
        fed = _group_futures(futures, device)

        def run() -> None:
            tokens = views.input_ids
            for src, dst, idx in fed:  # forwards run in order on this stream: `src` has run
                tokens[dst] = src.tokens[idx]
            logits = runner.logits(batch, tokens, views.positions, views.sample_at)
            outputs.tokens = sample_rows(logits, draws) if draws else logits.argmax(-1)
            outputs.logprobs = log_softmax_rows(logits, outputs.lp_rows)
            if keep:
                outputs.logits = logits

        device_ = storage.device

        def launch(step: int) -> None:
            device_.launch(device_.forward_stream, run, label=f"forward:{step}")

        upload = MetadataUpload(lambda: MetadataBuffers.upload(views, meta), label="metadata upload")
        self.counters.forwards += 1
        return Forward(launch, None, written, upload), outputs

    # -- processing ----------------------------------------------------------------------------------

    def _step_metadata(self, rows, counts, positions, ids, starts, sample_at) -> tuple[StepMetadata, object, object]:
        """One step's translated ids (`iteration_ids` for its writes, `runner_ids` for its reads),
        the reset of rows handed out since the last step, and the metadata uploaded into the step's
        buffers (with the write ids, which the step records); every forward of this pool and of its subclasses prepares its metadata here."""
        storage, ps = self.storage, self.page_size
        rows_of_tokens = np.repeat(rows, counts)
        vtokens = storage.table.page_table[rows_of_tokens, positions // ps] * ps + positions % ps
        written = storage.iteration_ids(vtokens, rows)
        read = storage.runner_ids(rows)
        storage.reset_new_rows()  # fresh rows start from zero state: `state_fresh`
        meta = StepMetadata(
            input_ids=ids, positions=positions,
            page_tables={name: read.page_tables[name] for name in self._attention},
            write_locs={name: written.locs[name] for name in self._attention},
            state_slots=written.state_slots, state_fresh=starts == 0,
            sample_at=np.asarray(sample_at, dtype=np.int64))
        return meta, self.buffers.views(meta), written

    def _record_outputs(self, launched: Launched[StepOutputs]) -> None:
        outputs = launched.payload
        sampled = outputs.tokens
        if sampled.device.type != "cpu":
            sampled = sampled.cpu()  # the host waited this forward: no device sync here
        tokens = sampled.tolist()
        known, future, eos = self._known, self._future, self._eos_set
        keep = self.keep_logits and outputs.logits is not None
        lp_at = {k: i for i, k in enumerate(outputs.lp_rows)}
        for k, req in enumerate(outputs.reqs):
            j = outputs.index[k]
            if j >= req.output_len:  # sampled past an end-of-sequence found since: dropped
                continue
            token = tokens[k]
            req.output[j] = token
            rid = req.rid
            if req.phase is not Phase.FINISHED:  # finished while this forward ran: nothing to know
                known[rid] = max(known.get(rid, 0), j + 1)
            if future.get(rid, (None, -1))[1] == j:
                del future[rid]
            if keep:
                self.counters.logits[(rid, j)] = outputs.logits[k].cpu()
            if req.logprobs is not None:
                self.counters.logprobs[(rid, j)] = token_logprobs(outputs.logprobs[lp_at[k]], token, req.logprobs)
            if stops(req, token, eos) and j + 1 < req.output_len:
                req.output_len = j + 1  # the scheduler finishes it after this step


def wants_logprobs(reqs: list[ScheduledRequest]) -> list[int]:
    """The positions among `reqs` of the requests that ask for log-probabilities."""
    return [k for k, req in enumerate(reqs) if req.logprobs is not None]


def stops(req: ScheduledRequest, token: int, eos: frozenset) -> bool:
    """Whether `token` ends `req`: an end-of-sequence id of the pool, or one of the request's own."""
    return token in eos or token in req.stop


def _group_futures(futures: list[tuple[int, StepOutputs, int]], device: torch.device
                   ) -> list[tuple[StepOutputs, torch.Tensor, torch.Tensor]]:
    """Futures by the forward that samples them: (source, packed positions, source indices)."""
    by_src: dict[int, tuple[StepOutputs, list[int], list[int]]] = {}
    for pos, src, idx in futures:
        entry = by_src.setdefault(id(src), (src, [], []))
        entry[1].append(pos)
        entry[2].append(idx)
    def tensor(values: list[int]) -> torch.Tensor:
        t = torch.from_numpy(np.array(values, np.int64))
        return t if device.type == "cpu" else t.to(device)

    return [(src, tensor(dst), tensor(idx)) for src, dst, idx in by_src.values()]
