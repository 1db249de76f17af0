"""A stress rank's real host pools (`HostPoolOps`): a backup copies its pages into host pages of the
rank's `HostPools` on the copy stream, and once it ends the host bytes are compared with the values
the pages held (`lost_write` when they differ); a load copies host pages onto its device pages,
either a finished backup's (the bytes come back: the payload checks then read them on the device)
or host pages staged with fresh values. The copies run inside the launches the host-tier operations
already order and record, so the ledger covers every byte they touch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.hicache import copy_pages
from ..layout.views import SubPoolView
from ..memory.host import HostPools
from . import checks

#: host pages per token sub-pool a rank's host pools hold (state slots: a quarter of that)
HOST_PAGES = 48


@dataclass
class HostCopy:
    """A backup's host pages per band index, and the values their tokens held (by owner page)."""

    pages: dict[int, np.ndarray]  # band index -> host page ids, aligned with `vpages[band]`
    vpages: dict[int, np.ndarray]
    values: dict[int, np.ndarray]  # band index -> [n, page_size] wanted values (0: unwritten)
    ended: bool = False
    readers: int = 0  # loads not ended yet that read these host pages: they are not reused before


class HostPoolOps:
    """`Rank`'s host pools. A mixin: it works on the rank's storage, device and expectations."""

    _host: HostPools | None = None

    def _host_pools(self) -> HostPools:
        if self._host is None:
            plan = self.plan
            group = sum(max(p.page_bytes, 1) for p in plan.sub_pools if p.is_attention) * 4 + plan.state.page_bytes
            self._host = HostPools(plan, group * HOST_PAGES // 4, pages_per_state=4, pin=None)
            self._host_comps = {b.index: self._host_components(b.pool) for b in self.chain.bands}
            self._host_copies: dict[str, HostCopy] = {}
            self._kept: list[str] = []  # ended backups (and staged pages) a load may read, oldest first
            self._load_origin: dict[str, str] = {}  # load -> the host copy it reads
            self.host_stats = {"backups": 0, "checked_pages": 0, "loads_from_backups": 0, "loads_staged": 0}
        return self._host

    def _host_components(self, pool) -> list[torch.Tensor]:
        view = SubPoolView(pool, self._host.pages(pool.name))
        return [view.tensor(c.layer_id, c.name) for c in pool.envelope.components]

    def _host_alloc(self, counts: dict[int, int]) -> dict[int, np.ndarray] | None:
        """Host pages per band index, dropping the oldest kept backups until they fit; None when
        they cannot."""
        host = self._host_pools()
        while True:
            need: dict[int, list] = {}
            for i, n in counts.items():
                pool = host.pool(self.chain.bands[i].name)
                need.setdefault(id(pool), [pool, 0])[1] += n
            if all(pool.n_free >= n for pool, n in need.values()):
                return {i: host.pool(self.chain.bands[i].name).alloc(n) for i, n in counts.items()}
            free = [k for k in self._kept if not self._host_copies[k].readers]
            if not free:
                return None
            self._kept.remove(free[0])
            self._host_release(free[0])

    def _host_release(self, name: str) -> None:
        copy = self._host_copies.pop(name, None)
        if copy is None:
            return
        for i, ids in copy.pages.items():
            self._host.pool(self.chain.bands[i].name).free(ids)

    # -- backups -------------------------------------------------------------------------------------

    def _backup_body(self, name: str, check: Callable[[], None], spans: list[tuple[int, np.ndarray, np.ndarray]]
                     ) -> Callable[[], None]:
        """The backup's launched work: the reads it checks, then the copy into host pages."""
        host_ids = self._host_alloc({i: len(physical) for i, physical, _v in spans})
        if host_ids is None:
            return check
        ps = self.ps
        values = {i: self.expected[(np.repeat(v, ps) * ps + np.tile(np.arange(ps), len(v)))].reshape(len(v), ps).copy()
                  for i, _p, v in spans}
        self._host_copies[name] = HostCopy(host_ids, {i: v for i, _p, v in spans}, values)
        self.host_stats["backups"] += 1
        arena = self.storage.arena
        copies = [(self._host.pages(self.chain.bands[i].name), host_ids[i], arena.page_bytes_view(i), physical)
                  for i, physical, _v in spans]

        def run() -> None:
            check()
            for dst, dst_ids, src, src_ids in copies:
                copy_pages(dst, dst_ids, src, src_ids)

        return run

    def _host_copy_ended(self, job) -> None:
        """A copy ended (its finish waited). A backup's host bytes must hold the values its pages held;
        a load's host pages may be reused."""
        if self._host is None:
            return
        if job.kind == "load":
            origin = self._load_origin.pop(job.name, None)
            if origin is not None:
                self._host_copies[origin].readers -= 1
            return
        copy = self._host_copies.get(job.name)
        if copy is None or copy.ended:
            return
        copy.ended = True
        ps = self.ps
        for i, ids in copy.pages.items():
            want = torch.from_numpy(copy.values[i].reshape(-1))
            pages = torch.from_numpy(np.repeat(ids, ps))
            offs = torch.from_numpy(np.tile(np.arange(ps), len(ids)))
            for comp in self._host_comps[i]:
                got = comp[pages, offs].reshape(len(pages), -1).cpu()
                bad = (got != want.view(-1, 1)).any(dim=1) & (want != 0)
                if bad.any():
                    k = int(torch.nonzero(bad)[0])
                    self._find(checks.LOST_WRITE, f"{job.name}: host copy of {self.chain.bands[i].name} page "
                                                  f"{int(ids[k // ps])} offset {k % ps} holds {float(got[k, 0]):g}, "
                                                  f"want {float(want[k]):g} ({int(bad.sum())} tokens wrong)")
                    break
            self.host_stats["checked_pages"] += len(ids)
        self._kept.append(job.name)

    # -- loads ---------------------------------------------------------------------------------------

    def _load_source(self, bands: list[int], n: int) -> tuple[str, dict[int, np.ndarray], np.ndarray] | None:
        """An ended backup holding `n` pages common to every band: (its name, host ids per band, the
        values of their tokens)."""
        for name in reversed(self._kept):
            copy = self._host_copies[name]
            if not copy.vpages or set(copy.pages) != set(bands):
                continue
            common = copy.vpages[bands[0]]
            for i in bands[1:]:
                common = common[np.isin(common, copy.vpages[i])]
            if len(common) < n:
                continue
            pick = common[:n]
            ids = {i: copy.pages[i][_positions(copy.vpages[i], pick)] for i in bands}
            values = copy.values[bands[0]][_positions(copy.vpages[bands[0]], pick)].reshape(-1)
            return name, ids, values
        return None

    def _load_body(self, name: str, targets: list[tuple[int, np.ndarray]], values: np.ndarray
                   ) -> tuple[Callable[[], None], np.ndarray] | None:
        """The load's launched work: a host-to-device copy of a finished backup's pages (their
        values replace `values`) or of host pages staged with `values`. None when the host pools
        hold no room (the operation writes directly then)."""
        self._host_pools()
        bands = [i for i, _p in targets]
        n = len(targets[0][1])
        source = self._load_source(bands, n)
        if source is None:
            ids = self._host_alloc({i: n for i in bands})
            if ids is None:
                return None
            ps = self.ps
            pages = torch.from_numpy(np.repeat(np.arange(n), ps))
            offs = torch.from_numpy(np.tile(np.arange(ps), n))
            vals = torch.from_numpy(values)
            for i in bands:
                hp = torch.from_numpy(ids[i])[pages]
                for comp in self._host_comps[i]:
                    comp[hp, offs] = vals.view(-1, *([1] * (comp.dim() - 2))).expand(len(hp), *comp.shape[2:])
            staged = f"{name} staged"
            self._host_copies[staged] = HostCopy(ids, {}, {}, ended=True)
            self._kept.append(staged)  # its pages go back once a later copy needs the room
            source = (staged, ids, values)
        origin, ids, values = source
        self.host_stats["loads_staged" if origin.endswith(" staged") else "loads_from_backups"] += 1
        self._host_copies[origin].readers += 1
        self._load_origin[name] = origin
        arena = self.storage.arena
        copies = [(arena.page_bytes_view(i), physical, self._host.pages(self.chain.bands[i].name), ids[i])
                  for i, physical in targets]

        def run() -> None:
            for dst, dst_ids, src, src_ids in copies:
                copy_pages(dst, dst_ids, src, src_ids)

        return run, values.astype(np.float32)


def _positions(vpages: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """Where each of `pick` sits in `vpages` (every one is there)."""
    order = np.argsort(vpages)
    return order[np.searchsorted(vpages[order], pick)]


__all__ = ["HOST_PAGES", "HostCopy", "HostPoolOps"]
