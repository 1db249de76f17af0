"""Small real chains for tests: a hybrid plan on a tiny CPU arena, plus payload bookkeeping that
writes a known value into every live page through the views and checks it reads back."""

from __future__ import annotations

import numpy as np
import torch

from kvchain.build import build_kv_storage
from kvchain.decl import MHA, MLA, State, StateTensor
from kvchain.errors import CapacityError
from kvchain.models.small import small_hybrid
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan
from kvchain.storage import KVStorage


def hybrid_decls(windows=(32, 8), state=True, heads=(1, 2, 1), mla=False, head_dim=8, chunked=False):
    """Layers: full attention (+ state on layer 0), then one layer per window length (chunked
    attention when `chunked`)."""
    full_geom = MLA(16, 8) if mla else MHA(heads[0], head_dim)
    ssm = State((StateTensor("conv", (4, 3)), StateTensor("ssm", (2, 4), "float32"))) if state else None
    window_geoms = [MHA(heads[(k + 1) % len(heads)], head_dim) for k in range(len(windows))]
    return small_hybrid(full_geom, windows, window_geometry=window_geoms, state=ssm, chunked=chunked)


def small_storage(page_size=2, chain_kib=24, windows=(32, 8), state=True, context=128, rows=8,
                  heads=(1, 2, 1), mla=False, backend=None, device="cpu", chunked=False) -> KVStorage:
    plan = plan_kv_storage(hybrid_decls(windows, state, heads, mla, chunked=chunked), page_size=page_size)
    probe = size_plan(plan, 64 * 2**20, context_len=context, max_running_requests=rows, state_slots=rows)
    budget = probe.fixed.total + chain_kib * 1024
    sizing = size_plan(plan, budget, context_len=context, max_running_requests=rows, state_slots=rows)
    return build_kv_storage(plan, sizing, device, backend=backend)


def allocator_state(storage: KVStorage):
    """Everything the allocator decides with, for exact before/after comparison."""
    chain = storage.allocator
    out = [chain.virtual_free.view().copy(), chain.slot_free.view().copy()]
    for b in chain.bands:
        out += [b.state.copy(), b.holes.view().copy(), b.ids.v2p.copy(), b.ids.p2v.copy(), b.fixed_mask.copy(),
                (b.lo, b.hi, b.parked, b.n_live, b.n_holes, b.n_pending, b.n_fixed),
                [(x.key, x.size) for x in b.pending]]
    t = storage.table
    out += [t.page_table.copy(), t.seq_lens.copy(), t.state_slot.copy(), t.active.copy()]
    return out


