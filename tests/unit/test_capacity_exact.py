"""`evict_until_fits` and `reclaimable_pages`: what the capacity entry points ask the allocator and
the prefix cache, with both recorded, so each call and its arguments can be checked exactly."""

from __future__ import annotations

from kvchain.capacity import evict_until_fits, reclaimable_pages
from kvchain.decl import MHA, State, StateTensor
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage

SSM = State((StateTensor("ssm", (4, 4), "float32"),))
NAMES = ["state", "window64", "full"]


class Allocator:
    """Fits once `room` more full-attention pages are free; counts every question."""

    def __init__(self, room: int):
        self.room = room
        self.fit_asks: list[list[int]] = []
        self.after_asks: list[tuple[list[int], list[int]]] = []

    def units_fit(self, pages):
        self.fit_asks.append(list(pages))
        return self.room <= 0

    def fits_after_frees(self, pages, freed):
        self.after_asks.append((list(pages), list(freed)))
        return freed[2] >= self.room


class Storage:
    def __init__(self, room: int):
        self.plan = plan_kv_storage(small_hybrid(MHA(1, 8), (64,), state=SSM), page_size=16)
        assert [p.name for p in self.plan.sub_pools] == NAMES
        self.allocator = Allocator(room)


class Tree:
    """Victims walked in order, each freeing the given pages per sub-pool (a sub-pool it holds
    nothing in is left out of the dict); evicts up to the first victim the walk says yes to."""

    def __init__(self, storage, victims):
        self.storage, self.victims, self.evicted, self.walks = storage, victims, 0, 0

    def evict(self, wanted):
        self.walks += 1
        freed: dict[str, int] = {}
        for k, v in enumerate(self.victims):
            for name, n in v.items():
                freed[name] = freed.get(name, 0) + n
            if wanted(freed):
                self.evicted = k + 1
                self.storage.allocator.room -= freed.get("full", 0)
                return

    def reclaimable(self):
        return {"full": 9, "state": 2, "window64": 4}


def test_a_take_that_fits_asks_nothing_of_the_cache():
    """CAP-2: the allocator's yes is the answer; the cache is not walked."""
    storage = Storage(room=0)
    tree = Tree(storage, [{"full": 5}])
    assert evict_until_fits(storage, tree, [0, 1, 3])
    assert tree.walks == 0 and storage.allocator.fit_asks == [[0, 1, 3]]


def test_without_a_cache_a_take_that_does_not_fit_is_refused():
    storage = Storage(room=4)
    assert not evict_until_fits(storage, None, [0, 1, 3])
    assert storage.allocator.after_asks == []


def test_the_walk_asks_after_each_victim_and_stops_at_the_first_yes():
    """ADM-7, ADM-8: the cache walks its own order; each ask carries what the walk freed so far in
    chain order (0 for a sub-pool the victims hold nothing in); the walk stops at the first yes."""
    storage = Storage(room=6)
    tree = Tree(storage, [{"full": 2}, {"full": 3, "window64": 1}, {"full": 1}, {"full": 9}])
    assert evict_until_fits(storage, tree, [1, 2, 6])
    assert storage.allocator.after_asks == [([1, 2, 6], [0, 0, 2]), ([1, 2, 6], [0, 1, 5]),
                                            ([1, 2, 6], [0, 1, 6])]
    assert tree.evicted == 3
    assert storage.allocator.fit_asks == [[1, 2, 6], [1, 2, 6]]


def test_a_walk_that_never_reaches_a_yes_answers_no():
    """ADM-8: nothing is evicted, and the answer is the allocator's no."""
    storage = Storage(room=50)
    tree = Tree(storage, [{"full": 2}, {"full": 3}])
    assert not evict_until_fits(storage, tree, [0, 0, 50])
    assert tree.evicted == 0 and len(storage.allocator.after_asks) == 2


def test_reclaimable_pages_come_in_chain_order():
    """ADM-6: what the cache could evict, per band in chain order (state, window, full)."""
    storage = Storage(room=0)
    assert reclaimable_pages(storage, Tree(storage, [])) == (2, 4, 9)
    assert reclaimable_pages(storage, None) is None
