"""Id stacks and the virtual-to-physical map of one band (`UnitIds`).

Host-side id lists are numpy arrays with a stack pointer: a take pops a slice and a free pushes
one, never concatenating the whole list per call."""

from __future__ import annotations

import numpy as np

#: A virtual id that no physical page backs, and a physical id that backs no virtual id.
UNBOUND = -1


class IdStack:
    """A stack of ids (int64) with a fixed capacity: O(k) pushes and pops of k ids."""

    __slots__ = ("_ids", "count")

    def __init__(self, capacity: int, initial: np.ndarray | None = None) -> None:
        self._ids = np.empty(max(capacity, 1), dtype=np.int64)
        self.count = 0
        if initial is not None and len(initial):
            self.push(initial)

    def __len__(self) -> int:
        return self.count

    def push(self, ids: np.ndarray) -> None:
        k = len(ids)
        if self.count + k > len(self._ids):
            raise OverflowError(f"id stack over capacity ({self.count} + {k} > {len(self._ids)})")
        self._ids[self.count : self.count + k] = ids
        self.count += k

    def pop(self, k: int) -> np.ndarray:
        """The last `k` ids pushed, most recent last (a copy)."""
        if k > self.count:
            raise IndexError(f"pop {k} from a stack of {self.count}")
        self.count -= k
        return self._ids[self.count : self.count + k].copy()

    def view(self) -> np.ndarray:
        """The live ids, bottom first (a view: do not keep it across a push or pop)."""
        return self._ids[: self.count]

    def keep(self, mask: np.ndarray) -> None:
        """Drop the ids where `mask` is False, keeping order."""
        kept = self._ids[: self.count][mask]
        self.count = len(kept)
        self._ids[: self.count] = kept


class UnitIds:
    """One band's map between virtual ids (what requests hold) and physical grid ids (what its
    kernels index). `v2p[v]` is UNBOUND for a virtual id the band does not back; `p2v[p]` is
    UNBOUND for a grid id that holds no live unit."""

    def __init__(self, n_virtual: int, n_grid: int, sink: int | None = None) -> None:
        # Both virtual-indexed maps carry one entry past the last virtual id, never bound: the id
        # UNBOUND (-1) indexes it, so reading "no id" gives the sink (or UNBOUND) and unbinding
        # the virtual id of a page that has none writes harmlessly there, with no filtering.
        self.n_virtual = n_virtual
        self.v2p = np.full(n_virtual + 1, UNBOUND, dtype=np.int64)
        self.p2v = np.full(n_grid, UNBOUND, dtype=np.int64)
        #: what a reader's translation gives: `v2p` with every unbound id reading as the sink page,
        #: kept in step on every bind so translation is a single gather
        self.sink = UNBOUND if sink is None else sink
        self.read_map = np.full(n_virtual + 1, self.sink, dtype=np.int64)

    def bind(self, virtual: np.ndarray, physical: np.ndarray) -> None:
        self.v2p[virtual] = physical
        self.read_map[virtual] = physical
        self.p2v[physical] = virtual

    def unbind_physical(self, physical: np.ndarray) -> None:
        """Unbind the virtual ids that physical ids back (a free)."""
        virtual = self.p2v[physical]
        self.v2p[virtual] = UNBOUND
        self.read_map[virtual] = self.sink
        self.p2v[physical] = UNBOUND

    def rebind_physical(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move bindings from physical `src` to `dst` (a page move); requests never see it."""
        virtual = self.p2v[src].copy()
        self.p2v[src] = UNBOUND
        self.p2v[dst] = virtual
        self.v2p[virtual] = dst
        self.read_map[virtual] = dst
