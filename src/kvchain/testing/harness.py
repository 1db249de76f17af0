"""The page-safety stress harness (HARN-1..13): seeded random sequences of scheduler-level
operations against a real `ChainAllocator` over a real CPU arena, run on two simulated ranks whose
completion timing differs, with every check of `checks.py` after every operation.

An operation is a small JSON dict (`{"op": "admit", "len": 17}`), interpreted against the rank's
state when it runs (`pick` indices wrap around whatever candidates exist; an operation with no
candidate does nothing), so any subsequence of a sequence is a valid sequence: that is what lets
a failing sequence be shrunk (`minimize`) and saved (`Case`), and replayed to the same failure.

The chain (`harness_plan`): a full-attention owner end with the state end, one or two floating
windows, page sizes 1, 2 or 4, and KV head counts that differ per band so page bytes differ. Each
rank plays the scheduler, the prefix tree, the host tier and the PD engine (`Rank`); forwards read
every byte their rows hold and write fresh values, transfers check what they read."""

from __future__ import annotations

import json
import random
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ..alloc.page_usage import PageUse
from ..alloc.pricing import Step, first_plan
from ..alloc.signals import HostTransfer, NetworkTransfer, ReceiveHold
from ..decl import (
    MHA,
    FullLifetime,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from ..device.base import Device, Event, PageAccess, Stream
from ..device.modeled import ModeledDevice, clock_leq
from ..device.threads import ThreadDevice
from ..errors import CapacityError, InputError, InvariantError
from ..plan import KVStoragePlan, PoolKind, plan_kv_storage
from ..requests import NO_SLOT
from ..sizing import check_bs1_floor, fixed_allocations, size_plan
from ..storage import KVStorage
from . import checks
from .checks import META_BAND, ByteShadow, Finding, Granules, HostReadTracker, OverlapTracker

FORMAT_VERSION = 1
#: most forwards launched and not yet processed: the overlap scheduler runs N+1 while processing N
MAX_IN_FLIGHT = 2

# ----------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RankTiming:
    """One simulated rank's device: its seed and mean durations per stream."""

    seed: int
    forward: float
    copy: float
    network: float
    schedule: float = 1.0


@dataclass(frozen=True)
class HarnessConfig:
    """Everything a sequence's run depends on besides its operations (saved with each case)."""

    seed: int
    page_size: int
    full: tuple[int, int]  # kv heads, head dim
    windows: tuple[tuple[int, int, int], ...]  # window, kv heads, head dim
    state_floats: int
    chain_bytes: int
    rows: int
    context: int
    war_barrier: bool  # persistent metadata and the write-after-read barrier; else per-forward metadata
    max_moves: int
    gap_fraction: float
    timing: tuple[RankTiming, RankTiming]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HarnessConfig:
        data = dict(data)
        data["full"] = tuple(data["full"])
        data["windows"] = tuple(tuple(w) for w in data["windows"])
        data["timing"] = tuple(RankTiming(**t) for t in data["timing"])
        return cls(**data)


def config_for_seed(seed: int) -> HarnessConfig:
    """A seed's chain and timing: page size, windows, head counts and arena size all vary."""
    rng = random.Random(seed * 7919 + 17)
    page_size = rng.choice((1, 2, 4))
    n_windows = rng.choice((1, 2))
    lengths = sorted(rng.sample((4, 8, 12, 16, 24, 32), n_windows), reverse=True)
    windows = tuple((w, rng.choice((1, 2)), rng.choice((4, 8))) for w in lengths)
    timing = tuple(RankTiming(seed * 2 + r, rng.choice((2.0, 4.0, 8.0)), rng.choice((1.0, 3.0, 6.0)),
                              rng.choice((1.0, 4.0, 9.0))) for r in (0, 1))
    config = HarnessConfig(
        seed=seed, page_size=page_size, full=(rng.choice((1, 2)), rng.choice((4, 8))), windows=windows,
        state_floats=rng.choice((16, 32, 64)), chain_bytes=rng.choice((6, 8, 12, 16)) * 1024, rows=12,
        context=96, war_barrier=rng.random() < 0.5, max_moves=rng.choice((2, 8, 64)),
        gap_fraction=rng.choice((0.25, 1.0)), timing=timing,  # type: ignore[arg-type]
    )
    # at least the batch-size-1 floor's chain share (DECL-12), and room for one request beyond it
    plan = harness_plan(config)
    fixed = fixed_allocations(plan, config.context, config.rows).total
    floor = check_bs1_floor(plan, 2**30, config.context, config.rows).total - fixed
    if config.chain_bytes < floor + 2048:
        config = replace(config, chain_bytes=-(-(floor + 2048) // 1024) * 1024)
    return config


def harness_plan(config: HarnessConfig) -> KVStoragePlan:
    """The chain: state end, windows floating, full attention owning the other end; all float32
    so payload values are exact."""
    heads, dim = config.full
    first = [KVPart(MHA(heads, dim, dtype="float32"), FullLifetime()),
             KVPart(State((StateTensor("ssm", (config.state_floats,), "float32"),)), StateLifetime())]
    layers: list = [first]
    for window, h, d in config.windows:
        layers.append(KVPart(MHA(h, d, dtype="float32"), WindowLifetime(window)))
    return plan_kv_storage(kv_layer_decls(layers), page_size=config.page_size)


def harness_storage(config: HarnessConfig, backend: Device, arena_device: str = "cpu") -> KVStorage:
    from ..build import build_kv_storage

    plan = harness_plan(config)
    kwargs = dict(context_len=config.context, max_running_requests=config.rows, state_slots=config.rows)
    probe = size_plan(plan, 2**30, **kwargs)
    sizing = size_plan(plan, probe.fixed.total + config.chain_bytes, **kwargs)
    storage = build_kv_storage(plan, sizing, arena_device, backend=backend)
    chain = storage.allocator
    chain.compaction_gap_fraction = config.gap_fraction
    chain.max_moves_per_call = config.max_moves
    return storage


# ----------------------------------------------------------------------------------- operations

#: operation kinds and their weights in a random sequence
OP_WEIGHTS: dict[str, int] = {
    "admit": 10, "decode": 16, "forward": 14, "process": 10, "free": 8, "advance": 3, "flush": 10,
    "relief": 3, "compact": 3, "relayout": 2, "load": 3, "backup": 3, "end_copy": 4, "send": 3,
    "end_send": 3, "recv": 2, "publish": 3, "end_recv": 3, "copy_state": 3, "slots": 3, "free_slots": 3,
    "tick": 3, "quiesce": 1,
}


def random_op(rng: random.Random, config: HarnessConfig) -> dict:
    kind = rng.choices(list(OP_WEIGHTS), weights=list(OP_WEIGHTS.values()))[0]
    op: dict = {"op": kind}
    if kind in ("admit", "recv"):
        op["len"] = rng.randint(1, 32)
    elif kind == "process":
        op["advance"] = rng.randint(0, 1)
    elif kind == "decode":
        op["k"] = rng.randint(1, 8)
        op["start"] = rng.randint(0, 15)
    elif kind in ("free", "advance", "backup", "send", "end_copy", "end_send", "publish", "end_recv",
                  "free_slots", "relayout"):
        op["pick"] = rng.randint(0, 99)
    elif kind == "compact":
        op["end"] = rng.randint(0, 1)
        op["fr"] = round(rng.uniform(0.3, 1.0), 2)
    elif kind == "relief":
        op["fr"] = [round(rng.random(), 2) for _ in range(len(config.windows) + 2)]
    elif kind == "load":
        op["pages"] = rng.randint(1, max(1, 16 // config.page_size))
    elif kind == "copy_state":
        op["src"] = rng.randint(0, 99)
        op["dst"] = rng.randint(0, 99)
    elif kind == "slots":
        op["n"] = rng.randint(1, 6)
    elif kind == "tick":
        op["dt"] = round(rng.uniform(0.5, 12.0), 2)
    return op


def generate_ops(seed: int, n_ops: int, config: HarnessConfig | None = None) -> list[dict]:
    config = config or config_for_seed(seed)
    rng = random.Random(seed * 104729 + 3)
    return [random_op(rng, config) for _ in range(n_ops)]


# ----------------------------------------------------------------------------------- the device

_COPY_LABELS = ("move", "relocate", "state_copy", "prewarm")


class HarnessDevice(ModeledDevice):
    """A `ModeledDevice` that tells its rank about stream waits (`host_read_after_wait`) and
    updates the byte shadow as each item's writes land (`cross_dtype_bytes`)."""

    def __init__(self, timing: RankTiming) -> None:
        super().__init__(seed=timing.seed, durations={"forward": timing.forward, "copy": timing.copy,
                                                      "network": timing.network, "schedule": timing.schedule})
        self.shadow: ByteShadow | None = None
        self.reads: HostReadTracker | None = None

    def launch(self, stream: Stream, fn: Callable[[], None] | None, *, reads: Sequence[PageAccess] = (),
               writes: Sequence[PageAccess] = (), label: str = "", on_start: Callable[[], None] | None = None) -> None:
        shadow = self.shadow
        if shadow is not None and writes:
            partial = label.startswith("forward:")

            def landed() -> None:
                if fn is not None:
                    fn()
                shadow.landed(reads, writes, partial)

            super().launch(stream, landed, reads=reads, writes=writes, label=label, on_start=on_start)
        else:
            super().launch(stream, fn, reads=reads, writes=writes, label=label, on_start=on_start)

    def stream_wait(self, stream: Stream, event: Event) -> None:
        if self.reads is not None:
            unfinished = not clock_leq(getattr(event, "clock", {}), self.host_clock)
            self.reads.stream_wait(stream.name, event.label, unfinished)
        super().stream_wait(stream, event)


def cuda_device(timing: RankTiming) -> Device:
    """`CudaDevice` with every launched item delayed by a seeded spin, so missing waits show (HARN-14)."""
    from ..device.cuda import CudaDevice

    class DelayedCudaDevice(CudaDevice):
        def __init__(self) -> None:
            super().__init__()
            self.rng = random.Random(timing.seed)
            self.scale = {"forward": timing.forward, "copy": timing.copy, "network": timing.network}

        def launch(self, stream, fn, *, reads=(), writes=(), label="", on_start=None):
            cycles = int(self.rng.random() * self.scale.get(stream.name, 1.0) * 200_000)

            def start() -> None:
                torch.cuda._sleep(cycles)
                if on_start is not None:
                    on_start()

            def end() -> None:
                torch.cuda._sleep(cycles // 2)
                if fn is not None:
                    fn()

            super().launch(stream, end, reads=reads, writes=writes, label=label, on_start=start)

        def advance(self, dt: float) -> None:
            pass

    return DelayedCudaDevice()


# ----------------------------------------------------------------------------------- one rank

READY, LOADING, HELD, RECEIVING, SENDING = "ready", "loading", "held", "receiving", "sending"


@dataclass
class Req:
    """A request as the scheduler sees it. `written`: tokens whose writes were launched (a forward)
    or landed (a load or receive, once ended)."""

    rid: int
    row: int
    written: int = 0
    status: str = READY
    in_flight: int = 0
    hold: ReceiveHold | None = None


@dataclass
class Forward:
    record: object
    done: Event
    rids: list[int]


@dataclass
class Job:
    """A host-tier copy (backup, load) or a network transfer (send, receive)."""

    kind: str
    name: str
    rid: int | None
    done: Event | None = None
    transfer: HostTransfer | NetworkTransfer | None = None
    length: int = 0


@dataclass
class _Tokens:
    """Token positions to check: batch index, page column, offset, wanted value, tail (reads zero)."""

    rows: torch.Tensor
    cols: torch.Tensor
    offs: torch.Tensor
    want: torch.Tensor
    need: torch.Tensor  # wanted value known, or a tail position


class Rank:
    """One simulated rank: a storage on its own device, and the scheduler, tree, host tier and PD
    engine around it. `step(op)` runs one operation and returns its outcome (a short string the
    two ranks must agree on); `take_findings()` returns what the checks found since the last call."""

    def __init__(self, config: HarnessConfig, index: int, device: str = "modeled") -> None:
        self.config = config
        self.index = index
        self.modeled = device == "modeled"
        self.device_kind = device
        timing = config.timing[index]
        arena_device = "cpu"
        if self.modeled:
            self.device: Device = HarnessDevice(timing)
        elif device == "threads":
            self.device = ThreadDevice()
        elif device == "cuda":
            self.device = cuda_device(timing)
            arena_device = "cuda"
        else:
            raise InputError(f"harness device must be modeled, threads or cuda, not {device!r}")
        self.storage = harness_storage(config, self.device, arena_device)
        storage = self.storage
        self.chain = chain = storage.allocator
        chain.decisions = []
        self.plan = storage.plan
        self.ps = config.page_size
        self.torch_device = storage.arena.device
        self.findings: list[Finding] = []
        self._lock = threading.Lock()
        self.reqs: dict[int, Req] = {}
        self.in_flight: list[Forward] = []
        self.jobs: list[Job] = []
        self.tracking: list[np.ndarray] = []
        self._rid = 0
        self._job = 0
        self._value = 1.0
        self.token_bands = list(chain.token_bands)
        self.state_band = chain.state_band
        n_tokens = chain.n_virtual * self.ps + self.ps
        self.expected = np.zeros(n_tokens, dtype=np.float32)
        self.expected_slot = np.zeros(self.state_band.grid.n_grid + 1, dtype=np.float32)
        self.comps = {b.index: self._components(b.pool) for b in chain.bands}
        self.sinks = {b.index: (b.grid.sink_id if b.grid.sink_id is not None else -1) for b in chain.bands}
        rows, max_pages = storage.table.rows, storage.table.max_pages
        self.meta = {b.index: torch.zeros((rows, max_pages), dtype=torch.int64, device=self.torch_device)
                     for b in self.token_bands}
        self.meta_slots = torch.full((rows,), -1, dtype=torch.int64, device=self.torch_device)
        #: CUDA: mismatches counted on the device, one counter per stream (streams run concurrently)
        self.bad: dict[int, torch.Tensor] = {}
        self.reads = HostReadTracker()
        self.granules = Granules(chain.layout, meta_rows=rows)
        self.overlap: OverlapTracker | None = None
        self.shadow: ByteShadow | None = None
        if self.modeled:
            self.overlap = OverlapTracker(self.granules)
            self.shadow = ByteShadow(self.granules, self.state_band.index)
            assert isinstance(self.device, HarnessDevice)
            self.device.shadow = self.shadow
            self.device.reads = self.reads
            self._consume_history()
        for band in chain.bands:
            self._observe_read_ahead(band)

    # -- plumbing ----------------------------------------------------------------------------------

    def _components(self, pool) -> list[torch.Tensor]:
        view = self.storage.view(pool.name)
        return [view.tensor(c.layer_id, c.name) for c in pool.envelope.components]

    def _observe_read_ahead(self, band) -> None:
        """The recovery read-ahead is a host read of device state (HARN-9). Look the method up on
        the class at call time, so a mutant patched in later still runs."""
        reads = self.reads

        def read_ahead_for_recovery() -> None:
            reads.host_read(f"{band.name}'s recovery read-ahead")
            return type(band).read_ahead_for_recovery(band)

        band.read_ahead_for_recovery = read_ahead_for_recovery

    def _find(self, check: str, message: str) -> None:
        with self._lock:  # device work on worker threads (ThreadDevice) reports here too
            if len(self.findings) < 20:
                self.findings.append(Finding(check, message, self.index))

    def take_findings(self) -> list[Finding]:
        with self._lock:
            out, self.findings = self.findings, []
        return out

    def close(self) -> None:
        self.device.close()

    def _report(self, count: torch.Tensor, message: Callable[[], str], check: str = checks.LOST_WRITE) -> None:
        """A mismatch count from device work: on the CPU at once with details; on CUDA, summed on
        the device and read at quiescence."""
        if self.torch_device.type == "cpu":
            if int(count):
                self._find(check, message())
            return
        stream = torch.cuda.current_stream(self.torch_device)
        counter = self.bad.get(stream.cuda_stream)
        if counter is None:
            counter = self.bad[stream.cuda_stream] = torch.zeros((), dtype=torch.int64, device=self.torch_device)
        counter += count

    def _fresh(self, n: int) -> np.ndarray:
        if self._value + n > 2**23:
            self._value = 1.0
        out = np.arange(self._value, self._value + n, dtype=np.float32)
        self._value += n
        return out

    def _t(self, a: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        t = t if dtype is None or t.dtype == dtype else t.to(dtype)
        return t if self.torch_device.type == "cpu" else t.to(self.torch_device)

    def _consume_history(self) -> None:
        device = self.device
        assert isinstance(device, HarnessDevice) and self.overlap is not None
        if device.history:
            for problem in self.overlap.consume(device.history):
                self._find(checks.UNORDERED_OVERLAP, problem)
            device.history.clear()

    def _alive(self, status: str | None = READY) -> list[Req]:
        return [r for r in self.reqs.values() if status is None or r.status == status]

    @staticmethod
    def _pick(items: list, pick: int):
        return items[pick % len(items)] if items else None

    def _tokens_of(self, row: int, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop, dtype=np.int64)
        return self.storage.table.page_table[row, pos // self.ps] * self.ps + pos % self.ps

    # -- one step ------------------------------------------------------------------------------------

    def step(self, op: dict) -> str:
        """Run one operation; exceptions the pool should not raise become `error` findings."""
        self.reads.begin_step()
        handler = getattr(self, f"op_{op.get('op')}", None)
        if handler is None:
            raise InputError(f"unknown harness operation {op!r}")
        try:
            outcome = handler(op)
        except InvariantError as e:
            check = checks.HOST_READ_AFTER_WAIT if e.check == "band.host_read_before_wait" else checks.ERROR
            self._find(check, f"{op['op']}: {e}")
            outcome = f"raised {type(e).__name__}"
        except Exception as e:  # the pool, or the harness, broke: report and stop the run
            tb = traceback.extract_tb(e.__traceback__)[-1]
            self._find(checks.ERROR, f"{op['op']}: {type(e).__name__}: {e} (at {Path(tb.filename).name}:{tb.lineno})")
            outcome = f"raised {type(e).__name__}"
        for found in self.reads.found:
            self._find(checks.HOST_READ_AFTER_WAIT, f"{op['op']}: {found}")
        self.reads.found.clear()
        try:
            self.chain.verify_byte_accounting()  # counts, spans and maps stay consistent (CHK-15)
        except InvariantError as e:
            self._find(checks.ERROR, f"{op['op']}: {e}")
        if self.modeled:
            self._consume_history()
        return outcome

    def take_decisions(self) -> list:
        out = self.chain.decisions
        self.chain.decisions = []
        return out

    def _fingerprint(self) -> tuple:
        """What a refused take must leave as it was (ALLOC-7): every band's span and counts, the
        free id lists, and the moves made."""
        chain = self.chain
        bands = tuple((b.lo, b.hi, b.parked, b.n_live, b.n_holes, b.n_pending, b.n_fixed, b.n_vacated)
                      for b in chain.bands)
        return bands, len(chain.virtual_free), len(chain.slot_free), chain.move_epoch

    def _refused(self, before: tuple, what: str) -> str:
        after = self._fingerprint()
        if after != before:
            changed = [f"{b.name} {x} -> {y}" for b, x, y in zip(self.chain.bands, before[0], after[0]) if x != y]
            self._find(checks.ERROR, f"a refused {what} changed the pool (ALLOC-7): "
                                     f"{'; '.join(changed) or 'free ids or moves changed'}")
        return "refused"

    # -- requests ------------------------------------------------------------------------------------

    def _new_req(self, row: int, **kw) -> Req:
        self._rid += 1
        req = Req(self._rid, row, **kw)
        self.reqs[req.rid] = req
        return req

    def op_admit(self, op: dict) -> str:
        storage = self.storage
        if not storage.table.free_rows:
            return "no row"
        row = storage.alloc_row()
        before = self._fingerprint()
        try:
            vtok = storage.alloc_extend(np.array([row]), np.array([min(op["len"], self.config.context)]))
        except CapacityError:
            storage.table.free_row(row)
            return self._refused(before, "admission")
        self.expected[vtok] = 0
        req = self._new_req(row)
        return f"admitted r{req.rid}"

    def op_decode(self, op: dict) -> str:
        storage = self.storage
        seq = storage.table.seq_lens
        ready = [r for r in self._alive() if r.written == seq[r.row] < self.config.context]
        if not ready:
            return "none"
        start = op["start"] % len(ready)
        chosen = (ready[start:] + ready[:start])[: op["k"]]
        rows = np.array([r.row for r in chosen])
        before = self._fingerprint()
        try:
            vtok = storage.alloc_decode(rows)
        except CapacityError:
            return self._refused(before, "decode")
        self.expected[vtok] = 0
        return f"decoded {len(rows)}"

    def op_free(self, op: dict) -> str:
        req = self._pick(sorted(self.reqs.values(), key=lambda r: r.rid), op["pick"])
        if req is None:
            return "none"
        self._free(req)
        return f"freed r{req.rid}"

    def _free(self, req: Req) -> None:
        if req.hold is not None and not req.hold.published:
            self.storage.published(req.hold)  # an aborted receive lets its rows go
        slot = self.storage.table.state_slot[req.row]
        self.storage.free_rows(np.array([req.row]))
        if slot != NO_SLOT:
            self.expected_slot[slot] = 0  # the slot id's next holder starts unwritten
        del self.reqs[req.rid]

    def op_advance(self, op: dict) -> str:
        req = self._pick(self._alive(), op["pick"])
        if req is None:
            return "none"
        return f"retired {self.storage.advance(np.array([req.row]))}"

    # -- forwards ---------------------------------------------------------------------------------

    def op_forward(self, op: dict) -> str:
        outcome = ""
        if len(self.in_flight) >= MAX_IN_FLIGHT:
            outcome = self._process() + "; "
        seq = self.storage.table.seq_lens
        batch = [r for r in self._alive() if seq[r.row] > r.written]
        if not batch:
            return outcome + "no forward"
        self._launch(batch)
        return outcome + f"launched {len(batch)}"

    def _read_tokens(self, batch: list[Req]) -> tuple[_Tokens, np.ndarray]:
        """What the forward reads: every written token of its rows, and the rest of the last
        written page, which must read zero (ALLOC-20)."""
        ps = self.ps
        rows_i, pos = [], []
        for i, req in enumerate(batch):
            end = -(-req.written // ps) * ps
            if end:
                p = np.arange(end, dtype=np.int64)
                pos.append(p)
                rows_i.append(np.full(end, i, dtype=np.int64))
        if not pos:
            empty = np.empty(0, dtype=np.int64)
            t = self._t(empty)
            return _Tokens(t, t, t, self._t(empty.astype(np.float32), None), self._t(empty.astype(bool), None)), empty
        rows_i_a, pos_a = np.concatenate(rows_i), np.concatenate(pos)
        table_rows = np.array([r.row for r in batch])[rows_i_a]
        vtok = self.storage.table.page_table[table_rows, pos_a // ps] * ps + pos_a % ps
        written = np.array([r.written for r in batch])[rows_i_a]
        tail = pos_a >= written
        want = np.where(tail, 0.0, self.expected[vtok]).astype(np.float32)
        need = tail | (want != 0)
        tokens = _Tokens(self._t(rows_i_a), self._t(pos_a // ps), self._t(pos_a % ps), self._t(want, None),
                         self._t(need, None))
        return tokens, pos_a // ps

    def _check_tokens(self, band_index: int, pages: torch.Tensor, tokens: _Tokens, what: Callable[[int], str]) -> None:
        """Compare the bytes at (page, offset) with the wanted values; a sink page is not checked."""
        if not len(pages):
            return
        mask = tokens.need & (pages != self.sinks[band_index])
        bad = torch.zeros_like(mask)
        for comp in self.comps[band_index]:
            got = comp[pages, tokens.offs].reshape(len(pages), -1)
            bad |= (got != tokens.want.view(-1, 1)).any(dim=1)
        bad &= mask
        self._report(bad.sum(), lambda: self._describe_bad(band_index, pages, tokens, bad, what))

    def _describe_bad(self, band_index, pages, tokens, bad, what) -> str:
        k = int(torch.nonzero(bad)[0])
        comp = self.comps[band_index][0]
        got = float(comp[pages[k], tokens.offs[k]].reshape(-1)[0])
        band = self.chain.bands[band_index].name
        return (f"{what(k)} reads {band} page {int(pages[k])} offset {int(tokens.offs[k])}: {got:g}, "
                f"want {float(tokens.want[k]):g} ({int(bad.sum())} tokens wrong)")

    def _check_state_bytes(self, band_index: int, pages: torch.Tensor, what: str) -> None:
        if self.shadow is None or not len(pages):
            return
        ids = np.unique(pages.numpy())
        ids = ids[ids != self.sinks[band_index]]
        hit = self.shadow.state_bytes_in(band_index, ids)
        if len(hit):
            band = self.chain.bands[band_index].name
            self._find(checks.CROSS_DTYPE_BYTES, f"{what} reads {band} pages {hit[:4].tolist()} holding bytes "
                                                 f"last written as FP32 state")

    def _launch(self, batch: list[Req]) -> None:
        storage, device = self.storage, self.device
        ps = self.ps
        n = len(batch)
        rows = np.array([r.row for r in batch], dtype=np.int64)
        runner = storage.runner_ids(rows)
        tokens, cols = self._read_tokens(batch)
        new_tok = [self._tokens_of(r.row, r.written, int(storage.table.seq_lens[r.row])) for r in batch]
        vtok = np.concatenate(new_tok)
        writes = storage.iteration_ids(vtok, rows)
        vslots = storage.table.state_slot[rows]
        slot_want = self.expected_slot[vslots].copy()
        values = self._fresh(len(vtok))
        slot_values = self._fresh(n)
        self.expected[vtok] = values
        self.expected_slot[vslots] = slot_values

        tables = {b.index: runner.page_tables[b.name] for b in self.token_bands}
        slots_now = runner.state_slots.copy()
        reads = []
        for b in self.token_bands:
            t = tables[b.index]
            if len(cols):
                bi = tokens.rows.cpu().numpy()
                reads.append(PageAccess(b.index, np.unique(t[bi, cols])))
        reads.append(PageAccess(self.state_band.index, np.unique(slots_now[slots_now >= 0])))
        if self.config.war_barrier:
            # forwards read their page tables from one persistent buffer (as CUDA-graph inputs are):
            # the write-after-read barrier keeps the next upload off a running forward's reads
            meta, meta_slots = self.meta, self.meta_slots
            src = {i: self._t(t) for i, t in tables.items()}
            slot_src = self._t(slots_now)

            def upload() -> None:
                for i, t in src.items():
                    if t.shape[1]:
                        meta[i][:n, : t.shape[1]] = t
                meta_slots[:n] = slot_src

            meta_rows = (PageAccess(META_BAND, np.arange(n)),)
            device.launch(device.schedule_stream, upload, writes=meta_rows, label="upload")
            reads.append(meta_rows[0])
        else:
            meta = {i: self._t(t) if t.shape[1] else torch.zeros((n, 1), dtype=torch.int64, device=self.torch_device)
                    for i, t in tables.items()}
            meta_slots = self._t(slots_now)
        storage.order_forward_after_schedule()
        record = storage.forward_launched()
        step = record.step
        slot_want_t = self._t(slot_want, None)
        slot_need = self._t(slot_want != 0, None)
        rids = [r.rid for r in batch]
        rows_of = tokens.rows

        def where(k: int) -> str:
            return f"forward {step} (r{rids[int(rows_of[k])]})"

        def read_phase() -> None:
            for b in self.token_bands:
                if not len(tokens.rows):
                    break
                pages = meta[b.index][tokens.rows, tokens.cols]
                self._check_tokens(b.index, pages, tokens, where)
                self._check_state_bytes(b.index, pages, f"forward {step}")
            slots = meta_slots[:n]
            ok = slots >= 0
            got = self.comps[self.state_band.index][0][slots.clamp(min=0)].reshape(n, -1)
            bad = (got != slot_want_t.view(-1, 1)).any(dim=1) & slot_need & ok
            self._report(bad.sum(), lambda: f"forward {step} reads state slots of {[rids[int(i)] for i in torch.nonzero(bad).flatten()][:4]}: stale")

        locs = {b.index: self._t(writes.locs[b.name]) for b in self.token_bands}
        slot_w = self._t(writes.state_slots)
        vals = self._t(values, None)
        slot_vals = self._t(slot_values, None)

        def write_phase() -> None:
            for i, loc in locs.items():
                for comp in self.comps[i]:
                    comp[loc // ps, loc % ps] = vals.view(-1, *([1] * (comp.dim() - 2))).expand(len(loc), *comp.shape[2:])
            comp = self.comps[self.state_band.index][0]
            comp[slot_w] = slot_vals.view(-1, 1).expand(n, *comp.shape[1:])

        written = [PageAccess(b.index, np.unique(writes.locs[b.name] // ps)) for b in self.token_bands]
        written.append(PageAccess(self.state_band.index, np.unique(writes.state_slots)))
        device.launch(device.forward_stream, read_phase, on_start=read_phase, reads=reads, label=f"forward:{step}:read")
        shared = device.record(device.forward_stream, f"shared_read_done:{step}")
        device.launch(device.forward_stream, write_phase, writes=written, label=f"forward:{step}:write")
        done = device.record(device.forward_stream, f"forward_done:{step}")
        storage.record_forward(record, done, writes, shared_read_done=shared if self.config.war_barrier else None)
        if self.config.war_barrier:
            storage.apply_war_barrier()
        for req in batch:
            req.written = int(storage.table.seq_lens[req.row])
            req.in_flight += 1
        self.in_flight.append(Forward(record, done, rids))

    def op_process(self, op: dict) -> str:
        return self._process(bool(op.get("advance", 1))) if self.in_flight else "none"

    def _process(self, advance: bool = True) -> str:
        """Process the oldest forward (LIFE-23); with `advance`, retire its rows' window pages (WIN-1)."""
        fwd = self.in_flight.pop(0)
        self.device.host_wait(fwd.done)
        self.storage.forward_processed(fwd.record)
        alive = [self.reqs[rid] for rid in fwd.rids if rid in self.reqs]
        for req in alive:
            req.in_flight -= 1
        retired = 0
        if advance and alive:
            retired = self.storage.advance(np.array([r.row for r in alive], dtype=np.int64))
        return f"processed {fwd.record.step} retired {retired}"

    # -- maintenance -------------------------------------------------------------------------------

    def op_flush(self, op: dict) -> str:
        return f"moved {self.storage.flush_opportunistic()}"

    def op_tick(self, op: dict) -> str:
        advance = getattr(self.device, "advance", None)
        if advance is not None:
            advance(op["dt"])
        return "tick"

    def op_relief(self, op: dict) -> str:
        chain = self.chain
        free = chain.available_bytes_estimate()
        fr = list(op["fr"]) + [0.0] * len(chain.bands)
        demand = [int(fr[i] * free / b.page_bytes / len(chain.bands)) for i, b in enumerate(chain.bands)]
        return f"relief {demand} {chain.ensure_capacity(demand)}"

    def op_compact(self, op: dict) -> str:
        """A relief one end band asks for, large enough to need that end compacted (FLUSH_ENDS)
        when the in-place plan falls short."""
        chain = self.chain
        band = chain.bands[0] if op["end"] == 0 else chain.bands[-1]
        free_pages = chain.available_bytes_estimate() // band.page_bytes
        demand = [0] * len(chain.bands)
        demand[band.index] = max(1, int(op["fr"] * free_pages))
        return f"compact {band.name} {demand[band.index]} {chain.ensure_capacity(demand)}"

    def op_relayout(self, op: dict) -> str:
        """A relief that must relocate a float (RELAYOUT), when one exists."""
        chain = self.chain
        floats = [b for b in chain.bands if b.pool.kind is PoolKind.WINDOW]
        band = self._pick(floats, op["pick"])
        free_pages = chain.available_bytes_estimate() // band.page_bytes
        snap = chain.pricing_snapshot()
        for k in range(int(free_pages), 0, -max(1, int(free_pages) // 24)):
            demand = [0] * len(chain.bands)
            demand[band.index] = k
            layout = first_plan(snap, demand)
            if layout is not None and layout.step is Step.RELAYOUT:
                return f"relayout {band.name} {k} {chain.ensure_capacity(demand)}"
        return "no relayout"

    def op_copy_state(self, op: dict) -> str:
        table = self.storage.table
        idle = [r for r in self._alive() if r.in_flight == 0 and table.state_slot[r.row] != NO_SLOT]
        src = self._pick([r for r in idle if self.expected_slot[table.state_slot[r.row]] != 0], op["src"])
        dst = self._pick([r for r in idle if src is not None and r.rid != src.rid], op["dst"])
        if src is None or dst is None:
            return "none"
        s, d = table.state_slot[src.row], table.state_slot[dst.row]
        self.storage.copy_state(np.array([s]), np.array([d]))
        self.expected_slot[d] = self.expected_slot[s]
        return f"copied r{src.rid} -> r{dst.rid}"

    def op_slots(self, op: dict) -> str:
        before = self._fingerprint()
        try:
            self.tracking.append(self.storage.alloc_state_slots(op["n"]))
        except CapacityError:
            return self._refused(before, "state-slot take")
        return f"slots {len(self.tracking)}"

    def op_free_slots(self, op: dict) -> str:
        if not self.tracking:
            return "none"
        slots = self.tracking.pop(op["pick"] % len(self.tracking))
        self.storage.free_state_slots(slots)
        self.expected_slot[slots] = 0
        return f"freed {len(slots)} slots"

    # -- host tier -----------------------------------------------------------------------------------

    def _after_schedule_and_forwards(self, stream: Stream) -> None:
        """A copy or transfer engine starts after the forward stream (HIC-1, HIC-9) and after the
        schedule stream, where the pool queued the takes' zeroing, moves and clearance waits."""
        device = self.device
        device.stream_wait(stream, device.record(device.schedule_stream, "schedule"))
        device.stream_wait(stream, device.record(device.forward_stream, "forwards"))

    def _full_pages(self, req: Req) -> dict[int, np.ndarray]:
        """Virtual pages per token band holding only written tokens, bound in that band."""
        n = req.written // self.ps
        vpages = self.storage.table.page_table[req.row, :n]
        out = {}
        for b in self.token_bands:
            bound = vpages[b.ids.v2p[vpages] >= 0]
            if len(bound):
                out[b.index] = bound
        return out

    def _page_tokens(self, band_index: int, physical: np.ndarray, vpages: np.ndarray) -> tuple[torch.Tensor, _Tokens]:
        ps = self.ps
        off = np.tile(np.arange(ps, dtype=np.int64), len(physical))
        pages = np.repeat(physical, ps)
        vtok = np.repeat(vpages, ps) * ps + off
        want = self.expected[vtok].copy()
        empty = self._t(np.zeros(len(pages), dtype=np.int64))
        return self._t(pages), _Tokens(empty, empty, self._t(off), self._t(want, None), self._t(want != 0, None))

    def _transfer_reader(self, name: str, plan: list[tuple[int, torch.Tensor, _Tokens]]) -> Callable[[], None]:
        def read() -> None:
            for band_index, pages, tokens in plan:
                self._check_tokens(band_index, pages, tokens, lambda k: name)
        return read

    def op_backup(self, op: dict) -> str:
        req = self._pick([r for r in self._alive() if r.written >= self.ps], op["pick"])
        if req is None:
            return "none"
        self._job += 1
        name = f"backup{self._job}"
        plan, accesses, pages = [], [], {}
        for i, vpages in self._full_pages(req).items():
            band = self.chain.bands[i]
            physical = band.ids.v2p[vpages].copy()
            pages[band.name] = physical
            accesses.append(PageAccess(i, physical))
            plan.append((i, *self._page_tokens(i, physical, vpages)))
        device = self.device
        copy = device.stream(Device.COPY)
        self._after_schedule_and_forwards(copy)
        check = self._transfer_reader(name, plan)
        device.launch(copy, check, on_start=check, reads=accesses, label=name)
        done = device.record(copy, f"{name} done")
        transfer = self.storage.record_host_transfer(name, False, pages, done)
        self.jobs.append(Job("backup", name, req.rid, done, transfer))
        return f"{name} r{req.rid} {sum(len(p) for p in pages.values())} pages"

    def op_load(self, op: dict) -> str:
        """A host-tier load-back of a prefix into a fresh row: every token band takes the pages,
        fixed under load reservations (HIC-4); the tree binds them; the copy is recorded as a
        writer and the reservations end with no gap (HIC-8)."""
        storage, chain = self.storage, self.chain
        n = op["pages"]
        if not storage.table.free_rows or n > len(chain.virtual_free) or n * self.ps > self.config.context:
            return "none"
        demand = [n if b.pool.kind is not PoolKind.STATE else 0 for b in chain.bands]
        if not chain.units_fit(demand):
            return "refused"
        chain.ensure_capacity(demand)  # the load-back's takes are laid out together (PP-13)
        row = storage.alloc_row()
        taken: list[tuple[object, np.ndarray, PageUse]] = []
        for b in self.token_bands:
            pages, reservation = storage.alloc_load(b.name, n)
            taken.append((b, pages, reservation))
        vpages = chain.virtual_free.pop(n)
        for b, pages, _res in taken:
            b.bind(vpages, pages)
        storage.table.page_table[row, :n] = vpages
        storage.table.seq_lens[row] = n * self.ps
        values = self._fresh(n * self.ps)
        vtok = self._tokens_of(row, 0, n * self.ps)
        self.expected[vtok] = values
        self._job += 1
        name = f"load{self._job}"
        device = self.device
        copy = device.stream(Device.COPY)
        self._after_schedule_and_forwards(copy)
        targets = [(b.index, self._t(np.repeat(p, self.ps)), self._t(np.tile(np.arange(self.ps), n))) for b, p, _ in taken]
        vals = self._t(values, None)
        ps = self.ps

        def write() -> None:
            for i, pages, offs in targets:
                for comp in self.comps[i]:
                    comp[pages, offs] = vals.view(-1, *([1] * (comp.dim() - 2))).expand(len(pages), *comp.shape[2:])

        device.launch(copy, write, writes=[PageAccess(b.index, p) for b, p, _ in taken], label=name)
        done = device.record(copy, f"{name} done")
        transfer = storage.record_host_transfer(name, True, {b.name: p for b, p, _ in taken}, done)
        for b, _pages, reservation in taken:
            storage.end_load_reservations(b.name, reservation)
        req = self._new_req(row, written=n * ps, status=LOADING)
        self.jobs.append(Job("load", name, req.rid, done, transfer))
        return f"{name} r{req.rid} {n} pages"

    def op_end_copy(self, op: dict) -> str:
        job = self._pick([j for j in self.jobs if j.kind in ("backup", "load")], op["pick"])
        if job is None:
            return "none"
        self._end_copy(job)
        return f"ended {job.name}"

    def _end_copy(self, job: Job) -> None:
        self.device.host_wait(job.done)
        self.storage.end_host_transfer(job.transfer)
        self.jobs.remove(job)
        req = self.reqs.get(job.rid)
        if job.kind == "load" and req is not None:
            req.status = READY

    # -- PD --------------------------------------------------------------------------------------------

    def _transfer_id(self) -> int:
        """Transfer ids from the rank's own counter: ids are logged, and both ranks live in one process."""
        self._job += 1
        return self._job

    def op_send(self, op: dict) -> str:
        table = self.storage.table
        req = self._pick([r for r in self._alive() if r.written >= self.ps], op["pick"])
        if req is None:
            return "none"
        tid = self._transfer_id()
        name = f"send{tid}"
        plan, accesses, pages = [], [], {}
        for i, vpages in self._full_pages(req).items():
            band = self.chain.bands[i]
            physical = band.ids.v2p[vpages].copy()
            pages[band.name] = physical
            accesses.append(PageAccess(i, physical))
            plan.append((i, *self._page_tokens(i, physical, vpages)))
        vslot = table.state_slot[req.row]
        slot_check = None
        if vslot != NO_SLOT and self.expected_slot[vslot] != 0:
            pslot = self.state_band.ids.v2p[vslot]
            pages[self.state_band.name] = np.array([pslot])
            accesses.append(PageAccess(self.state_band.index, np.array([pslot])))
            slot_check = (self._t(np.array([pslot])), float(self.expected_slot[vslot]))
        device = self.device
        net = device.stream("network")
        self._after_schedule_and_forwards(net)
        check_pages = self._transfer_reader(name, plan)

        def read() -> None:
            check_pages()
            if slot_check is not None:
                got = self.comps[self.state_band.index][0][slot_check[0]].reshape(-1)
                self._report((got != slot_check[1]).any().to(torch.int64),
                             lambda: f"{name} reads state slot {int(slot_check[0][0])}: {float(got[0]):g}, "
                                     f"want {slot_check[1]:g}")

        device.launch(net, read, on_start=read, reads=accesses, label=name)
        done = device.record(net, f"{name} done")
        transfer = NetworkTransfer(name, sends=True, done=done, id=tid)
        self.storage.record_network_transfer(transfer, pages)
        req.status = SENDING
        self.jobs.append(Job("send", name, req.rid, done, transfer))
        return f"{name} r{req.rid}"

    def op_end_send(self, op: dict) -> str:
        job = self._pick([j for j in self.jobs if j.kind == "send"], op["pick"])
        if job is None:
            return "none"
        self._end_network(job)
        return f"ended {job.name}"

    def _end_network(self, job: Job) -> None:
        self.device.host_wait(job.done)
        self.storage.end_network_transfer(job.transfer)
        self.jobs.remove(job)
        req = self.reqs.get(job.rid)
        if req is not None and req.status in (SENDING, RECEIVING):
            req.status = READY

    def op_recv(self, op: dict) -> str:
        """A decode node takes a request's receive rows and holds them until publication (PD-8)."""
        storage = self.storage
        if not storage.table.free_rows:
            return "no row"
        row = storage.alloc_row()
        length = min(op["len"], self.config.context)
        before = self._fingerprint()
        try:
            storage.alloc_extend(np.array([row]), np.array([length]))
        except CapacityError:
            storage.table.free_row(row)
            return self._refused(before, "receive take")
        tid = self._transfer_id()
        hold = storage.hold_receive_rows(f"recv{tid}", self._receive_pages(row, length))
        req = self._new_req(row, status=HELD, hold=hold)
        self.jobs.append(Job("recv", f"recv{tid}", req.rid, length=length))
        return f"recv{tid} r{req.rid}"

    def _receive_pages(self, row: int, length: int) -> dict[str, np.ndarray]:
        vpages = self.storage.table.page_table[row, : -(-length // self.ps)]
        pages = {b.name: b.ids.v2p[vpages].copy() for b in self.token_bands}
        pages[self.state_band.name] = np.array([self.state_band.ids.v2p[self.storage.table.state_slot[row]]])
        return pages

    def op_publish(self, op: dict) -> str:
        jobs = [j for j in self.jobs if j.kind == "recv" and j.done is None]
        job = self._pick(jobs, op["pick"])
        if job is None:
            return "none"
        self._publish([job])
        return f"published {job.name}"

    def _publish(self, jobs: list[Job]) -> None:
        """Publication reads the ids back (a host read: before any wait of this step, HARN-9,
        re-read after any move, PD-17/18); the peer then writes the pages from the network."""
        storage, device = self.storage, self.device
        ready = []
        for job in jobs:
            req = self.reqs.get(job.rid)
            self.reads.host_read(f"{job.name}'s page ids for publication")
            if req is None:  # freed before publication: the hold went with it
                self.jobs.remove(job)
                continue
            pages = self._receive_pages(req.row, job.length)
            storage.published(req.hold)
            ready.append((job, req, pages))
        net = device.stream("network")
        for job, req, pages in ready:
            device.stream_wait(net, device.record(device.schedule_stream, "schedule"))
            ps = self.ps
            values = self._fresh(job.length)
            vtok = self._tokens_of(req.row, 0, job.length)
            self.expected[vtok] = values
            vslot = storage.table.state_slot[req.row]
            slot_value = self._fresh(1)
            self.expected_slot[vslot] = slot_value[0]
            pos = np.arange(job.length)
            targets = []
            for b in self.token_bands:
                phys = pages[b.name][pos // ps]
                targets.append((b.index, self._t(phys), self._t(pos % ps)))
            vals = self._t(values, None)
            slot_t = self._t(pages[self.state_band.name])
            slot_v = self._t(slot_value, None)

            def write(targets=targets, vals=vals, slot_t=slot_t, slot_v=slot_v) -> None:
                for i, phys, offs in targets:
                    for comp in self.comps[i]:
                        comp[phys, offs] = vals.view(-1, *([1] * (comp.dim() - 2))).expand(len(phys), *comp.shape[2:])
                comp = self.comps[self.state_band.index][0]
                comp[slot_t] = slot_v.view(-1, 1).expand(1, *comp.shape[1:])

            accesses = [PageAccess(self.chain.bands[self.plan.by_name(name).index].index, p) for name, p in pages.items()]
            device.launch(net, write, writes=accesses, label=f"{job.name}:write")
            job.done = device.record(net, f"{job.name} done")
            job.transfer = NetworkTransfer(job.name, sends=False, done=job.done, id=int(job.name[4:]))
            storage.record_network_transfer(job.transfer, pages)
            req.status = RECEIVING
            req.written = job.length

    def op_end_recv(self, op: dict) -> str:
        job = self._pick([j for j in self.jobs if j.kind == "recv" and j.done is not None], op["pick"])
        if job is None:
            return "none"
        self._end_network(job)
        return f"ended {job.name}"

    # -- quiescence --------------------------------------------------------------------------------

    def op_quiesce(self, op: dict) -> str:
        """Drain everything (process every forward, publish and end every transfer, end every copy,
        synchronize), then check that every live page holds its last write (HARN-6) and that the
        ledger keeps nothing (HARN-12)."""
        while self.in_flight:
            self._process()
        self._publish([j for j in self.jobs if j.kind == "recv" and j.done is None])
        for job in list(self.jobs):
            if job.kind in ("send", "recv"):
                self._end_network(job)
            else:
                self._end_copy(job)
        self.device.synchronize()
        self._check_resident()
        stale = sum(int(c) for c in self.bad.values())
        if stale:
            self._find(checks.LOST_WRITE, f"{stale} tokens read stale bytes on the device")
            for c in self.bad.values():
                c.zero_()
        tracking = sum(len(s) for s in self.tracking)
        for problem in checks.ledger_problems(self.storage, {self.state_band.name: tracking}):
            self._find(checks.LEDGER_LEAK, problem)
        return "quiet"

    def _check_resident(self) -> None:
        """At quiescence every live virtual page of every request holds its last write."""
        live = [r for r in self.reqs.values() if r.written]
        if not live:
            return
        tokens, _cols = self._read_tokens(live)
        rows = np.array([r.row for r in live])
        for b in self.token_bands:
            table = b.translate(self.storage.table.page_table[rows])
            pages = self._t(table)[tokens.rows, tokens.cols]
            self._check_tokens(b.index, pages, tokens, lambda k: f"at quiescence r{live[int(tokens.rows[k])].rid}")
        vslots = self.storage.table.state_slot[rows]
        has = vslots != NO_SLOT
        if not has.any():
            return
        want = self.expected_slot[vslots[has]]
        got = self.comps[self.state_band.index][0][self._t(self.state_band.ids.v2p[vslots[has]])].reshape(int(has.sum()), -1)
        bad = (got.cpu().numpy() != want[:, None]).any(axis=1) & (want != 0)
        if bad.any():
            self._find(checks.LOST_WRITE, f"at quiescence state slots {vslots[has][bad][:4].tolist()} lost their last write")


# ----------------------------------------------------------------------------------- running a case

#: the implicit last operation of every run
FINAL = {"op": "quiesce"}


@dataclass(frozen=True)
class Failure:
    """The first operation after which a check failed (`op == len(ops)`: the final quiescence)."""

    op: int
    findings: tuple[Finding, ...]

    @property
    def checks(self) -> tuple[str, ...]:
        seen = {f.check for f in self.findings}
        return tuple(c for c in checks.ALL_CHECKS if c in seen)

    @property
    def check(self) -> str:
        return self.checks[0]

    def to_json(self) -> dict:
        return {"op": self.op, "checks": list(self.checks), "findings": [f.to_json() for f in self.findings]}

    def describe(self) -> str:
        first = self.findings[0]
        rank = "" if first.rank is None else f" rank {first.rank}"
        return f"{'/'.join(self.checks)} after op {self.op}{rank}: {first.message}"


@dataclass
class RunResult:
    failure: Failure | None
    ops_run: int
    seconds: float
    stats: dict = field(default_factory=dict)


@dataclass
class Case:
    """A sequence and everything its run depends on: JSON, so it can be saved and replayed."""

    config: HarnessConfig
    ops: list[dict]
    mutant: str | None = None
    failure: dict | None = None
    description: str = ""

    def to_json(self) -> dict:
        out = {"version": FORMAT_VERSION, "kind": "stress-case"}
        if self.description:
            out["description"] = self.description
        out.update({"config": self.config.to_json(), "mutant": self.mutant, "failure": self.failure, "ops": self.ops})
        return out

    @classmethod
    def from_json(cls, data: dict) -> Case:
        if data.get("version") != FORMAT_VERSION or data.get("kind", "stress-case") != "stress-case":
            raise InputError(f"not a stress case of format {FORMAT_VERSION}")
        # a "workarounds" key (cases saved while the harness offered known-bug workarounds) is ignored
        return cls(HarnessConfig.from_json(data["config"]), list(data["ops"]), data.get("mutant"), data.get("failure"),
                   data.get("description", ""))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Case:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"cannot read stress case {path}: {e}") from None


def seed_case(seed: int, n_ops: int) -> Case:
    config = config_for_seed(seed)
    return Case(config, generate_ops(seed, n_ops, config))


def run_case(case: Case, device: str = "modeled", on_op: Callable[[int], None] | None = None,
             until: str | None = None, ranks: Sequence[int] = (0, 1)) -> RunResult:
    """Run a case's operations on two ranks, checking after every one (HARN-5); stop at the first
    failure, or with `until`, at the first failure of that check (other checks' findings before it
    are kept in `RunResult.stats["seen"]`). The mutant, if any, must already be applied
    (`mutants.applied`)."""
    start = time.perf_counter()
    made = [Rank(case.config, r, device) for r in ranks]
    try:
        return _run(case, made, start, on_op, until)
    finally:
        for rank in made:
            rank.close()


def _run(case: Case, ranks: list[Rank], start: float, on_op: Callable[[int], None] | None,
         until: str | None) -> RunResult:
    ops = [*case.ops, FINAL]
    seen: dict[str, int] = {}
    for i, op in enumerate(ops):
        outcomes = [rank.step(op) for rank in ranks]
        findings = [f for rank in ranks for f in rank.take_findings()]
        logs = [rank.take_decisions() for rank in ranks]
        if len(ranks) == 2:
            diff = checks.divergence(*logs)
            if diff is not None:
                findings.append(Finding(checks.RANK_DIVERGENCE, f"{op['op']}: decisions differ: {diff}"))
            elif outcomes[0] != outcomes[1]:
                findings.append(Finding(checks.RANK_DIVERGENCE,
                                        f"{op['op']}: rank 0 {outcomes[0]!r}, rank 1 {outcomes[1]!r}"))
        if on_op is not None:
            on_op(1)
        if findings and (until is None or any(f.check == until for f in findings)):
            return RunResult(Failure(i, tuple(findings)), i + 1, time.perf_counter() - start, {"seen": seen})
        for f in findings:
            seen.setdefault(f.check, i)
    stats = {"moves": sum(b.stats["moves"] for b in ranks[0].chain.bands), "seen": seen}
    return RunResult(None, len(ops), time.perf_counter() - start, stats)


# ----------------------------------------------------------------------------------- shrinking


def fails_with(case: Case, check: str, device: str = "modeled", until: str | None = None,
               ranks: Sequence[int] = (0, 1)) -> Callable[[list[dict]], bool]:
    def predicate(ops: list[dict]) -> bool:
        result = run_case(Case(case.config, ops, case.mutant), device, until=until, ranks=ranks)
        return result.failure is not None and check in result.failure.checks
    return predicate


def ddmin(items: list, fails: Callable[[list], bool]) -> list:
    """Delta debugging (Zeller's ddmin): a 1-minimal failing subsequence of a failing `items`
    (HARN-13): removing any single item makes `fails` false."""
    n = 2
    while len(items) >= 2:
        chunk = -(-len(items) // n)
        subsets = [items[i : i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for k in range(len(subsets)):
            complement = [x for j, s in enumerate(subsets) if j != k for x in s]
            if fails(complement):
                items, n, reduced = complement, max(n - 1, 2), True
                break
        if not reduced:
            for subset in subsets:
                if len(subset) < len(items) and fails(subset):
                    items, n, reduced = subset, 2, True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def minimize(case: Case, failure: Failure, device: str = "modeled", check: str | None = None,
             until: str | None = None) -> Case:
    """Shrink a failing case to a 1-minimal one that fails the same check (`check`, by default
    the failure's first); its operations after the failing one are dropped first."""
    check = check or failure.check
    ops = case.ops[: failure.op + 1]
    # a check one rank saw alone shrinks on that rank only (half the work); divergence needs both
    seen = {f.rank for f in failure.findings if f.check == check}
    ranks: tuple[int, ...] = (0, 1)
    if check != checks.RANK_DIVERGENCE and seen and None not in seen:
        ranks = (min(seen),)  # type: ignore[assignment, type-var]
    fails = fails_with(case, check, device, until, ranks)
    if not fails(ops):  # the last operations only fail together with the final quiescence: keep them
        ops = case.ops
    if not fails(ops):
        ranks = (0, 1)
        fails = fails_with(case, check, device, until, ranks)
    ops = ddmin(ops, fails)
    if ranks != (0, 1) and not fails_with(case, check, device, until)(ops):
        ops = ddmin(ops, fails_with(case, check, device, until))  # both ranks together differ: redo
    small = Case(case.config, ops, case.mutant)
    result = run_case(small, device, until=until)
    small.failure = result.failure.to_json() if result.failure is not None else None
    return small
