"""A stress rank's PD engine (`PDOps`): network sends, receive holds, publication and the peer's
writes, and the ends of those transfers."""

from __future__ import annotations

import numpy as np
import torch

from ..alloc.signals import NetworkTransfer
from ..device.base import PageAccess
from ..errors import CapacityError
from ..requests import NO_SLOT
from .harness_records import HELD, READY, RECEIVING, SENDING, Job


class PDOps:
    """`Rank`'s network transfers: sends, receives, publication and their ends. A mixin: it works on
    the rank's storage, device and expectations, and the host tier's transfer helpers."""

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
