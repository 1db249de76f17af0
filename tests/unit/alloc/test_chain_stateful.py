"""Stateful property tests of the chain allocator over random take/free/flush/relief sequences on
small arenas with several page sizes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchain.alloc.pricing import Step, plan
from kvchain.errors import CapacityError
from support.chains import Payloads, allocator_state, same_state, small_storage


class ChainMachine(RuleBasedStateMachine):
    """Byte accounting exact after every step (CHK-15); a refused take changes nothing (ALLOC-7);
    `units_fit` and `ensure_capacity` answer exactly what the take does (CAP-11); bytes written
    through the views survive every move (COMP-16, IDS-7)."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        chain_kib=st.integers(6, 24),
        windows=st.sampled_from([(32, 8), (16,), (), (24, 12)]),
        state=st.booleans(),
        heads=st.sampled_from([(1, 2, 1), (2, 1, 3), (1, 1, 1)]),
    )
    def setup(self, page_size, chain_kib, windows, state, heads):
        self.storage = small_storage(page_size=page_size, chain_kib=chain_kib, windows=windows,
                                     state=state, heads=heads, context=96, rows=8)
        self.payloads = Payloads(self.storage)
        self.rows: list[int] = []

    def _grow(self, rows, new_lens):
        before = allocator_state(self.storage)
        try:
            vtok = self.storage.alloc_extend(np.array(rows), np.array(new_lens))
        except CapacityError:
            assert same_state(before, allocator_state(self.storage)), "a refused take changed state"
            return False
        self.payloads.write_tokens(np.array(rows), vtok)
        self.payloads.write_slots(np.array(rows))
        return True

    @precondition(lambda self: self.storage.table.free_rows > 0)
    @rule(prompt=st.integers(1, 40))
    def admit(self, prompt):
        row = self.storage.alloc_row()
        if self._grow([row], [prompt]):
            self.rows.append(row)
        else:
            self.storage.table.free_row(row)

    @precondition(lambda self: self.rows)
    @rule()
    def decode_all(self):
        lens = self.storage.table.seq_lens[self.rows]
        ok = lens < self.storage.table.context_len
        rows = [r for r, k in zip(self.rows, ok) if k]
        if rows:
            self._grow(rows, list(self.storage.table.seq_lens[rows] + 1))

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), extra=st.integers(1, 16))
    def extend_one(self, data, extra):
        row = data.draw(st.sampled_from(self.rows))
        new = min(self.storage.table.context_len, int(self.storage.table.seq_lens[row]) + extra)
        self._grow([row], [new])

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def extend_many(self, data):
        """One take for several rows growing by different amounts, some not at all."""
        table = self.storage.table
        rows = data.draw(st.lists(st.sampled_from(self.rows), min_size=1, unique=True))
        extra = data.draw(st.lists(st.integers(0, 9), min_size=len(rows), max_size=len(rows)))
        self._grow(rows, [min(table.context_len, int(table.seq_lens[r]) + e) for r, e in zip(rows, extra)])

    @precondition(lambda self: self.rows)
    @rule()
    def advance_all(self):
        """Window retirement frees rows that left each window (WIN-1); they then read the sink."""
        self.storage.advance(np.array(self.rows))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def finish(self, data):
        row = data.draw(st.sampled_from(self.rows))
        self.rows.remove(row)
        self.storage.free_rows(np.array([row]))

    @rule(max_moves=st.sampled_from([1, 3, None]))
    def flush(self, max_moves):
        self.storage.allocator.flush_opportunistic(max_moves=max_moves if max_moves else 10**9)

    @rule(data=st.data())
    def probe_capacity(self, data):
        chain = self.storage.allocator
        demand = [data.draw(st.integers(0, 6)) for _ in chain.bands]
        fits = chain.units_fit(demand)
        clone = copy.deepcopy(self.storage)
        try:
            clone.allocator.take(demand)
            took = True
        except CapacityError:
            took = False
        assert fits == took, f"units_fit said {fits} but the take {'succeeded' if took else 'failed'} for {demand}"
        clone = copy.deepcopy(self.storage)
        if clone.allocator.ensure_capacity(demand):
            clone.allocator.take(demand)  # must not raise
        else:
            assert not fits

    @rule(data=st.data())
    def band_take(self, data):
        """A single band's take on a copy: it either succeeds or is refused with nothing changed
        (ALLOC-7), and it succeeds exactly when pricing says a lone take fits in place."""
        clone = copy.deepcopy(self.storage)
        chain = clone.allocator
        band = chain.bands[data.draw(st.integers(0, len(chain.bands) - 1))]
        demand = [0] * len(chain.bands)

        def fits_in_place(k: int) -> bool:
            demand[band.index] = k
            return plan(chain.snapshot(), demand, Step.NO_MOVE) is not None

        most = 0
        while fits_in_place(most + 1):
            most += 1
        n = max(1, most + data.draw(st.integers(-2, 2)))
        in_place = fits_in_place(n)
        before = allocator_state(clone)
        try:
            chain.take_from(band, n)
            assert in_place, "a band took pages that pricing said do not fit in place"
        except CapacityError:
            assert not in_place, "pricing said the take fits in place but the band refused it"
            assert same_state(before, allocator_state(clone)), "a refused band take changed state"

    @rule(data=st.data())
    def relieve(self, data):
        """Relief for a random demand on the real pool (moves pages); data must survive."""
        chain = self.storage.allocator
        demand = [data.draw(st.integers(0, 8)) for _ in chain.bands]
        before = allocator_state(self.storage)
        if not chain.ensure_capacity(demand):
            assert same_state(before, allocator_state(self.storage)), "a refused relief changed state"

    @invariant()
    def accounting(self):
        if not hasattr(self, "storage"):
            return
        self.storage.check_idle()
        self.payloads.check()


TestChainMachine = ChainMachine.TestCase
TestChainMachine.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.sweep
def test_chain_machine_long():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(ChainMachine, settings=settings(max_examples=2000, stateful_step_count=80,
                                                              deadline=None))
