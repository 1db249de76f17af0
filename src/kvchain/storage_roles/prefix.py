"""`PrefixSharing`: what the prefix tree does with pages it owns.

The tree owns whole owner pages (virtual ids) of finished or running prompts. A row that starts on a
cached prefix reads those pages but never frees them; the tree frees them itself, all bands at once
or one window's rows alone (WIN-5). Window rows can change owner virtual pages without a copy
(WIN-7)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class PrefixSharing(Protocol):
    """The prefix tree's side of the pool. Every method here changes ownership or binding only:
    none takes pages or copies bytes, and none moves a page (`move_epoch` stays)."""

    @abstractmethod
    def assign_prefix(self, row: int, vpages: np.ndarray, length: int, window_lo: np.ndarray) -> None:
        """Start a fresh row on a prefix the tree owns: `vpages` hold its first `length` tokens,
        whole pages; `window_lo`, per window band, is the first of them that window still binds.
        The row reads those pages and never frees them. Raises `InvariantError`
        (`requests.row_state`) when the row is not in use or already has tokens, and `InputError`
        when `length` is not `len(vpages)` whole pages or a page is one the owner does not bind or
        a row in use owns past its tree-shared prefix (that row would free it under this one);
        either way nothing changed."""

    @abstractmethod
    def release_to_tree(self, row: int, n_pages: int, duplicates: np.ndarray | None = None) -> None:
        """The tree took the row's first `n_pages` pages (an insert): from now on the row's free
        leaves them to the tree. Never shrinks what the tree already holds of the row.

        `duplicates` are those of the row's own pages among the first `n_pages` that the tree
        already held under pages of its own (`InsertResult.duplicates`): they are freed here, as
        `free_virtual_pages` frees, and their columns of the row read the null page from now on,
        so hand them over for a row that ends next (a finish, a preemption). Raises `InputError`,
        changing nothing, when the row is not in use or holds fewer pages, or a duplicate is named
        twice or is not one of the row's own pages before `n_pages` (past its tree-shared prefix)."""

    @abstractmethod
    def free_virtual_pages(self, vpages: np.ndarray) -> None:
        """Free pages no request row owns (the tree's): each window frees the rows it still binds,
        then the owner frees every one and the ids return to use. Raises `InputError`, changing
        nothing, for an id named twice, one the owner does not bind (the null page, never
        allocated, freed already) or one a row in use owns past its tree-shared prefix (`free_rows`
        frees those; an insert's duplicates go with `release_to_tree`). An id still bound in a
        window after its release fails `chain.window_segment_released` (CHK-8)."""

    @abstractmethod
    def free_window_rows(self, sub_pool: str, vpages: np.ndarray) -> None:
        """Free one window's rows of owner pages the tree keeps (evicting a node's window rows
        alone, WIN-5); the owner and every other band keep them bound. Raises `InputError`,
        changing nothing, for a sub-pool that is not a window of the plan, an id named twice, one
        the window does not bind, or one a row in use owns (`advance` retires a row's window
        pages)."""

    @abstractmethod
    def rehome_window(self, sub_pool: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Move one window's rows from virtual pages `src` to virtual pages `dst` that the window
        does not bind: the physical pages stay, their owner ids change (WIN-7). Raises
        `InvariantError` (`chain.window_segment_bound`), changing nothing, when a source is unbound
        or a target bound there; `InputError` for a sub-pool the plan lacks, or a target the owner
        does not bind or a row in use owns (rows bound under such an id would never be freed)."""

    @abstractmethod
    def bind_window(self, sub_pool: str, vpages: np.ndarray, physical: np.ndarray) -> None:
        """Bind live window pages with no owner id yet (a host-tier load's, still under its
        reservation) to owner virtual pages `vpages` (WIN-7). Raises `InputError`, changing
        nothing, for a sub-pool the plan lacks, a page that is not a load's reserved, unbound page,
        or an id the owner does not bind or the window binds already."""
