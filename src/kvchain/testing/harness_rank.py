"""One simulated stress rank (`Rank`): a storage on its own device, and the scheduler, tree, host
tier and PD engine around it. Its operations by theme live in mixins: forwards and payload checks
(`harness_forwards`), maintenance and reliefs (`harness_maintenance`), the host tier
(`harness_host`) and the PD engine (`harness_pd`); requests, stepping and quiescence live here."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..device.base import Device
from ..engine.steps import StepSequence
from ..errors import CapacityError, InputError, InvariantError
from ..requests import NO_SLOT
from . import checks
from .checks import ByteShadow, Finding, Granules, HostReadTracker, OverlapTracker
from .harness_config import HarnessConfig, harness_storage
from .harness_device import HarnessDevice, cuda_device, thread_device
from .harness_forwards import DEPTH, ForwardOps
from .harness_host import HostTierOps
from .harness_hostpool import HostPoolOps
from .harness_maintenance import MaintenanceOps
from .harness_pd import PDOps
from .harness_records import READY, Job, Req


class Rank(ForwardOps, MaintenanceOps, HostTierOps, HostPoolOps, PDOps):
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
            self.device = thread_device(timing)
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
        #: launch, barrier and processing of forwards: the one step sequence (payload: the batch's rids)
        self.steps: StepSequence[list[int]] = StepSequence(storage, depth=DEPTH, war_barrier=config.war_barrier)
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
        chain.host_read_observers.append(self.reads.host_read)  # the recovery read-ahead (HARN-9)

    # -- plumbing ----------------------------------------------------------------------------------

    def _components(self, pool) -> list[torch.Tensor]:
        view = self.storage.view(pool.name)
        return [view.tensor(c.layer_id, c.name) for c in pool.envelope.components]

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
        host_op = getattr(self.device, "host_op", None)
        if host_op is not None:
            host_op()  # the threads device opens the forwards it held until this operation
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

    # -- quiescence --------------------------------------------------------------------------------

    def op_quiesce(self, op: dict) -> str:
        """Drain everything (process every forward, publish and end every transfer, end every copy,
        synchronize), then check that every live page holds its last write (HARN-6) and that the
        ledger keeps nothing (HARN-12)."""
        while self.steps.in_flight:
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
        for problem in checks.ledger_problems(self.storage, {self.state_band.name: tracking}, self.steps.check_idle):
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
