"""`ChainAllocator.admits`: virtual ids, state slots, and what the prefix cache could evict."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.demand import KVDemand
from kvchain.engine.request import ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.errors import CapacityError
from support.chains import small_storage
from support.simworld import world


def _demand(storage, pages, virtual=None, slots=0):
    full = tuple(pages)
    return KVDemand(full, sum(full) if virtual is None else virtual, slots)


def test_admits_counts_owner_virtual_ids():
    """ADM-4: a demand for more virtual ids than the owner has free is refused, whatever its pages."""
    storage = small_storage(windows=(), state=False)
    chain = storage.allocator
    free = len(chain.virtual_free)
    zero = (0,) * len(chain.bands)
    assert chain.admits(_demand(storage, zero, virtual=free))
    assert not chain.admits(_demand(storage, zero, virtual=free + 1))


def test_admits_counts_free_state_slots():
    """ADM-5: a demand for more state slots than are free is refused."""
    storage = small_storage(windows=(), state=True)
    chain = storage.allocator
    free = len(chain.slot_free)
    zero = (0,) * len(chain.bands)
    assert chain.admits(_demand(storage, zero, virtual=0, slots=free))
    assert not chain.admits(_demand(storage, zero, virtual=0, slots=free + 1))


def test_admits_credits_what_the_cache_could_evict():
    """ADM-6: with the chain full, a demand fits once the pages the cache could evict are credited,
    virtual ids included (every evicted owner page frees its id)."""
    storage = small_storage(windows=(), state=False, chain_kib=8)
    chain = storage.allocator
    full = False
    while not full:  # fill the chain, a row at a time
        row, tokens = storage.alloc_row(), 0
        while tokens + storage.page_size < storage.table.context_len:
            try:
                storage.alloc_extend(np.array([row]), np.array([tokens + storage.page_size]))
            except CapacityError:
                full = True
                break
            tokens += storage.page_size
    free = len(chain.virtual_free)
    assert chain.owner.n_live > 8 and free < 4
    zero = (0,) * len(chain.bands)
    ids_only = _demand(storage, zero, virtual=free + 4)
    assert not chain.admits(ids_only)
    assert not chain.admits(ids_only, reclaimable=(3,))
    assert chain.admits(ids_only, reclaimable=(4,))
    pages = _demand(storage, (8,))
    assert not chain.admits(pages)
    assert chain.admits(pages, reclaimable=(8,))

def test_a_full_prefix_cache_does_not_block_admission():
    """ADM-6: when the prefix cache holds nearly every owner page (so nearly every virtual id), a
    new request with nothing running is admitted by evicting, not refused."""
    pool = world(chain_kib=12, window=0, state=False)
    rng = np.random.default_rng(0)
    rid = 0
    for _ in range(40):  # distinct prompts, one at a time: each one's pages end up in the tree
        sched = Scheduler(pool, max_batched_tokens=64, max_running=4)
        prompt = rng.integers(1, 10_000, 40)
        sched.add([ScheduledRequest(rid, 0, prompt, max_new=4, output_len=4)])
        sched.run()
        rid += 1
    held = pool.tree.held_pages()[pool.chain.owner.name]
    assert held >= pool.chain.owner.grid.n_grid - 11, "the tree should hold nearly every owner page"
    sched = Scheduler(pool, max_batched_tokens=64, max_running=4)
    fresh = ScheduledRequest(rid, 0, rng.integers(1, 10_000, 40), max_new=4, output_len=4)
    sched.add([fresh])
    sched.step()
    assert fresh in sched.running or fresh.generated, f"not admitted: {fresh.phase} {fresh.reason}"
    sched.run()
    assert fresh.reason == "" and fresh.generated == 4
    pool.check_idle()
