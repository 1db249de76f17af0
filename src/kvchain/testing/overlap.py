"""A model-free overlap scheduler that drives a `KVStorage` on any device backend, with forwards
that really read and write page bytes.

Forward N+1 is launched before forward N is processed. Each forward reads its requests' metadata
from a persistent device buffer (as CUDA-graph inputs are), then the KV bytes of every token its
requests hold (and their state slots), checking each against the value last written for that
virtual page; then it writes one fresh value per new token (and per state slot). Meanwhile the host
frees, takes, zeroes and compacts. Any read that sees a byte other than the last one written for
its virtual page is recorded as a mismatch: the pool's waits are what keep that list empty.

The loop, per step: schedule the batch (admissions, decodes), then the one step sequence of
`engine.steps` (upload its metadata, launch and record the forward, the write-after-read barrier,
process the previous result: frees and window retirement, the opportunistic flush).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decl import MHA, State, StateTensor
from ..device.base import Device, PageAccess
from ..engine.steps import Forward, Launched, MetadataUpload, StepSequence
from ..errors import CapacityError
from ..models.small import small_hybrid
from ..plan import PoolKind, plan_kv_storage
from ..sizing import size_plan
from ..storage import KVStorage

VALUE_DTYPE = torch.float32


def overlap_plan(page_size: int = 4, windows: tuple[int, ...] = (16,), state: bool = True):
    """A small hybrid whose KV values are exact float32 integers: full attention (+ state on layer 0)
    and one layer per window."""
    ssm = State((StateTensor("ssm", (4,), "float32"),)) if state else None
    return plan_kv_storage(small_hybrid(MHA(1, 4, dtype="float32"), windows, state=ssm), page_size=page_size)


def overlap_storage(device: Device, chain_kib: int = 24, page_size: int = 4, windows=(16,), state=True,
                    rows: int = 16, context: int = 256) -> KVStorage:
    from ..build import build_kv_storage

    plan = overlap_plan(page_size, windows, state)
    probe = size_plan(plan, 2**30, context_len=context, max_running_requests=rows, state_slots=rows)
    sizing = size_plan(plan, probe.fixed.total + chain_kib * 1024, context_len=context,
                       max_running_requests=rows, state_slots=rows)
    return build_kv_storage(plan, sizing, "cpu", backend=device)


@dataclass
class _Request:
    row: int
    prompt: int
    output: int
    generated: int = 0
    prefilled: bool = False


@dataclass(frozen=True)
class _Batch:
    """What the driver keeps with a forward in flight: its rows, and those that finish with it."""

    rows: np.ndarray
    finished: list[int]


@dataclass
class OverlapStats:
    steps: int = 0
    forwards: int = 0
    admitted: int = 0
    finished: int = 0
    refused: int = 0
    moves: int = 0
    tokens_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    allocator_host_waits: int = 0  # host waits inside allocator operations (frees, takes, flushes)


class OverlapDriver:
    def __init__(self, storage: KVStorage, *, seed: int = 0, war_barrier: bool = True, batch: int = 8,
                 max_prompt: int = 40, max_output: int = 24, read_delay: float = 0.0,
                 flush_every: int = 1, flush_moves: int | None = None, persistent_metadata: bool = True) -> None:
        """`persistent_metadata`: forwards read their page tables from one device buffer the schedule
        stream rewrites every step (as CUDA-graph inputs are): the write-after-read barrier is what
        keeps the next step's upload off a running forward's reads. Without it, each forward reads
        its own copy, and only the pool's pending pages, vacated sources and ledger order the
        schedule stream's writes after forwards that still use the pages."""
        self.storage = storage
        self.device = storage.device
        self.rng = np.random.default_rng(seed)
        self.war_barrier = war_barrier
        self.batch = batch
        self.max_prompt = max_prompt
        self.max_output = max_output
        self.read_delay = read_delay
        self.flush_every = flush_every
        self.flush_moves = flush_moves
        self.persistent_metadata = persistent_metadata
        self.stats = OverlapStats()
        self.requests: dict[int, _Request] = {}
        self.steps: StepSequence[_Batch] = StepSequence(storage, depth=1, war_barrier=war_barrier,
                                                        on_processed=self._process)
        self._value = 1.0
        self._lock = threading.Lock()
        plan = storage.plan
        self.token_pools = [p for p in plan.sub_pools if p.kind is not PoolKind.STATE]
        self.state_pool = plan.state
        # expected[name][virtual token id] = value last written (0: never written)
        n_tokens = storage.allocator.n_virtual * plan.page_size + plan.page_size
        self.expected = {p.name: np.zeros(n_tokens, dtype=np.float32) for p in self.token_pools}
        self.expected_slot = np.zeros(storage.allocator.slot_free._ids.size + 1, dtype=np.float32)
        # the persistent device metadata buffer a forward reads its page tables from
        table = storage.table
        self.meta = {p.name: torch.zeros((batch, table.max_pages), dtype=torch.int64) for p in self.token_pools}
        self.meta_slots = torch.full((batch,), -1, dtype=torch.int64)

    # -- values -------------------------------------------------------------------------------------

    def _fresh(self, n: int) -> np.ndarray:
        start = self._value
        self._value += n
        if self._value > 2**23:
            self._value = 1.0
            start = 1.0
            self._value += n
        return np.arange(start, start + n, dtype=np.float32)

    def _component(self, pool_name: str) -> torch.Tensor:
        pool = self.storage.plan.by_name(pool_name)
        comp = pool.envelope.components[0]
        return self.storage.view(pool_name).tensor(comp.layer_id, comp.name)  # [pages, ps, heads, dim]

    def _slot_tensor(self) -> torch.Tensor:
        comp = self.state_pool.envelope.components[0]
        return self.storage.view(self.state_pool.name).tensor(comp.layer_id, comp.name)  # [slots, 4]

    def _mismatch(self, text: str) -> None:
        with self._lock:
            if len(self.stats.mismatches) < 50:
                self.stats.mismatches.append(text)

    # -- scheduling ----------------------------------------------------------------------------------

    def _admit(self) -> None:
        storage = self.storage
        while len(self.requests) < self.batch and storage.table.free_rows:
            row = storage.alloc_row()
            prompt = int(self.rng.integers(1, self.max_prompt + 1))
            output = int(self.rng.integers(1, self.max_output + 1))
            if prompt + output > storage.table.context_len:
                output = storage.table.context_len - prompt
            self.requests[row] = _Request(row, prompt, output)
            self.stats.admitted += 1

    def _counted(self, fn, *args):
        before = self.device.counters.host_waits_blocked
        try:
            return fn(*args)
        finally:
            self.stats.allocator_host_waits += self.device.counters.host_waits_blocked - before

    def _schedule(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Allocate this step's tokens: one more for every running request (preempting the newest
        when the pool is full), then whole prompts for new requests while they fit."""
        storage = self.storage
        table = storage.table
        decodes = [r.row for r in self.requests.values()
                   if r.prefilled and r.generated < r.output and storage.seq_len(r.row) < table.context_len]
        rows, olds, toks = [], [], []
        while decodes:
            rows_a = np.array(decodes)
            old = table.seq_lens[rows_a].copy()
            try:
                vtok = self._counted(storage.alloc_extend, rows_a, old + 1)
            except CapacityError:
                victim = decodes.pop()  # the newest running request gives its memory back
                self._counted(storage.free_rows, np.array([victim]))
                del self.requests[victim]
                self.stats.refused += 1
                continue
            rows.append(rows_a)
            olds.append(old)
            toks.append(vtok)
            for row in decodes:
                self.requests[row].generated += 1
            break
        for req in list(self.requests.values()):
            if req.prefilled:
                continue
            try:
                vtok = self._counted(storage.alloc_extend, np.array([req.row]), np.array([req.prompt]))
            except CapacityError:
                table.free_row(req.row)
                del self.requests[req.row]
                self.stats.refused += 1
                break
            req.prefilled = True
            rows.append(np.array([req.row]))
            olds.append(np.zeros(1, dtype=np.int64))
            toks.append(vtok)
        if not rows:
            return None
        return np.concatenate(rows), np.concatenate(olds), np.concatenate(toks)

    # -- the forward ---------------------------------------------------------------------------------

    def _forward(self, rows: np.ndarray, old_lens: np.ndarray, vtok: np.ndarray) -> tuple[Forward, _Batch]:
        """The scheduled batch's forward: its metadata upload, a read phase that checks every byte
        its rows hold, a write phase that writes fresh values; and what to keep until processing."""
        storage = self.storage
        device = self.device
        ps = storage.page_size
        table = storage.table
        runner = storage.runner_ids(rows)
        writes = storage.iteration_ids(vtok, rows)
        # what each read must see: the values last written for every token the rows held before
        # this forward, in each pool (window pools: the tokens their bound pages hold)
        expect = {}
        for pool in self.token_pools:
            pt = runner.page_tables[pool.name]
            positions = [np.arange(int(o)) for o in old_lens]
            vt = [table.page_table[r, p // ps] * ps + p % ps for r, p in zip(rows, positions)]
            expect[pool.name] = (pt, positions, [self.expected[pool.name][v].copy() for v in vt])
        slot_expect = None
        if self.state_pool is not None:
            virtual = table.state_slot[rows]
            slot_expect = (virtual.copy(), self.expected_slot[virtual].copy(), old_lens > 0)
        values = self._fresh(len(vtok))
        for pool in self.token_pools:
            self.expected[pool.name][vtok] = values
        new_slot_values = None
        if self.state_pool is not None:
            new_slot_values = self._fresh(len(rows))
            self.expected_slot[table.state_slot[rows]] = new_slot_values
        sink = {p.name: storage.allocator.bands[p.index].grid.sink_id for p in self.token_pools}

        # upload the metadata on the schedule stream into the persistent buffer
        meta_src = {name: torch.from_numpy(e[0].copy()) for name, e in expect.items()}
        slot_src = torch.from_numpy(runner.state_slots.copy()) if runner.state_slots is not None else None
        batch_n = len(rows)

        if self.persistent_metadata:
            meta_buf, meta_slot_buf = self.meta, self.meta_slots
        else:
            meta_buf = {name: torch.zeros_like(buf) for name, buf in self.meta.items()}
            meta_slot_buf = torch.full_like(self.meta_slots, -1)

        def upload() -> None:
            for name, src in meta_src.items():
                meta_buf[name][:batch_n, : src.shape[1]] = src
            if slot_src is not None:
                meta_slot_buf[:batch_n] = slot_src

        meta_pages = [PageAccess(-1, np.arange(batch_n))]

        def read_phase(step: int) -> None:
            if self.read_delay:
                time.sleep(self.read_delay)
            checked = 0
            for name, (_pt, positions, want) in expect.items():
                tensor = self._component(name)
                meta = meta_buf[name]
                for i, (pos, w) in enumerate(zip(positions, want)):
                    # rows past the sequence in its last page read zero (ALLOC-20)
                    tail = np.arange(int(old_lens[i]), -(-int(old_lens[i]) // ps) * ps)
                    if len(tail):
                        got = tensor[meta[i, torch.from_numpy(tail // ps)], torch.from_numpy(tail % ps)]
                        got = got.reshape(len(tail), -1)[:, 0].numpy()
                        if (got != 0).any():
                            k = int(np.flatnonzero(got != 0)[0])
                            self._mismatch(f"step {step} {name}: row {int(rows[i])} pos {int(tail[k])} past the "
                                           f"sequence reads {got[k]}, not zero")
                    if not len(pos):
                        continue
                    pages = meta[i, torch.from_numpy(pos // ps)]
                    got = tensor[pages, torch.from_numpy(pos % ps)].reshape(len(pos), -1)[:, 0].numpy()
                    held = (pages.numpy() != sink[name]) & (w != 0)
                    bad = held & (got != w)
                    checked += int(held.sum())
                    if bad.any():
                        k = int(np.flatnonzero(bad)[0])
                        self._mismatch(f"step {step} {name}: row {int(rows[i])} pos {int(pos[k])} "
                                       f"read {got[k]} want {w[k]}")
            if slot_expect is not None:
                _virtual, want, started = slot_expect
                slots = meta_slot_buf[:batch_n].numpy()
                got = self._slot_tensor()[torch.from_numpy(slots)].reshape(batch_n, -1)[:, 0].numpy()
                bad = started & (want != 0) & (got != want)
                if bad.any():
                    k = int(np.flatnonzero(bad)[0])
                    self._mismatch(f"step {step} state: row {int(rows[k])} read {got[k]} want {want[k]}")
            with self._lock:
                self.stats.tokens_checked += checked

        locs = {name: torch.from_numpy(v.copy()) for name, v in writes.locs.items()}
        slots_w = torch.from_numpy(writes.state_slots.copy()) if writes.state_slots is not None else None
        vals = torch.from_numpy(values)
        slot_vals = torch.from_numpy(new_slot_values) if new_slot_values is not None else None

        def write_phase() -> None:
            for name, loc in locs.items():
                tensor = self._component(name)
                tensor[loc // ps, loc % ps] = vals.view(-1, 1, 1).expand(-1, *tensor.shape[2:])
            if slots_w is not None:
                self._slot_tensor()[slots_w] = slot_vals.view(-1, 1).expand(-1, self._slot_tensor().shape[1])

        reads = [PageAccess(p.index, np.unique(e[0])) for p, e in zip(self.token_pools, expect.values())]
        written = [PageAccess(self.storage.plan.by_name(n).index, np.unique(v // ps)) for n, v in writes.locs.items()]

        # a kernel reads its metadata and pages all through its run: check at its start and its end
        forward = Forward.read_then_write(device, read_phase, write_phase, reads=reads, writes=written, ids=writes,
                                          upload=MetadataUpload(upload, meta_pages), read_at_start=True)
        finished = [int(r) for r in rows if self.requests[int(r)].prefilled
                    and self.requests[int(r)].generated >= self.requests[int(r)].output]
        return forward, _Batch(rows, finished)

    # -- processing --------------------------------------------------------------------------------

    def _process(self, launched: Launched[_Batch]) -> None:
        """The driver's part of processing a result, after the step sequence retired the forward:
        retire window rows, free the requests that finished."""
        storage = self.storage
        batch = launched.payload
        live = [int(r) for r in batch.rows if int(r) in self.requests]
        if live:
            self._counted(storage.advance, np.array(live))
        done = [r for r in batch.finished if r in self.requests]
        if done:
            self._counted(storage.free_rows, np.array(done))
            for r in done:
                del self.requests[r]
            self.stats.finished += len(done)

    def step(self) -> None:
        self._admit()
        scheduled = self._schedule()
        forward, batch = self._forward(*scheduled) if scheduled is not None else (None, None)
        flush = bool(self.flush_every) and (self.stats.steps + 1) % self.flush_every == 0
        result = self.steps.step(forward, batch, flush=flush, max_moves=self.flush_moves)
        if result.launched is not None:
            self.stats.forwards += 1
        self.stats.steps += 1
        if result.moved is not None:
            self.stats.moves += result.moved
            self.stats.allocator_host_waits += result.flush_host_waits

    def drain(self) -> None:
        self.steps.drain()
        self.device.synchronize()

    def run(self, steps: int) -> OverlapStats:
        for _ in range(steps):
            self.step()
        self.drain()
        return self.stats
