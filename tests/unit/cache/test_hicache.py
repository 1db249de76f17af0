"""The host tier's controller (`cache/hicache.py`): backups before eviction, loads on a match, the
bytes of every sub-pool (state included) back where the tree reads them, and the copies ordered as
the design says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain.cache.hicache import HiRadixCache, WritePolicy, copy_pages, prefix_digests
from kvchain.device import ModeledDevice, ThreadDevice
from kvchain.errors import CapacityError, InputError
from kvchain.memory.host import HostPools
from kvchain.testing.overlap import overlap_storage
from support.chains import small_storage
from support.tree import patched


def _cache(storage, tree, tokens, state=False):
    """Prefill `tokens` in a row and hand its pages (and a state slot, with `state`) to the tree."""
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([len(tokens)]))
    n = len(tokens) // storage.page_size
    table = storage.table
    slot = int(storage.alloc_state_slots(1)[0]) if state else -1
    result = tree.insert(tokens[: n * storage.page_size], table.page_table[row, :n].copy(), table.window_lo[row], slot)
    storage.release_to_tree(row, n, result.duplicates)
    storage.free_rows(np.array([row]))
    return result.node


def _scramble(storage, seed):
    gen = torch.Generator().manual_seed(seed)
    storage.arena.data.copy_(torch.randint(0, 256, storage.arena.data.shape, generator=gen, dtype=torch.uint8))


def _node_bytes(storage, tree, node) -> dict[str, torch.Tensor]:
    """The device bytes of what `node` holds, per sub-pool, through the current translation."""
    out = {}
    plan = storage.plan
    out[plan.owner.name] = storage.arena.page_bytes_view(plan.owner.index)[
        torch.from_numpy(storage.physical_pages(plan.owner.name, node.vpages))].clone()
    for w, pool in enumerate(tree.windows):
        lo = int(node.window_lo[w])
        if lo < node.n_pages:
            ids = storage.physical_pages(pool.name, node.vpages[lo:])
            out[pool.name] = storage.arena.page_bytes_view(pool.index)[torch.from_numpy(ids)].clone()
    if node.state_slot >= 0:
        ids = storage.physical_pages(plan.state.name, np.array([node.state_slot]))
        out[plan.state.name] = storage.arena.page_bytes_view(plan.state.index)[torch.from_numpy(ids)].clone()
    return out


def _tree(storage, budget=256 * 1024, policy=WritePolicy.WRITE_BACK, interval=None):
    interval = interval if storage.plan.state is not None else None
    if storage.plan.state is not None and interval is None:
        interval = 4 * storage.page_size
    pps = interval // storage.page_size if interval else 1
    return HiRadixCache(storage, HostPools(storage.plan, budget, pages_per_state=pps), checkpoint_interval=interval,
                        policy=policy)


@pytest.mark.parametrize("kwargs", [dict(windows=(32, 8), state=True), dict(windows=(8,), state=False),
                                    dict(windows=(), state=True), dict(windows=(16,), state=True, mla=True)])
def test_an_evicted_node_loads_back_with_every_sub_pool_byte_equal(kwargs):
    """Full pages, window rows and the state at the node's end go to the host when the tree evicts
    the node and come back on a match, byte for byte, wherever the device pages are now."""
    storage = small_storage(chain_kib=32, **kwargs)
    tree = _tree(storage)
    tokens = np.arange(1, 25, dtype=np.int32)
    node = _cache(storage, tree, tokens, state=storage.plan.state is not None)
    _scramble(storage, 1)
    before = _node_bytes(storage, tree, node)
    tree.evict_all()
    assert not tree.root.children and tree.hicache.stats["backups"] == 1
    tree.hicache.collect(wait=True)
    _scramble(storage, 2)  # the freed pages are reused for other bytes
    match = tree.match_prefix(tokens)
    assert match.length == len(tokens) and tree.hicache.stats["host_hits"] == 1
    tree.hicache.collect(wait=True)
    after = _node_bytes(storage, tree, match.node)
    assert set(after) == set(before)
    for name in before:  # a window loads the rows it reads from the end on
        assert len(after[name]) > 0 and torch.equal(after[name], before[name][-len(after[name]):]), name
    tree.verify()
    tree.hicache.verify()
    assert not tree.hicache.jobs and not storage.allocator.owner.usage.uses
    tree.evict_all()
    storage.check_idle(held=tree.held_pages())


def test_a_host_hit_restores_the_state_a_state_eviction_dropped():
    """The tree evicts a checkpoint's state alone (its pages stay): the state goes to the host, and
    a match at that node end loads it back into a fresh slot."""
    storage = small_storage(chain_kib=32, windows=(), state=True)
    tree = _tree(storage)
    tokens = np.arange(1, 17, dtype=np.int32)
    node = _cache(storage, tree, tokens, state=True)
    _scramble(storage, 3)
    state_bytes = _node_bytes(storage, tree, node)["state"]
    state_i = storage.plan.state.index
    tree.lock(node)  # a running request reads the pages: only the state may go
    freed = tree.evict(lambda f: f.get("state", 0) >= 1)
    tree.unlock(node)
    assert freed.pages == {"state": 1} and node.state_slot < 0 and tree.root.children
    tree.hicache.collect(wait=True)
    storage.arena.page_bytes_view(state_i).zero_()
    match = tree.match_prefix(tokens)
    assert match.length == len(tokens) and match.state_slot >= 0 and tree.hicache.stats["load_states"] == 1
    tree.hicache.collect(wait=True)
    assert torch.equal(_node_bytes(storage, tree, match.node)["state"], state_bytes)


def test_write_through_backs_up_at_insert_and_eviction_copies_nothing_more():
    storage = small_storage(chain_kib=32, windows=(8,), state=False)
    tree = _tree(storage, policy=WritePolicy.WRITE_THROUGH)
    tokens = np.arange(1, 17, dtype=np.int32)
    _cache(storage, tree, tokens)
    assert tree.hicache.stats["backups"] == 1 and len(tree.hicache.records) == 8
    tree.evict_all()
    assert tree.hicache.stats["backups"] == 1
    assert tree.match_prefix(tokens).length == 16 and tree.hicache.stats["host_hits"] == 1


def test_a_full_host_evicts_its_least_recently_used_records():
    storage = small_storage(chain_kib=32, windows=(8,), state=False)
    plan = storage.plan
    page = max(p.page_bytes for p in plan.sub_pools)
    tree = _tree(storage, budget=2 * 12 * page)  # 12 pages of each end, one shared backing
    first, second = np.arange(1, 17, dtype=np.int32), np.arange(101, 117, dtype=np.int32)
    _cache(storage, tree, first)
    tree.evict_all()
    _cache(storage, tree, second)
    tree.evict_all()
    stats = tree.hicache.stats
    assert stats["backups"] == 2 and stats["host_evictions"] >= 4
    tree.hicache.verify()
    assert tree.match_prefix(second).length == 16  # the newer prefix is whole on the host
    assert tree.match_prefix(first).length < 16


def test_a_load_the_device_cannot_make_room_for_changes_nothing():
    storage = small_storage(chain_kib=16, windows=(8,), state=False)
    tree = _tree(storage)
    tokens = np.arange(1, 17, dtype=np.int32)
    _cache(storage, tree, tokens)
    tree.evict_all()
    row, length = storage.alloc_row(), 0
    while True:  # running requests take the whole arena, a page at a time
        try:
            storage.alloc_extend(np.array([row]), np.array([length + 2]))
            length += 2
        except CapacityError:
            break
        if length == 126:
            row, length = storage.alloc_row(), 0
    live = storage.stats().live_pages
    assert tree.hicache.load_back(tokens) is None
    assert tree.hicache.stats["load_skips"] == 1 and not tree.hicache.queue
    assert storage.stats().live_pages == live and all(r.pins == 0 for r in tree.hicache.records.values())


def _thread_storage(**kwargs):
    device = ThreadDevice(forward_delay=0.3)
    return small_storage(chain_kib=32, backend=device, **kwargs), device


def test_a_backup_copies_what_the_running_forward_writes():
    """HIC-1: the backup's copy stream waits the forward stream, so a page a forward in flight still
    writes reaches the host with the forward's bytes, not the ones before it."""
    storage, device = _thread_storage(windows=(8,), state=False)
    try:
        tree = _tree(storage)
        node = _cache(storage, tree, np.arange(1, 17, dtype=np.int32))
        owner = storage.plan.owner
        pages = torch.from_numpy(storage.physical_pages(owner.name, node.vpages))
        view = storage.arena.page_bytes_view(owner.index)
        view[pages] = 1

        def forward_writes() -> None:
            view[pages] = 9

        device.launch(device.forward_stream, forward_writes, label="forward")
        tree.evict_all()
        tree.hicache.collect(wait=True)
        host = tree.hicache.host.pages(owner.name)
        ids = [r.pages[owner.name] for r in tree.hicache.records.values()]
        assert len(ids) == 8 and bool((host[torch.tensor(ids)] == 9).all())
    finally:
        device.close()


