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
        when `length` is not `len(vpages)` whole pages; either way nothing changed."""

    @abstractmethod
    def release_to_tree(self, row: int, n_pages: int) -> None:
        """The tree took the row's first `n_pages` pages (an insert): from now on the row's free
        leaves them to the tree. Never shrinks what the tree already holds of the row."""

    @abstractmethod
    def free_virtual_pages(self, vpages: np.ndarray) -> None:
        """Free pages no row owns (the tree's, or an insert's duplicates): each window frees the
        rows it still binds, then the owner frees every one and the ids return to use. Raises
        `InputError`, changing nothing, for an id named twice or one the owner does not bind (the
        null page, never allocated, freed already). An id still bound in a window after its release
        fails `chain.window_segment_released` (CHK-8)."""

    @abstractmethod
    def free_window_rows(self, sub_pool: str, vpages: np.ndarray) -> None:
        """Free one window's rows of owner pages the tree keeps (evicting a node's window rows
        alone, WIN-5); the owner and every other band keep them bound. Raises `InputError` for a
        sub-pool the plan lacks; a page the window does not bind fails `chain.window_segment_bound`
        under invariant checks."""

    @abstractmethod
    def rehome_window(self, sub_pool: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Move one window's rows from virtual pages `src` to virtual pages `dst` that the window
        does not bind: the physical pages stay, their owner ids change (WIN-7). Raises
        `InvariantError` (`chain.window_segment_bound`), changing nothing, when a source is unbound
        or a target bound there; `InputError` for a sub-pool the plan lacks."""

    @abstractmethod
    def bind_window(self, sub_pool: str, vpages: np.ndarray, physical: np.ndarray) -> None:
        """Bind live window pages with no owner id yet (a host-tier load's, still under its
        reservation) to owner virtual pages `vpages` (WIN-7). Raises `InputError` for a sub-pool
        the plan lacks."""