def same_state(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


class Payloads:
    """Writes a value unique to (sub-pool, virtual page, offset) into every token a request holds,
    through the typed views at the translated physical ids, and checks it reads back."""

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.plan = storage.plan

    def _value(self, band_index: int, vtok: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((vtok * 7 + band_index * 13) % 1000 + 1).astype(np.float32))

    def write_tokens(self, rows: np.ndarray, vtok: np.ndarray) -> None:
        ids = self.storage.iteration_ids(vtok)
        ps = self.plan.page_size
        for pool in self.plan.sub_pools:
            if pool.kind is PoolKind.STATE:
                continue
            loc = ids.locs[pool.name]
            view = self.storage.view(pool.name)
            comp = pool.envelope.components[0]
            t = view.tensor(comp.layer_id, comp.name)
            vals = self._value(pool.index, vtok).to(t.dtype)
            shape = (len(loc),) + (1,) * (t.dim() - 2)
            t[torch.from_numpy(loc // ps), torch.from_numpy(loc % ps)] = vals.view(shape)

    def write_slots(self, rows: np.ndarray) -> None:
        state = self.plan.state
        if state is None:
            return
        slots = self.storage.table.state_slot[rows]
        phys = self.storage.allocator.state_band.ids.v2p[slots]
        comp = state.envelope.components[-1]
        t = self.storage.view("state").tensor(comp.layer_id, comp.name)
        vals = torch.from_numpy((slots * 3 + 1).astype(np.float32)).to(t.dtype)
        t[torch.from_numpy(phys)] = vals.view((len(phys),) + (1,) * (t.dim() - 1))

    def check(self) -> None:
        storage = self.storage
        table = storage.table
        rows = np.flatnonzero(table.active)
        if not len(rows):
            return
        ps = self.plan.page_size
        runner = storage.runner_ids(rows)
        vt = table.req_to_token(rows)
        lens = table.seq_lens[rows]
        valid = np.arange(vt.shape[1])[None, :] < lens[:, None]
        for pool in self.plan.sub_pools:
            if pool.kind is PoolKind.STATE:
                comp = pool.envelope.components[-1]
                t = storage.view("state").tensor(comp.layer_id, comp.name)
                slots = table.state_slot[rows]
                got = t[torch.from_numpy(runner.state_slots)].reshape(len(rows), -1)[:, 0].float().numpy()
                np.testing.assert_array_equal(got, (slots * 3 + 1).astype(np.float32), err_msg="state slot lost")
                continue
            comp = pool.envelope.components[0]
            t = storage.view(pool.name).tensor(comp.layer_id, comp.name)
            pt = runner.page_tables[pool.name]
            pos = np.arange(vt.shape[1])
            pages = pt[:, pos // ps]
            held = valid
            if pool.kind is PoolKind.WINDOW:
                k = [w.name for w in self.plan.windows].index(pool.name)
                held = valid & (pos[None, :] >= table.window_lo[rows, k][:, None] * ps)
                sink = storage.allocator.bands[pool.index].grid.sink_id
                assert (pages[valid & ~held] == sink).all(), f"{pool.name}: a retired row does not read the sink"
            valid_all, valid = valid, held
            got = t[torch.from_numpy(pages[valid]), torch.from_numpy(np.broadcast_to(pos % ps, vt.shape)[valid])]
            got = got.reshape(len(got), -1)[:, 0].float().numpy()
            want = self._value(pool.index, vt[valid]).to(t.dtype).float().numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"{pool.name}: bytes lost")
            valid = valid_all


# -- random churn: one step of a request's life, for loops that drive a chain at random -------------


def admit_random(storage, rng, rows: list, most: int, payloads=None) -> None:
    """Admit a request of 2..most-1 tokens when a row and its pages are free (its row joins
    `rows`); otherwise nothing changes."""
    if not storage.table.free_rows:
        return
    row = storage.alloc_row()
    try:
        vtok = storage.alloc_extend(np.array([row]), np.array([int(rng.integers(2, most))]))
    except CapacityError:
        storage.table.free_row(row)
        return
    if payloads is not None:
        payloads.write_tokens(np.array([row]), vtok)
        payloads.write_slots(np.array([row]))
    rows.append(row)


def grow_random(storage, rng, rows: list, most: int, payloads=None) -> None:
    """Grow a random running request by 1..most-1 tokens (raises CapacityError when it cannot)."""
    row = rows[int(rng.integers(len(rows)))]
    new = min(storage.table.context_len, int(storage.table.seq_lens[row]) + int(rng.integers(1, most)))
    vtok = storage.alloc_extend(np.array([row]), np.array([new]))
    if payloads is not None:
        payloads.write_tokens(np.array([row]), vtok)


def finish_random(storage, rng, rows: list) -> None:
    """Free a random running request."""
    storage.free_rows(np.array([rows.pop(int(rng.integers(len(rows))))]))


def boundary_plan(page_size: int = 16, state: bool = True):
    """The plan the API boundary's tests refuse bad input against: full attention (2 x 64), one
    128-token window and (`state`) a conv + SSM state: every kind of sub-pool, small pages."""
    ssm = State([StateTensor("conv", (4, 64), "bfloat16"), StateTensor("ssm", (8, 64), "float32")]) if state else None
    return plan_kv_storage(small_hybrid(MHA(2, 64), (128,), state=ssm), page_size=page_size)


def boundary_storage(page_size: int = 16, state: bool = True) -> KVStorage:
    """`boundary_plan` on a `meta` arena of 64 MiB, 1,024-token context, 8 rows."""
    plan = boundary_plan(page_size, state)
    return build_kv_storage(plan, size_plan(plan, 64 * 2**20, context_len=1024, max_running_requests=8), "meta")