def _modeled():
    device = ModeledDevice(seed=0, durations={"forward": 10.0})
    return overlap_storage(device, chain_kib=32, page_size=2, windows=(8,), state=False), device


def test_a_load_copy_starts_after_the_forward_stream():
    """HIC-9: a load's copy stream waits the forward stream before the copy starts."""
    storage, device = _modeled()
    tree = _tree(storage)
    tokens = np.arange(1, 17, dtype=np.int32)
    _cache(storage, tree, tokens)
    tree.evict_all()
    device.synchronize()
    tree.hicache.collect()
    device.launch(device.forward_stream, None, label="forward")
    assert tree.match_prefix(tokens).length == 16
    forward = next(i for i in device.history if i.label == "forward")
    load = next(i for i in device.history if i.label.startswith("load"))
    assert load.start >= forward.end


def test_a_backup_copy_starts_after_the_forward_stream():
    """HIC-1, on the modeled device: the backup copy starts once the forward launched before it ended."""
    storage, device = _modeled()
    tree = _tree(storage)
    _cache(storage, tree, np.arange(1, 17, dtype=np.int32))
    device.launch(device.forward_stream, None, label="forward")
    tree.evict_all()
    forward = next(i for i in device.history if i.label == "forward")
    backup = next(i for i in device.history if i.label.startswith("backup"))
    assert backup.start >= forward.end


