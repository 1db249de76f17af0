"""A stress rank's host tier (`HostTierOps`): backups and load-backs on the copy stream, and the
transfer helpers the PD engine shares (ordering after the schedule and forwards, page reads)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..alloc.page_usage import PageUse
from ..device.base import Device, PageAccess, Stream
from ..plan import PoolKind
from .harness_records import LOADING, READY, Job, Req, _Tokens


class HostTierOps:
    """`Rank`'s host tier: backups, load-backs and their ends, and the transfer helpers. A mixin: it
    works on the rank's storage, device and expectations."""

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
        plan, accesses, pages, spans = [], [], {}, []
        for i, vpages in self._full_pages(req).items():
            band = self.chain.bands[i]
            physical = band.ids.v2p[vpages].copy()
            pages[band.name] = physical
            accesses.append(PageAccess(i, physical))
            plan.append((i, *self._page_tokens(i, physical, vpages)))
            spans.append((i, physical, vpages))
        device = self.device
        copy = device.stream(Device.COPY)
        self._after_schedule_and_forwards(copy)
        check = self._transfer_reader(name, plan)
        body = self._backup_body(name, check, spans)  # the copy into the host pools (`harness_hostpool`)
        device.launch(copy, body, on_start=check, reads=accesses, label=name)
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

        loaded = self._load_body(name, [(b.index, p) for b, p, _ in taken], values)  # from the host pools
        if loaded is not None:
            write, values = loaded
            self.expected[vtok] = values
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
        self._host_copy_ended(job)
        self.storage.end_host_transfer(job.transfer)
        self.jobs.remove(job)
        req = self.reqs.get(job.rid)
        if job.kind == "load" and req is not None:
            req.status = READY
