"""Relief and compaction on a real arena: the layout the plan promises is the layout realized, and
every byte written through the views reads back the same through the same virtual ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain.alloc.band import PENDING
from kvchain.alloc.pricing import BandSnap, Relocation, Step, feasible, move_order
from kvchain.engine import StepSequence
from kvchain.errors import CapacityError
from kvchain.plan import Placement
from support.chains import Payloads, small_storage
from support.modeled import launch_forward, modeled_storage, process, request


def _fill(storage, lens):
    payloads = Payloads(storage)
    rows = [storage.alloc_row() for _ in lens]
    vtok = storage.alloc_extend(np.array(rows), np.array(lens))
    payloads.write_tokens(np.array(rows), vtok)
    payloads.write_slots(np.array(rows))
    return rows, payloads


def test_flush_moves_pages_and_keeps_their_bytes():
    """COMP-16, COMP-8: an urgent flush packs the end and the moved pages keep their data."""
    storage = small_storage(page_size=2, chain_kib=32)
    rows, payloads = _fill(storage, [12, 12, 12, 12])
    storage.free_rows(np.array(rows[:3:2]))
    owner = storage.allocator.owner
    span_before = owner.span
    moved = storage.allocator.relief_flush(owner)
    assert moved > 0 and owner.n_holes == 0 and owner.span == owner.n_live < span_before
    payloads.check()
    storage.check_idle()


def test_opportunistic_flush_is_capped():
    """COMP-7: a band flush makes at most the moves it is given."""
    storage = small_storage(page_size=1, chain_kib=32)
    rows, payloads = _fill(storage, [20] * 4)
    owner = storage.allocator.owner
    # free the request whose pages lie nearest the band's base (the top of the arena)
    nearest_base = max(rows, key=lambda r: owner.ids.v2p[storage.table.pages_of(r)].max())
    storage.free_rows(np.array([nearest_base]))
    assert storage.allocator.flush(owner, max_moves=3) == 3
    payloads.check()
    storage.check_idle()


@pytest.mark.parametrize("entry", ["storage", "step_sequence"])
def test_opportunistic_flush_reads_its_cap_from_the_environment(monkeypatch, entry):
    """COMP-7: with no cap given, `flush_opportunistic` (from the storage, or from the engine's step
    sequence between steps) makes at most `KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL` moves per
    band, though more pages could move; a second call moves the next ones."""
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL", "2")
    monkeypatch.setenv("KVCHAIN_LAZY_COMPACTION_GAP_FRACTION", "1.0")  # every end counts as pressed
    storage = small_storage(page_size=1, chain_kib=32)
    rows, payloads = _fill(storage, [20] * 4)
    chain = storage.allocator
    owner = chain.owner
    nearest_base = max(rows, key=lambda r: owner.ids.v2p[storage.table.pages_of(r)].max())
    storage.free_rows(np.array([nearest_base]))
    flush = storage.flush_opportunistic if entry == "storage" else StepSequence(storage).flush
    for _ in range(2):
        before = [b.stats["moves"] for b in chain.bands]
        moved = flush()
        per_band = [b.stats["moves"] - m for b, m in zip(chain.bands, before)]
        assert max(per_band) <= 2 and per_band[owner.index] == 2 and moved == sum(per_band)
        assert owner.n_holes >= 2  # room for more moves was left
    payloads.check()
    storage.check_idle()


def test_floats_never_compact_they_only_give_back_boundary_holes():
    """COMP-21, COMP-22."""
    storage = small_storage(page_size=2, chain_kib=32)
    rows, payloads = _fill(storage, [10, 10, 10])
    window = storage.allocator.window_bands[0]
    live_before = window.live_pages().copy()
    storage.free_rows(np.array([rows[1]]))
    assert storage.allocator.flush(window, max_moves=100) == 0
    assert set(window.live_pages()) <= set(live_before)
    payloads.check()


def _churn_until(storage, steps, wanted, seed=0):
    """Random admissions, growth and finishes; returns the rearrangement steps relief realized."""
    chain = storage.allocator
    seen = []
    realize = chain.realize

    def record(layout, hold_network=False):
        seen.append(layout.step)
        realize(layout, hold_network)

    chain.realize = record
    rng = np.random.default_rng(seed)
    payloads = Payloads(storage)
    rows = [r for r in range(1, storage.table.rows) if storage.table.active[r]]
    for _ in range(steps):
        action = rng.integers(3)
        try:
            if action == 0 and storage.table.free_rows:
                row = storage.alloc_row()
                try:
                    vtok = storage.alloc_extend(np.array([row]), np.array([int(rng.integers(2, 40))]))
                except CapacityError:
                    storage.table.free_row(row)
                    continue
                payloads.write_tokens(np.array([row]), vtok)
                payloads.write_slots(np.array([row]))
                rows.append(row)
            elif action == 1 and rows:
                row = rows[int(rng.integers(len(rows)))]
                new = min(storage.table.context_len, int(storage.table.seq_lens[row]) + int(rng.integers(1, 24)))
                vtok = storage.alloc_extend(np.array([row]), np.array([new]))
                payloads.write_tokens(np.array([row]), vtok)
            elif rows:
                row = rows.pop(int(rng.integers(len(rows))))
                storage.free_rows(np.array([row]))
        except CapacityError:
            pass
        payloads.check()
        storage.check_idle()
        if wanted in seen:
            break
    chain.realize = realize
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_relayout_relocates_floats_and_data_survives(seed):
    """ALLOC-16/17/18 with data: relief relocates floats between the compacted ends, and every byte
    reads back the same through the same virtual ids afterwards."""
    storage = small_storage(page_size=2, chain_kib=10, windows=(48, 16), state=True, rows=32, context=128)
    seen = _churn_until(storage, 3000, Step.RELAYOUT, seed)
    assert Step.RELAYOUT in seen


def test_flush_ends_relief_and_data_survives():
    storage = small_storage(page_size=1, chain_kib=10, windows=(48,), state=True, rows=32, context=128)
    seen = []
    for seed in range(12):
        seen += _churn_until(storage, 1500, Step.FLUSH_ENDS, seed)
        if Step.FLUSH_ENDS in seen:
            break
    assert Step.FLUSH_ENDS in seen


def test_refused_take_changes_nothing_and_says_why():
    """ALLOC-10, ALLOC-7: no layout serves the take, so it is refused before any pending page is
    settled: the pages freed under the running forward stay pending, no stream wait is queued,
    and the allocator's state is as it was."""
    storage, dev = modeled_storage(chain_kib=8)
    chain = storage.allocator
    owner = chain.owner
    row, _ = request(storage, 8)
    forward = launch_forward(storage, None, np.empty(0, dtype=np.int64))
    storage.free_rows(np.array([row]))
    assert owner.n_pending > 0
    pending = np.flatnonzero(owner.state == PENDING)
    before, waits = chain.snapshot(), dev.counters.stream_waits
    with pytest.raises(CapacityError, match="no layout"):
        chain.take([10**6] * len(chain.bands))
    assert chain.snapshot() == before
    assert (owner.state[pending] == PENDING).all() and owner.n_pending == len(pending)
    assert dev.counters.stream_waits == waits
    process(storage, forward)


