"""A stress rank's maintenance operations (`MaintenanceOps`): flushes, device time, reliefs that
compact an end or relocate a float, state copies and state-slot takes."""

from __future__ import annotations

import numpy as np

from ..alloc.pricing import Step, first_plan
from ..errors import CapacityError
from ..plan import PoolKind
from ..requests import NO_SLOT


class MaintenanceOps:
    """`Rank`'s flushes, ticks, reliefs, compactions, relayouts, state copies and state-slot takes.
    A mixin: it works on the rank's storage, chain and expectations."""

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
