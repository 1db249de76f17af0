"""Host pools (`memory/host.py`): one per sub-pool laid out like its device view, the end sub-pools
sharing one envelope backing when both hold MHA pages, a float never sharing, sized from a budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain.errors import CapacityError, InputError
from kvchain.layout.views import SubPoolView
from kvchain.memory.host import HostPools, host_sizing, stage_host_groups
from kvchain.plan import PoolKind, plan_stages
from support.chains import small_storage
from support.stages import PARTITION, gemma_like


def _fill_device(storage) -> None:
    """Every byte of the arena gets a value from its position, so copies are checkable."""
    data = storage.arena.data
    data.copy_(torch.arange(data.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))


def test_every_sub_pool_has_a_host_pool_laid_out_like_its_view():
    """HIC-10: each sub-pool's host pages are its page envelopes, and a page copied to the host reads
    through the host view exactly as through the device view, component by component."""
    storage = small_storage(windows=(32, 8), state=True)
    _fill_device(storage)
    host = HostPools(storage.plan, 64 * 1024, pages_per_state=2)
    for pool in storage.plan.sub_pools:
        pages = host.pages(pool.name)
        assert pages.shape[1] == pool.page_bytes and pages.dtype == torch.uint8
        backing = host.pool(pool.name)
        dev = storage.arena.page_bytes_view(pool.index)
        src = torch.tensor([dev.shape[0] - 1, 3])
        dst = torch.from_numpy(backing.alloc(2))
        pages[dst] = dev[src]
        device_view, host_view = storage.view(pool.name), SubPoolView(pool, pages)
        for comp in pool.envelope.components:
            dev_t = device_view.tensor(comp.layer_id, comp.name)
            host_t = host_view.tensor(comp.layer_id, comp.name)
            assert host_t.shape[1:] == dev_t.shape[1:] and host_t.dtype == dev_t.dtype
            assert torch.equal(host_t[dst].view(torch.uint8), dev_t[src].view(torch.uint8))


def test_the_two_end_sub_pools_share_one_envelope_backing_when_both_hold_mha_pages():
    """HIC-11: a window at the up end and the full-attention owner at the down end, both MHA, draw
    host pages from one backing of the larger envelope: a page one takes, the other cannot."""
    storage = small_storage(windows=(8,), state=False)
    up, down = storage.plan.up_end, storage.plan.down_end
    host = HostPools(storage.plan, 32 * 1024)
    shared = host.pool(up.name)
    assert shared is host.pool(down.name) and host.backings == [shared]
    assert shared.layout.page_bytes == max(up.page_bytes, down.page_bytes)
    assert shared.n_pages == 2 * host.sizing.token_pages
    taken = shared.alloc(shared.n_pages - 1)
    assert host.pool(down.name).n_free == 1
    with pytest.raises(CapacityError):
        host.pool(down.name).alloc(2)
    shared.free(taken)
    # each end reads its own envelope out of the shared pages
    assert host.pages(up.name).shape[1] == up.page_bytes and host.pages(down.name).shape[1] == down.page_bytes
    assert host.pages(up.name).data_ptr() == host.pages(down.name).data_ptr()


def test_a_float_keeps_a_host_pool_of_its_own():
    """HIC-12: with two windows, the floats never share a backing with each other or an end; a
    state end does not pair with the owner, nor does an MLA owner with a window."""
    for kwargs in (dict(windows=(32, 8), state=False), dict(windows=(32, 8), state=True),
                   dict(windows=(32, 8), state=False, mla=True)):
        storage = small_storage(**kwargs)
        plan = storage.plan
        host = HostPools(plan, 64 * 1024, pages_per_state=2)
        for pool in plan.floats:
            mine = host.pool(pool.name)
            assert mine.layout.sub_pools == (pool.name,)
            assert all(host.pool(other.name) is not mine for other in plan.sub_pools if other is not pool)
        if kwargs.get("state") or kwargs.get("mla"):
            assert host.pool(plan.up_end.name) is not host.pool(plan.down_end.name)


def test_a_budget_buys_whole_groups_of_pages_and_state_slots_within_it():
    storage = small_storage(windows=(32, 8), state=True)
    plan = storage.plan
    sizing = host_sizing(plan, 10_000, pages_per_state=4)
    token = sum(p.page_bytes for p in plan.sub_pools if p.kind is not PoolKind.STATE)
    assert sizing.group_bytes == 4 * token + plan.state.page_bytes
    assert sizing.state_slots == 10_000 // sizing.group_bytes and sizing.token_pages == 4 * sizing.state_slots
    host = HostPools(plan, 10_000, pages_per_state=4)
    assert host.nbytes <= 10_000 < host.nbytes + sizing.group_bytes
    assert host.pool(plan.state.name).n_pages == sizing.state_slots >= 1
    assert host.pinned == torch.cuda.is_available()
    with pytest.raises(InputError, match="holds no host page"):
        HostPools(plan, sizing.group_bytes - 1, pages_per_state=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError):
            host_sizing(plan, bad)
    with pytest.raises(InputError):
        host.pool("nope")


def test_host_pages_are_freed_and_taken_again():
    storage = small_storage(windows=(8,), state=True)
    host = HostPools(storage.plan, 8 * 1024)
    pool = host.pool("full")
    ids = pool.alloc(pool.n_pages)
    assert len(np.unique(ids)) == pool.n_pages and pool.n_free == 0
    pool.free(ids[:3])
    assert sorted(pool.alloc(3).tolist()) == sorted(ids[:3].tolist())



def test_pipeline_stages_host_pools_hold_as_many_pages_each():
    """Stages split 7/5 keep other layers, so one host budget buys each stage another count of its
    own groups; `stage_host_groups` is the least, and pools capped at it hold as many pages per
    sub-pool on every stage (the host tier's decisions are then alike), each within the budget."""
    plans = plan_stages(gemma_like(), 2, page_size=4, partition=PARTITION)
    budget = 64 * 1024
    own = [host_sizing(p, budget).token_pages for p in plans]
    assert own[0] != own[1]
    groups = stage_host_groups(plans, budget)
    assert groups == min(own)
    pools = [HostPools(p, budget, pin=False, max_groups=groups) for p in plans]
    for pool in plans[0].sub_pools:
        assert len({hp.pool(pool.name).n_pages for hp in pools}) == 1
    assert all(hp.nbytes <= budget for hp in pools)
    assert HostPools(plans[0], budget, pin=False, max_groups=10**6).sizing == host_sizing(plans[0], budget)