def test_a_queued_load_translates_its_ids_when_submitted():
    """HIC-7: once the tree named a load's window rows (HIC-6) they may move before submission; the
    copy translates the ids at submission, so the host bytes land where the rows are then."""
    storage = small_storage(chain_kib=32, windows=(8,), state=False, page_size=2)
    window = storage.plan.windows[0]
    assert window.placement.name == "UP_END"  # the end that compacts
    tree = _tree(storage)
    tokens = np.arange(1, 17, dtype=np.int32)
    node = _cache(storage, tree, tokens)
    _scramble(storage, 4)
    before = _node_bytes(storage, tree, node)
    tree.evict_all()
    tree.hicache.collect(wait=True)
    low = storage.alloc_row()  # takes the low pages back, so the load lands above it
    storage.alloc_extend(np.array([low]), np.array([16]))
    load = tree.hicache.load_back(tokens)
    assert load is not None and window.name in load.virtual
    queued = storage.physical_pages(window.name, load.virtual[window.name]).copy()
    storage.free_rows(np.array([low]))
    chain = storage.allocator
    assert chain.relief_flush(chain.bands[window.index]) > 0
    moved = storage.physical_pages(window.name, load.virtual[window.name])
    assert not np.array_equal(moved, queued)  # the named rows moved while the load was queued
    _scramble(storage, 5)
    tree.hicache.start_loading()
    tree.hicache.collect(wait=True)
    match = tree.match_prefix(tokens)
    assert match.length == 16
    after = _node_bytes(storage, tree, match.node)
    for name in before:
        assert torch.equal(after[name], before[name][-len(after[name]):]), name


def test_submission_records_the_writer_before_the_reservation_ends():
    """HIC-8: `start_loading` records the copy as a writer (COPY_WRITE) and ends the reservations left
    with no gap: when each reservation ends, its pages are already covered by the copy."""
    storage = small_storage(chain_kib=32, windows=(8,), state=True)
    tree = _tree(storage)
    tokens = np.arange(1, 17, dtype=np.int32)
    _cache(storage, tree, tokens, state=True)
    tree.evict_all()
    tree.hicache.collect(wait=True)
    seen = []

    def check(original):
        def end(sub_pool, reservation):
            band = storage.allocator.bands[storage.plan.by_name(sub_pool).index]
            seen.append((sub_pool, sorted({u.hazard.name for u in band.usage.on(reservation.pages)})))
            return original(sub_pool, reservation)
        return end

    load = tree.hicache.load_back(tokens)
    assert load is not None and set(load.reservations) == {"full", "state"}
    with patched(storage, "end_load_reservations", check):
        tree.hicache.start_loading()
    assert seen == [("full", ["COPY_WRITE", "FIXED"]), ("state", ["COPY_WRITE", "FIXED"])]
    assert not any(b.fixed_mask.any() for b in storage.allocator.bands)


def test_the_controller_refuses_bad_input():
    storage = small_storage(windows=(8,), state=False)
    other = small_storage(windows=(8,), state=True)
    with pytest.raises(InputError, match="another plan"):
        HiRadixCache(storage, HostPools(other.plan, 64 * 1024))
    with pytest.raises(InputError, match="write policy"):
        HiRadixCache(storage, HostPools(storage.plan, 64 * 1024), policy="write_back")
    with pytest.raises(InputError, match="named by owner ids"):
        storage.bind_loaded("window8", np.array([1]))
    with pytest.raises(InputError, match="reserved"):
        storage.bind_loaded("full", np.array([3]))


def test_copies_coalesce_runs_and_digests_name_whole_prefixes():
    src = torch.arange(40, dtype=torch.uint8).view(10, 4)
    dst = torch.zeros(10, 4, dtype=torch.uint8)
    copy_pages(dst, np.array([0, 1, 2, 7]), src, np.array([3, 4, 5, 9]))
    assert torch.equal(dst[[0, 1, 2, 7]], src[[3, 4, 5, 9]]) and not dst[3:7].any()
    a, b = np.arange(8, dtype=np.int32), np.array([0, 1, 2, 3, 9, 9, 9, 9], dtype=np.int32)
    da, db = prefix_digests(a, 4, 2), prefix_digests(b, 4, 2)
    assert da[0] == db[0] and da[1] != db[1] and len(set(da)) == 2
