"""Pipeline micro-batches on one stage: `pp_size` micro-batches in flight, as a pipeline-parallel
scheduler keeps them, and the write-after-read barrier once per launched micro-batch (LIFE-7).

Each iteration schedules micro-batch `m` (its own decodes, and the next chunk of the one chunked
prefill, which runs in whichever micro-batch comes next, before its previous chunk's result is
in), launches it, processes the result of the oldest micro-batch in flight (frees, window
retirement, an abort of the chunked request), and only then applies the barrier for the launched
micro-batch (`_pp_apply_war_barrier` in the design). So `pp_size` micro-batches are in flight at
each launch, and the result processing may free a row whose next chunk an in-flight micro-batch
still reads: an aborted chunked request's row is handed out again at once.

Forwards are model-free but touch real bytes on the stage's device: a forward reads its rows'
page tables from one device buffer of request rows (as attention reads `req_to_token`), checks
each against the table it was scheduled with, reads its pages and writes its new tokens. The
next schedule-stream upload into a reused row is ordered after the running micro-batch's reads
only by the barrier; a read that sees another row's table is recorded as a mismatch. The pages
themselves pend under the micro-batches in flight (the pool's own ordering)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..device.base import PageAccess
from ..engine.steps import Forward, Launched, MetadataUpload, StepSequence
from ..errors import CapacityError, InputError
from ..plan import PoolKind
from ..storage import KVStorage

#: the band index page accesses to the request-row buffer carry (its rows, not arena pages)
META_ROWS = -1


@dataclass
class _Request:
    rid: int
    row: int
    prompt: int
    output: int
    computed: int = 0
    generated: int = 0
    #: the micro-batch its decodes run in, once its prompt is in (-1: still prefilling)
    micro_batch: int = -1
    #: launches of this request not yet processed
    in_flight: int = 0


@dataclass(frozen=True)
class MicroBatch:
    """What a launched micro-batch keeps until its result is processed."""

    index: int
    rows: tuple[int, ...]
    #: the requests it runs, one per row (a row freed and handed out again is another request's)
    rids: tuple[int, ...]
    #: the request whose prompt chunk it runs (-1: none), whether that chunk is the prompt's last, and
    #: whether the request is aborted when this result comes back
    chunk_rid: int = -1
    last_chunk: bool = False
    abort: bool = False


@dataclass
class MicroBatchStats:
    iterations: int = 0
    launched: int = 0
    processed: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    #: aborts whose request had a later chunk in flight when its row was freed
    aborted_in_flight: int = 0
    retracted: int = 0
    refused: int = 0
    moves: int = 0
    rows_checked: int = 0
    mismatches: list[str] = field(default_factory=list)


class MicroBatchStageLoop:
    """One stage's micro-batch loop over its `KVStorage` (on a device with asynchrony).

    `war_barrier=False` skips the barrier (only a test that shows what breaks turns it off). The
    workload is drawn from `seed`, so stages given the same seed run the same operations."""

    def __init__(self, storage: KVStorage, pp_size: int, *, seed: int = 0, war_barrier: bool = True,
                 batch: int = 4, chunk: int = 12, max_prompt: int = 48, max_output: int = 16,
                 abort_rate: float = 0.3, flush: bool = True) -> None:
        if pp_size < 2:
            raise InputError(f"a micro-batch loop keeps 2 or more micro-batches in flight, not {pp_size}")
        if chunk <= 0 or batch <= 0 or max_prompt <= 0 or max_output <= 0:
            raise InputError("batch, chunk, max_prompt and max_output must be positive")
        self.storage = storage
        self.device = storage.device
        self.pp_size = pp_size
        self.war_barrier = war_barrier
        self.batch = batch
        self.chunk = chunk
        self.max_prompt = max_prompt
        self.max_output = max_output
        self.abort_rate = abort_rate
        self.flush = flush
        self.rng = np.random.default_rng(seed)
        self.requests: dict[int, _Request] = {}
        self.chunked: _Request | None = None
        self.stats = MicroBatchStats()
        self.digests: list[str] = []
        self.steps: StepSequence[MicroBatch] = StepSequence(storage, depth=pp_size - 1, war_barrier=False,
                                                            on_processed=self._process)
        table = storage.table
        plan = storage.plan
        self.owner = plan.owner.name
        self.token_pools = [p for p in plan.sub_pools if p.kind is not PoolKind.STATE]
        #: the device's request rows: each row's owner page table, as the forward reads it
        self.rows_buffer = torch.zeros((table.rows, table.max_pages), dtype=torch.int64)
        self._value = 1.0

    # -- scheduling ----------------------------------------------------------------------------------

    def _extend(self, rows: list[int], lens: list[int]) -> np.ndarray:
        return self.storage.alloc_extend(np.array(rows, dtype=np.int64), np.array(lens, dtype=np.int64))

    def _decodes(self, m: int) -> tuple[list[_Request], list[np.ndarray]]:
        """One token for each of micro-batch `m`'s running requests whose last result is in; when
        the pool is full the newest gives way (its row is freed: it is in no micro-batch in flight)."""
        decodes = [r for r in self.requests.values()
                   if r.micro_batch == m and not r.in_flight and r.computed < self.storage.table.context_len]
        while decodes:
            try:
                vtok = self._extend([r.row for r in decodes], [r.computed + 1 for r in decodes])
            except CapacityError:
                victim = decodes.pop()
                self._drop(victim)
                self.stats.retracted += 1
                continue
            for r in decodes:
                r.computed += 1
            return decodes, [vtok]
        return [], []

    def _next_chunk(self) -> tuple[_Request, np.ndarray, bool] | None:
        """The chunked request's next chunk (a new request admitted first when there is none)."""
        storage = self.storage
        req = self.chunked
        if req is None:
            if len(self.requests) >= self.batch or not storage.table.free_rows:
                return None
            prompt = int(self.rng.integers(1, self.max_prompt + 1))
            output = int(min(self.rng.integers(1, self.max_output + 1), storage.table.context_len - prompt))
            req = _Request(self.stats.admitted, storage.alloc_row(), prompt, max(output, 1))
            self.requests[req.rid] = req
            self.chunked = req
            self.stats.admitted += 1
        end = min(req.prompt, req.computed + self.chunk)
        try:
            vtok = self._extend([req.row], [end])
        except CapacityError:
            if not req.computed and not req.in_flight:  # a new request that does not fit: refused
                self._drop(req)
                self.stats.refused += 1
            return None
        req.computed = end
        return req, vtok, end == req.prompt

    def _schedule(self, m: int) -> tuple[MicroBatch, np.ndarray] | None:
        reqs, toks = self._decodes(m)
        chunk_rid, last, abort = -1, False, False
        chunk = self._next_chunk()
        if chunk is not None:
            req, vtok, last = chunk
            reqs.append(req)
            toks.append(vtok)
            chunk_rid = req.rid
            abort = not last and bool(self.rng.random() < self.abort_rate)
            if last:
                req.micro_batch = m
                self.chunked = None
        if not reqs:
            return None
        for req in reqs:
            req.in_flight += 1
        return (MicroBatch(m, tuple(r.row for r in reqs), tuple(r.rid for r in reqs), chunk_rid, last, abort),
                np.concatenate(toks))

    # -- the forward ---------------------------------------------------------------------------------

    def _fresh(self, n: int) -> torch.Tensor:
        start = self._value
        self._value = 1.0 if self._value + n > 2**20 else self._value + n
        return torch.arange(start, start + n, dtype=torch.float32)

    def _tensor(self, pool_name: str) -> torch.Tensor:
        comp = self.storage.plan.by_name(pool_name).envelope.components[0]
        return self.storage.view(pool_name).tensor(comp.layer_id, comp.name)

    def _forward(self, mb: MicroBatch, vtok: np.ndarray) -> Forward:
        """Upload the rows' page tables into the row buffer (schedule stream), then a forward that
        reads them back and checks them, reads the rows' pages and writes the new tokens."""
        storage, device = self.storage, self.device
        ps = storage.page_size
        rows = np.array(mb.rows, dtype=np.int64)
        runner = storage.runner_ids(rows)
        tables = torch.from_numpy(runner.page_tables[self.owner].copy())
        width = tables.shape[1]
        writes = storage.iteration_ids(vtok, rows)
        buffer = self.rows_buffer
        index = torch.from_numpy(rows)

        def upload() -> None:
            buffer[index, :width] = tables

        def read(step: int) -> None:
            got = buffer[index, :width]
            bad = (got != tables).any(dim=1)
            self.stats.rows_checked += len(rows)
            if bool(bad.any()) and len(self.stats.mismatches) < 50:
                k = int(torch.nonzero(bad)[0, 0])
                self.stats.mismatches.append(f"micro-batch {mb.index} (step {step}): row {int(rows[k])} reads "
                                             f"page table {got[k].tolist()[:4]}, was scheduled with "
                                             f"{tables[k].tolist()[:4]}")

        locs = {name: torch.from_numpy(v.copy()) for name, v in writes.locs.items()}
        values = self._fresh(len(vtok))

        def write() -> None:
            for name, loc in locs.items():
                tensor = self._tensor(name)
                fill = values.to(tensor.dtype).view(-1, *([1] * (tensor.dim() - 2)))
                tensor[loc // ps, loc % ps] = fill.expand(-1, *tensor.shape[2:])

        meta = [PageAccess(META_ROWS, rows)]
        reads = meta + [PageAccess(p.index, np.unique(runner.page_tables[p.name])) for p in self.token_pools]
        written = [PageAccess(storage.plan.by_name(n).index, np.unique(v // ps)) for n, v in writes.locs.items()]
        return Forward.read_then_write(device, read, write, reads=reads, writes=written, ids=writes,
                                       upload=MetadataUpload(upload, meta, label=f"upload:mb{mb.index}"),
                                       read_at_start=True)

    # -- processing ----------------------------------------------------------------------------------

    def _drop(self, req: _Request) -> None:
        self.storage.free_rows(np.array([req.row]))
        del self.requests[req.rid]
        if self.chunked is req:
            self.chunked = None

    def _process(self, launched: Launched[MicroBatch]) -> None:
        """A micro-batch's result: window rows retire, the finished requests and an aborted
        chunked request are freed (its later chunk may still be in flight)."""
        mb = launched.payload
        live = [self.requests[r] for r in mb.rids if r in self.requests]
        for req in live:
            req.in_flight -= 1
            if req.rid == mb.chunk_rid:
                if mb.last_chunk:
                    req.generated = 1
            else:
                req.generated += 1
        if live:
            self.storage.advance(np.array([r.row for r in live], dtype=np.int64))
        for req in live:
            if req.rid == mb.chunk_rid and mb.abort:
                self.stats.aborted += 1
                self.stats.aborted_in_flight += int(req.in_flight > 0)
                self._drop(req)
            elif req.micro_batch >= 0 and req.generated >= req.output and not req.in_flight:
                self.stats.finished += 1
                self._drop(req)
        self.stats.processed += 1

    # -- one iteration -------------------------------------------------------------------------------

    def iterate(self) -> str:
        """Launch micro-batch `m`, process the result of the micro-batch launched before it (the
        oldest in flight), then the write-after-read barrier for the launched one (LIFE-7); then
        the opportunistic flush and this stage's capacity digest."""
        m = self.stats.iterations % self.pp_size
        scheduled = self._schedule(m)
        launched = None
        if scheduled is not None:
            mb, vtok = scheduled
            launched = self.steps.launch(self._forward(mb, vtok), mb)
            self.stats.launched += 1
        if launched is not None:
            self.steps.process_until(self.pp_size - 1)
        elif self.steps.in_flight:
            self.steps.process_oldest()
        if launched is not None and self.war_barrier:
            self.storage.apply_war_barrier()
        if self.flush:
            self.stats.moves += self.steps.flush()
        self.stats.iterations += 1
        capacity = self.storage.allocator.stage_capacity
        digest = capacity.take_digest() if capacity is not None else ""
        self.digests.append(digest)
        return digest

    def drain(self) -> None:
        """Process every micro-batch in flight, let the device finish, then the idle checks."""
        self.steps.drain()
        self.device.synchronize()


def microbatch_stage_process(stage: int, n_stages: int, port: int, spec, pp_size: int, iterations: int,
                             seed: int = 0, war_barrier: bool = True, timeout_s: float = 20.0) -> dict:
    """One stage of a pipeline in its own process, `pp_size` micro-batches in flight on its own
    modeled device (its completion timing seeded by the stage): build the stage, all-gather and
    install every stage's geometry (PP-6), then `iterations` iterations of the micro-batch loop,
    receiving the previous stage's digest and sending this stage's to the next after each
    (PP-15, PP-16)."""
    from ..alloc.stage_capacity import StageGeometry, check_stage_agreement
    from ..device.modeled import ModeledDevice
    from ..dist.pp import StageLink
    from .pp import build_stage

    link = StageLink.join(stage, n_stages, port, timeout_s)
    device = ModeledDevice(seed=100 + stage, durations={"forward": 6.0 + 2.0 * stage})
    storage = build_stage(spec, stage, backend=device).storage
    geometries = link.all_gather(StageGeometry.of_chain(storage.allocator, stage))
    storage.allocator.install_stage_capacity(geometries, stage)
    loop = MicroBatchStageLoop(storage, pp_size, seed=seed, war_barrier=war_barrier)
    for it in range(iterations):
        digest = loop.iterate()
        previous = link.recv_previous()
        if previous is not None:
            check_stage_agreement(digest, previous, stage, it)
        link.send_next(digest)
    loop.drain()
    storage.check_idle()
    link.close()
    st = loop.stats
    return {"digests": loop.digests, "launched": st.launched, "aborted_in_flight": st.aborted_in_flight,
            "finished": st.finished, "moves": st.moves, "mismatches": list(st.mismatches)}
