"""The arena and its views: one uint8 region; typed views alias its bytes (DECL-17)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvchain.decl import MHA, MLA, FullLifetime, KVPart, State, StateTensor, WindowLifetime, kv_layer_decls
from kvchain.layout.host import host_layout
from kvchain.layout.views import SubPoolView
from kvchain.memory.arena import KVArena, arena_layout
from kvchain.models.small import small_hybrid
from kvchain.plan import page_envelope_pair, plan_kv_storage

SSM = State((StateTensor("conv", (6, 3)), StateTensor("ssm", (2, 4), "float32")))


def _plan(page_size=4):
    """Two blocks of full attention (the state on its layer) and a 16-token window whose V is
    narrower than its K: each sub-pool's page holds two layers."""
    decls = small_hybrid(MHA(2, 8), (16,), window_geometry=MHA(1, 8, v_head_dim=4), state=SSM, blocks=2)
    return plan_kv_storage(decls, page_size=page_size)


def test_grids_and_sinks():
    plan = _plan()
    layout = arena_layout(plan, 100_003)
    assert layout.arena_bytes == 100_000  # rounded down to 16
    down = layout.grids[-1]
    # the grow-down end's grid ends exactly at the arena's top byte
    assert down.origin + down.n_grid * down.page_bytes == layout.arena_bytes
    # one sink page per attention band, all below the chain, none overlapping
    sinks = sorted((g.byte_offset(g.sink_id), g.byte_offset(g.sink_id) + g.page_bytes)
                   for g in layout.grids if g.sink_id is not None)
    assert len(sinks) == 2
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(sinks))
    assert sinks[-1][1] <= layout.chain_lo
    for g in layout.grids:
        assert g.byte_offset(g.first_id) >= layout.chain_lo


@pytest.mark.parametrize("page_size", [1, 4])
def test_writes_through_views_land_in_the_arena(page_size):
    """Writing through one view and reading the bytes back through the arena agree."""
    plan = _plan(page_size)
    arena = KVArena(plan, 64 * 1024)
    for pool in plan.sub_pools:
        view = SubPoolView(pool, arena.page_bytes_view(pool.index))
        grid = arena.layout.grids[pool.index]
        page = grid.n_grid // 2
        for comp in pool.envelope.components:
            t = view.tensor(comp.layer_id, comp.name)
            assert t.dtype == {"bfloat16": torch.bfloat16, "float32": torch.float32}[comp.dtype]
            assert tuple(t.shape) == (grid.n_grid, *comp.shape)
            values = torch.arange(np.prod(comp.shape), dtype=torch.float32).view(comp.shape) + comp.offset
            t[page] = values.to(t.dtype)
            start = grid.origin + page * pool.page_bytes + comp.offset
            raw = arena.data[start : start + comp.nbytes].view(t.dtype).view(comp.shape)
            assert torch.equal(raw, values.to(t.dtype))
    # and through the wide view used for copies
    words = arena.page_words_view(0)
    assert words.dtype == torch.int64 and words.shape[1] * 8 == plan.sub_pools[0].page_bytes


def test_meta_arena_holds_no_bytes_at_real_scale():
    plan = _plan()
    arena = KVArena(plan, 80 * 2**30, "meta")
    assert arena.is_meta and arena.nbytes == 80 * 2**30
    view = SubPoolView(plan.sub_pools[0], arena.page_bytes_view(0))
    assert view.tensor(0, "ssm").device.type == "meta"


def test_host_layouts():
    plan = _plan()
    h = host_layout(plan.by_name("full"), 10)
    assert h.nbytes == 10 * plan.by_name("full").page_bytes
    assert h.allocate(pin=False).shape == (10, plan.by_name("full").page_bytes)
    # the up end here is state, so the two ends do not share a page-envelope backing
    assert page_envelope_pair(plan) is None
    mha_ends = plan_kv_storage(kv_layer_decls([KVPart(MHA(1, 8), WindowLifetime(8)), KVPart(MHA(1, 8), FullLifetime())]))
    pair = page_envelope_pair(mha_ends)
    assert pair is not None and {p.name for p in pair} == {"window8", "full"}


def test_mla_view():
    plan = plan_kv_storage(kv_layer_decls([KVPart(MLA(32, 8), FullLifetime())] * 2), page_size=2)
    arena = KVArena(plan, 8192)
    view = SubPoolView(plan.owner, arena.page_bytes_view(0))
    assert tuple(view.kv(1).shape)[1:] == (2, 40)


def test_mla_view_with_an_indexer_key():
    """The indexer key is its own component of each layer's page: writing it leaves the latent be."""
    plan = plan_kv_storage(kv_layer_decls([KVPart(MLA(32, 8, index_head_dim=128), FullLifetime())] * 2),
                           page_size=2)
    arena = KVArena(plan, 16384)
    view = SubPoolView(plan.owner, arena.page_bytes_view(0))
    assert tuple(view.index_k(1).shape)[1:] == (2, 132) and view.index_k(1).dtype == torch.uint8
    view.kv(1)[0].zero_()
    view.index_k(0)[0].zero_()
    view.index_k(1)[0].fill_(7)
    assert int(view.kv(1)[0].abs().sum()) == 0 and int(view.index_k(0)[0].sum()) == 0
    assert int(view.index_k(1)[0].sum()) == 7 * 2 * 132
