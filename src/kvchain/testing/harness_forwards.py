"""A stress rank's forwards (`ForwardOps`): launch a batch that reads every byte its rows hold and
writes fresh values, process the oldest, and the payload checks every reader shares. Launching and
processing go through the rank's `engine.steps.StepSequence`; this module brings the forward's
kernels and what processing means to a rank."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..device.base import PageAccess
from ..engine.steps import Forward, Launched, MetadataUpload
from . import checks
from .checks import META_BAND
from .harness_records import Req, _Tokens

#: forwards left in flight after a launch: the overlap scheduler runs N+1 while processing N
DEPTH = 1
#: most forwards launched and not yet processed
MAX_IN_FLIGHT = DEPTH + 1


class ForwardOps:
    """`Rank`'s forwards and payload checks: launching, processing, and comparing the bytes a reader
    sees with what was last written. A mixin: it works on the rank's storage, device and expectations."""

    # -- forwards ---------------------------------------------------------------------------------

    def op_forward(self, op: dict) -> str:
        outcome = ""
        if len(self.steps.in_flight) >= MAX_IN_FLIGHT:
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
        upload = None
        if self.config.war_barrier:
            # forwards read their page tables from one persistent buffer (as CUDA-graph inputs are):
            # the write-after-read barrier keeps the next upload off a running forward's reads
            meta, meta_slots = self.meta, self.meta_slots
            src = {i: self._t(t) for i, t in tables.items()}
            slot_src = self._t(slots_now)

            def run_upload() -> None:
                for i, t in src.items():
                    if t.shape[1]:
                        meta[i][:n, : t.shape[1]] = t
                meta_slots[:n] = slot_src

            meta_rows = (PageAccess(META_BAND, np.arange(n)),)
            upload = MetadataUpload(run_upload, meta_rows)
            reads.append(meta_rows[0])
        else:
            meta = {i: self._t(t) if t.shape[1] else torch.zeros((n, 1), dtype=torch.int64, device=self.torch_device)
                    for i, t in tables.items()}
            meta_slots = self._t(slots_now)
        slot_want_t = self._t(slot_want, None)
        slot_need = self._t(slot_want != 0, None)
        rids = [r.rid for r in batch]
        rows_of = tokens.rows

        def read_phase(step: int) -> None:
            def where(k: int) -> str:
                return f"forward {step} (r{rids[int(rows_of[k])]})"

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

        forward = Forward.read_then_write(device, read_phase, write_phase, reads=reads, writes=written, ids=writes,
                                          upload=upload, read_at_start=True)
        self.steps.launch(forward, rids)
        for req in batch:
            req.written = int(storage.table.seq_lens[req.row])
            req.in_flight += 1

    def op_process(self, op: dict) -> str:
        return self._process(bool(op.get("advance", 1))) if self.steps.in_flight else "none"

    def _process(self, advance: bool = True) -> str:
        """Process the oldest forward (LIFE-23); with `advance`, retire its rows' window pages (WIN-1)."""
        retired = 0

        def handle(fwd: Launched[list[int]]) -> None:
            nonlocal retired
            alive = [self.reqs[rid] for rid in fwd.payload if rid in self.reqs]
            for req in alive:
                req.in_flight -= 1
            if advance and alive:
                retired = self.storage.advance(np.array([r.row for r in alive], dtype=np.int64))

        fwd = self.steps.process_oldest(handle)
        return f"processed {fwd.step} retired {retired}"