def _lone_shortfall(chain, band):
    """The fewest pages `band` alone cannot take where it is, though some layout serves them."""
    for n in range(1, band.grid.n_grid):
        demand = [0] * len(chain.bands)
        demand[band.index] = n
        if not chain.in_place(demand) and feasible(chain.pricing_snapshot(), tuple(demand)):
            return n
    raise AssertionError(f"{band.name}: every take is served in place or by no layout")


def test_band_relieve_runs_the_chain_relief():
    """ALLOC-19: a lone band short of room where it is (a host-tier load's take) runs the chain's
    relief through `ChainAllocator.take_alone`, then takes; without the relief the same take is
    refused, and every byte reads back the same afterwards. A take no layout serves is refused."""
    storage = small_storage(page_size=2, chain_kib=8, rows=32)
    rows, payloads = _fill(storage, [10] * 5)
    storage.free_rows(np.array(rows[::2]))  # holes in every band, none large enough
    chain = storage.allocator
    window = chain.window_bands[0]
    n = _lone_shortfall(chain, window)
    with pytest.raises(CapacityError):
        chain.take_from(window, n)  # the band alone, no relief: short
    chain.decisions = []
    ids = chain.take_alone(window, n)
    assert len(ids) == n and len(np.unique(ids)) == n
    assert [d for d in chain.decisions if d[0] == "relief"], "the take went through without a relief"
    payloads.check()
    with pytest.raises(CapacityError):
        chain.take_alone(window, 10**6)
    chain.free(window, ids)
    storage.check_idle()


def test_handout_zeroing():
    """ALLOC-20: MHA pages are zeroed on hand-out; state pages are not."""
    storage = small_storage(page_size=2, chain_kib=16)
    chain = storage.allocator
    owner = chain.owner
    storage.arena.data.fill_(0xFF)  # stale bytes everywhere (NaN as bf16)
    ids = storage.allocator.take_from(owner, 3)
    words = storage.arena.page_words_view(owner.index)
    assert torch.count_nonzero(words[torch.from_numpy(ids)]) == 0
    state = chain.state_band
    slot = storage.allocator.take_from(state, 1)
    assert torch.count_nonzero(storage.arena.page_words_view(state.index)[torch.from_numpy(slot)]) > 0


def test_move_order_never_copies_into_a_block_another_float_holds():
    """ALLOC-17."""
    snap = lambda i, lo, hi: BandSnap(i, Placement.FLOAT, 16, 0, 0, 100, lo, hi, False, hi - lo, 0, 0, 0, 0, False)  # noqa: E731
    bands = [snap(0, 0, 1), snap(1, 10, 20), snap(2, 20, 30), snap(3, 90, 91)]
    # both floats move up; float 1's target overlaps float 2's current block: float 2 goes first
    order = move_order(bands, [Relocation(1, 25, 10), Relocation(2, 40, 10)])
    assert [r.band for r in order] == [2, 1]
    order = move_order(bands, [Relocation(2, 12, 10), Relocation(1, 2, 10)])
    assert [r.band for r in order] == [1, 2]
