"""`UnifiedRadixCache`: a radix tree over token ids whose nodes hold one slot per sub-pool.

Nodes cover whole pages. For every page a node holds the owner's virtual page (full attention); for
each window sub-pool, the node keeps the window's retained length: pages from `window_lo` to the
node's end are still bound in that window, earlier ones were retired (WIN-2, WIN-4). A node may hold
a state slot: the recurrent state at its end, a checkpoint (WIN-9) or, with `no_buffer`, a sequence
end (WIN-10).

A match ends only where everything a continuation needs is there: the full pages behind it, each
window's rows behind it, and (for a model with state) a state slot at exactly that point. Running
requests lock the path they matched (reference counts); the window rows behind a match stay locked
only while the request may still read them. Eviction is a logical free (WIN-5): unlocked leaves go
whole, window rows nobody reads and state slots go on their own, least recently used first. A node
a forward in flight still reads may be evicted: its pages pend until that forward is processed
(WIN-6)."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..advance import window_keep_from
from ..errors import InputError, InvariantError
from ..plan import PoolKind
from ..storage import KVStorage
from ..storage_roles import boundary
from ..units import is_integer

#: above every rank a reuse map gives (a queue position)
_REUSE_TIERS = 1 << 40

#: the tree keys token ids as int32
_INT32 = np.dtype(np.int32)
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def token_ids(tokens, what: str) -> np.ndarray:
    """`tokens` as the flat int32 array the tree keys; InputError for anything but integers (floats,
    bools, strings) or ids outside the int32 range, which a cast would silently turn into other
    ids. An empty sequence of any type is no tokens. An int32 array (what requests hold) passes as
    it is: no copy, no scan."""
    if type(tokens) is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1:
        return tokens
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputError(f"{what} tokens must be an array of integer token ids ({exc})") from None
    if arr.ndim != 1:
        if arr.ndim == 0 or arr.size:
            raise InputError(f"{what} tokens must be a flat array of token ids, got shape {arr.shape}")
        arr = arr.reshape(0)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind in "fO":
            return np.empty(0, dtype=np.int32)
        raise InputError(f"{what} tokens must be integer token ids, not {arr.dtype} (got {arr[:4].tolist()})")
    if arr.size and arr.dtype.itemsize >= _INT32.itemsize and arr.dtype != _INT32:
        signed = arr.dtype.kind == "i"
        if (signed and arr.min() < _INT32_MIN) or arr.max() > _INT32_MAX:
            bad = arr[(arr < _INT32_MIN) | (arr > _INT32_MAX)] if signed else arr[arr > _INT32_MAX]
            raise InputError(f"{what} tokens {bad[:4].tolist()} lie outside the int32 range the tree keys "
                             f"({_INT32_MIN}..{_INT32_MAX})")
    return arr.astype(np.int32, copy=False)


class CheckpointStrategy(enum.Enum):
    """How recurrent state reaches the tree (`--mamba-radix-cache-strategy`)."""

    EXTRA_BUFFER = "extra_buffer"  # a tracking slot per request captures the state on the grid
    EXTRA_BUFFER_LAZY = "extra_buffer_lazy"  # the tracking slot is taken only at a grid point
    NO_BUFFER = "no_buffer"  # the state at the sequence end only


_node_seq = itertools.count()


class TreeNode:
    __slots__ = (
        "children",
        "hits",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "seq",
        "start",
        "state_slot",
        "state_used",
        "vpages",
        "window_held",
        "window_lo",
        "window_lock",
    )

    def __init__(self, parent: TreeNode | None, key: np.ndarray, vpages: np.ndarray, n_windows: int,
                 start: int) -> None:
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.key = key  # token ids, whole pages
        self.vpages = vpages  # owner virtual page per page
        self.window_lo = np.full(n_windows, len(vpages), dtype=np.int64)
        self.state_slot = -1
        self.state_used = 0  # when the state here was last taken or matched (its own recency)
        self.lock_ref = 0
        self.window_lock = 0
        self.window_held = 0  # window rows bound, all windows together (kept by `_account`)
        self.last_access = 0
        self.hits = 0  # matches that ended at or below this node: proven reuse
        self.start = start  # tokens from the root to this node's start
        self.seq = next(_node_seq)  # creation order: breaks eviction ties the same way every run

    @property
    def n_pages(self) -> int:
        return len(self.vpages)

    def __repr__(self) -> str:
        return (f"TreeNode(start={self.start}, pages={self.n_pages}, window_lo={self.window_lo.tolist()}, "
                f"state={self.state_slot}, lock={self.lock_ref}/{self.window_lock})")


@dataclass
class WindowLock:
    """A request's hold on the tree's window rows: every node from `node` (where its match or
    insert ended) up to token `floor` (a node boundary: where its widest window begins)."""

    node: TreeNode
    floor: int
    recheck: int  # the length at which the floor may next have moved a whole release step


@dataclass(frozen=True)
class MatchResult:
    """A usable prefix: `length` tokens (whole pages), their owner virtual pages, the node that ends
    there (to lock), each window's first bound page among them, and the state slot at the end.

    `branch` (checkpointed state only): the latest checkpoint grid point at or before where the
    tokens leave the tree (the whole pages some cached sequence shares with them), when that lies
    past `length`, else 0. A request whose first prefill chunk ends there leaves its checkpoint
    where its branch splits off, so later requests that share the same start (a system prompt,
    a sibling's blocks) match it."""

    length: int
    vpages: np.ndarray
    node: TreeNode
    window_lo: np.ndarray
    state_slot: int
    branch: int = 0


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode
    new_pages: int  # pages of the insert the tree took ownership of
    duplicates: np.ndarray  # the inserter's virtual pages the tree already had: the inserter frees them
    state_taken: bool


@dataclass
class Evicted:
    """Pages per sub-pool an eviction (planned or done) gives back."""

    pages: dict[str, int]

    def add(self, name: str, n: int) -> None:
        self.pages[name] = self.pages.get(name, 0) + n


class UnifiedRadixCache:
    def __init__(self, storage: KVStorage, strategy: CheckpointStrategy = CheckpointStrategy.EXTRA_BUFFER,
                 checkpoint_interval: int | None = None) -> None:
        self.storage = storage
        self.plan = storage.plan
        self.ps = storage.page_size
        self.windows = [p for p in self.plan.sub_pools if p.kind is PoolKind.WINDOW]
        reach = max((w.window for w in self.windows), default=0)
        self._release_step = -(-max(self.ps, reach // 8) // self.ps) * self.ps  # whole pages
        self.state = self.plan.state
        self.strategy = strategy
        if not isinstance(strategy, CheckpointStrategy):
            raise InputError(f"strategy must be a CheckpointStrategy, got {strategy!r}")
        if checkpoint_interval is not None and not is_integer(checkpoint_interval):
            raise InputError(f"checkpoint_interval must be None or an integer number of tokens, "
                             f"got {checkpoint_interval!r}")
        if self.state is not None and strategy is not CheckpointStrategy.NO_BUFFER and (
                not checkpoint_interval or checkpoint_interval % self.ps):
            raise InputError(
                f"checkpointed state needs a checkpoint interval that is a whole number of pages "
                f"(page size {self.ps}), got {checkpoint_interval}")
        self.checkpoint_interval = checkpoint_interval if self.state is not None else None
        self.slots = self._index_slots()
        self.root = TreeNode(None, np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64), len(self.windows), 0)
        self._clock = itertools.count(1)
        # what the tree holds and what of it locks protect, per sub-pool (chain order), kept in step
        # by `_account` around every change to a node: reclaimable pages are held - locked
        self._band_of = {p.name: p.index for p in self.plan.sub_pools}
        self._held = [0] * len(self.plan.sub_pools)
        self._locked = [0] * len(self.plan.sub_pools)
        self._owner_i = self.plan.owner.index
        self._window_i = [w.index for w in self.windows]
        self._state_i = self.state.index if self.state is not None else -1
        self.stats = {"inserted_pages": 0, "matched_tokens": 0, "evicted_pages": 0, "evicted_window_pages": 0,
                      "evicted_state_slots": 0, "checkpoints": 0, "checkpoint_stalls": 0}
        #: called as `on_evict(kind, node)` before an eviction frees anything (a host tier backs
        #: the node up there: `kvchain.sim.host_tier`)
        self.on_evict = None
        #: on a model with state, evict first what can end no match: leaves that hold no state (a
        #: match ends only where a state is held, WIN-9: the pages a request left past its last
        #: checkpoint), and a state a request's later checkpoint in its own output superseded
        #: (`supersede_output_checkpoint`). Engines that evict by recency alone turn it off
        #: (`kvchain.sim.baselines`: `vllm-hybrid`, `sglang-static`)
        self.unmatchable_first = True
        #: called as `reuse()` when an eviction is planned: {id(node): rank} for the nodes a known
        #: future match needs (rank 0 soonest); those go after every other victim, the one needed
        #: latest first (`kvchain.sim.waiting.WaitingReuse`). None: plain LRU
        self.reuse = None
        #: the node whose state an admission has matched and not yet copied into its row
        #: (`hold_state_for_copy`): neither an eviction victim nor reclaimable meanwhile
        self.copying: TreeNode | None = None

    def _index_slots(self) -> list[str]:
        """Sub-pool names in `tree_slots` order: full, the primary window (the generic window slot),
        other windows longest first, state (WIN-2, WIN-3)."""
        return [self.plan.sub_pools[i].name for i in self.plan.tree_slots]

    # -- walking ----------------------------------------------------------------------------------

    def _page_key(self, tokens: np.ndarray, page: int) -> bytes:
        return tokens[page * self.ps : (page + 1) * self.ps].tobytes()

    def path_pages(self, tokens: np.ndarray) -> int:
        """Whole pages of `tokens` the tree holds along their path, usable as a match or not: a
        model with windows matches only where every window's rows behind the end are bound (WIN-9),
        and the tree evicts window rows apart from the full-attention pages."""
        return sum(k for _node, k in self._walk(tokens))

    def _walk(self, tokens: np.ndarray) -> list[tuple[TreeNode, int]]:
        """The path `tokens` follows: (node, pages of the node matched), page-granular."""
        path = []
        node = self.root
        n_pages = len(tokens) // self.ps
        page = 0
        while page < n_pages:
            child = node.children.get(self._page_key(tokens, page))
            if child is None:
                break
            m = min(child.n_pages, n_pages - page)
            same = (child.key[: m * self.ps].reshape(m, self.ps)
                    == tokens[page * self.ps : (page + m) * self.ps].reshape(m, self.ps)).all(axis=1)
            k = m if same.all() else int(np.argmin(same))
            path.append((child, k))
            page += k
            if k < child.n_pages:
                break
            node = child
        return path

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split `node` after its first `k` pages; returns the new upper node."""
        ps = self.ps
        self._account(node, -1)
        upper = TreeNode(node.parent, node.key[: k * ps], node.vpages[:k], len(self.windows), node.start)
        upper.window_lo = np.minimum(node.window_lo, k)
        upper.lock_ref = node.lock_ref
        upper.window_lock = node.window_lock
        upper.last_access = node.last_access
        upper.hits = node.hits
        node.parent.children[node.key[:ps].tobytes()] = upper
        node.key = node.key[k * ps :]
        node.vpages = node.vpages[k:]
        node.window_lo = np.maximum(node.window_lo - k, 0)
        node.start += k * ps
        node.parent = upper
        upper.children[node.key[:ps].tobytes()] = node
        self._account(upper, 1)
        self._account(node, 1)
        return upper

    # -- matching ---------------------------------------------------------------------------------

    def match_prefix(self, tokens: np.ndarray) -> MatchResult:
        """The longest usable prefix of `tokens` (WIN-9/10: a model with state matches only at a
        node holding state; every window's rows behind the end must be bound). Splits a node when
        the match ends inside it, so the caller can lock exactly the prefix. InputError for token
        ids that are not integers or lie outside the int32 range the tree keys."""
        tokens = token_ids(tokens, "match_prefix")
        path = self._walk(tokens)
        shared = sum(k for _n, k in path) * self.ps
        grid = self.checkpoint_interval
        branch = shared // grid * grid if grid else 0
        empty = MatchResult(0, np.empty(0, dtype=np.int64), self.root,
                            np.zeros(len(self.windows), dtype=np.int64), -1, branch)
        if not path:
            return empty
        vpages = np.concatenate([n.vpages[:k] for n, k in path])
        bound = [np.concatenate([np.arange(k) >= n.window_lo[w] for n, k in path]) for w in range(len(self.windows))]
        covered = self._covered_ends(bound, len(vpages))
        for end_page, node_index in self._candidate_ends(path, covered):
            node, k = path[node_index]
            if k < node.n_pages:
                node = self._split(node, k)
            stamp = next(self._clock)
            walker = node
            while walker is not None:
                walker.last_access = stamp
                walker.hits += 1
                walker = walker.parent
            node.state_used = stamp
            window_lo = np.array([_first_bound_of_suffix(b[:end_page]) for b in bound], dtype=np.int64)
            self.stats["matched_tokens"] += end_page * self.ps
            state = node.state_slot if self.state is not None else -1
            length = end_page * self.ps
            return MatchResult(length, vpages[:end_page].copy(), node, window_lo, state,
                               branch if branch > length else 0)
        return empty

    def match_needs(self, tokens: np.ndarray) -> list[TreeNode]:
        """The nodes the match `match_prefix(tokens)` would find now needs kept: the node it ends in
        (its pages, its state) and those holding the window rows behind its end. Changes nothing
        (no split, no recency): what a known future match protects from eviction (`reuse`)."""
        tokens = token_ids(tokens, "match_needs")
        path = self._walk(tokens)
        if not path:
            return []
        n_pages = sum(k for _n, k in path)
        bound = [np.concatenate([np.arange(k) >= n.window_lo[w] for n, k in path]) for w in range(len(self.windows))]
        for end_page, node_index in self._candidate_ends(path, self._covered_ends(bound, n_pages)):
            floor = self._window_floor(end_page * self.ps)
            needs = [path[node_index][0]]
            for node, _k in path[node_index - 1 :: -1] if node_index else ():
                if node.start + node.n_pages * self.ps <= floor:
                    break
                needs.append(node)
            return needs
        return []

    def _candidate_ends(self, path: list[tuple[TreeNode, int]], covered: np.ndarray) -> Iterator[tuple[int, int]]:
        """(end page, index of the node it ends in) of the ends whose windows are covered, longest first."""
        offsets = np.cumsum([0] + [k for _n, k in path])
        if self.state is None:
            # any page end will do: the covered ones, longest first, each in the node holding it
            ends = np.flatnonzero(covered[1:])[::-1] + 1
            for end, i in zip(ends.tolist(), (np.searchsorted(offsets, ends, side="left") - 1).tolist()):
                yield end, i
            return
        for i in range(len(path) - 1, -1, -1):
            node, k = path[i]
            # state exists only at node ends that hold a slot, and only a fully matched node ends
            if k == node.n_pages and node.state_slot >= 0 and covered[offsets[i + 1]]:
                yield int(offsets[i + 1]), i

    def _covered_ends(self, bound: list[np.ndarray], n_pages: int) -> np.ndarray:
        """covered[e]: every window has its rows bound for the `window` tokens before page end e, so
        a match may end there; one pass per window over the path instead of one per candidate end."""
        covered = np.ones(n_pages + 1, dtype=bool)
        covered[0] = False
        if not n_pages:
            return covered
        ends = np.arange(1, n_pages + 1)
        for w, pool in enumerate(self.windows):
            # the last unbound page at or before each page; an end is covered when it lies before
            # the first page the window needs
            last_unbound = np.maximum.accumulate(np.where(bound[w], -1, np.arange(n_pages)))
            need_from = window_keep_from(ends * self.ps, pool.window, pool.lifetime.chunked) // self.ps
            covered[1:] &= last_unbound < need_from
        return covered

    def swa_retain_floor(self, length: int, shares_prefixes: bool = True) -> int | None:
        """The checkpoint behind which a request's windows are kept (WIN-11): the latest grid point at
        or before `length`, when the cache shares prefixes and checkpoints state (WIN-12); None when
        no floor applies. Retirement keeps each window's rows from `floor - window` on."""
        if not shares_prefixes or self.checkpoint_interval is None:
            return None
        return (length // self.checkpoint_interval) * self.checkpoint_interval

    def name_loaded_window_rows_by_owner(self, sub_pool: str, reservation, vpages: np.ndarray) -> None:
        """A host-tier load's window rows, reserved in `sub_pool` (`KVStorage.alloc_load`), now belong
        to owner virtual pages `vpages`: bind them and end the reservation, so they may move (HIC-6)."""
        self.storage.bind_window(sub_pool, vpages, reservation.pages)
        self.storage.end_load_reservations(sub_pool, reservation)

    # -- accounting -------------------------------------------------------------------------------------

    def _account(self, node: TreeNode, sign: int) -> None:
        """Add (`sign` 1) or remove (-1) a node's pages to what the tree holds and what its locks
        protect; called around every change to a node."""
        n = node.n_pages
        held, locked = self._held, self._locked
        held[self._owner_i] += sign * n
        if node.lock_ref > 0:
            locked[self._owner_i] += sign * n
        protect = node.lock_ref > 0 and node.window_lock > 0
        rows = 0
        for w, index in enumerate(self._window_i):
            bound = n - int(node.window_lo[w])
            rows += bound
            held[index] += sign * bound
            if protect:
                locked[index] += sign * bound
        if sign > 0:
            node.window_held = rows
        if node.state_slot >= 0:
            held[self._state_i] += sign
            if node is self.copying:
                locked[self._state_i] += sign

    # -- locks ----------------------------------------------------------------------------------------

    def hold_state_for_copy(self, node: TreeNode | None) -> None:
        """Keep `node`'s state (None: give the hold back) from eviction until an admission has
        copied it into its row. A lock keeps a path's pages, not its states; the room an admission
        makes for itself (and its own take) could otherwise evict the state it matched, whose slot
        id the take may then hand to the admitted row, which would copy the slot onto itself and
        start from bytes that are not the checkpoint's."""
        old = self.copying
        if old is node:
            return
        if old is not None:
            self._account(old, -1)
            self.copying = None
            self._account(old, 1)
        if node is not None:
            self._account(node, -1)
            self.copying = node
            self._account(node, 1)

    def lock(self, node: TreeNode) -> None:
        """A running request reads the path to `node`: none of it may be evicted whole."""
        while node is not None and node is not self.root:
            self._account(node, -1)
            node.lock_ref += 1
            self._account(node, 1)
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Give back a `lock(node)`. InvariantError, changing no count, when a node on the path holds
        no lock to give back (an unlock without its lock, or a second one)."""
        walker = node
        while walker is not None and walker is not self.root:
            if walker.lock_ref <= 0:
                raise InvariantError("tree.lock_balance", f"unlock of {node}: {walker} on its path holds no lock "
                                     "(an unlock without its lock, or a second one)")
            walker = walker.parent
        while node is not None and node is not self.root:
            self._account(node, -1)
            node.lock_ref -= 1
            self._account(node, 1)
            node = node.parent

    def lock_window(self, node: TreeNode, length: int) -> WindowLock | None:
        """Lock the window rows a request at `length` tokens (a match ending at `node`) still reads:
        the pages from where its widest window begins. The node straddling that point is split
        first, so the rows before it stay reclaimable. None when the request reads none of them."""
        floor = self._window_floor(length)
        if node is self.root or node.start + node.n_pages * self.ps <= floor:
            return None
        self._split_at(node, floor)
        lock = WindowLock(node, floor, self._release_length(floor))
        self._add_window_lock(lock, 1)
        return lock

    def advance_window(self, lock: WindowLock | None, length: int) -> WindowLock | None:
        """The request holding `lock` now stands at `length` tokens: give back the rows its windows
        have left behind, in steps of about an eighth of the widest window (each step splits at most
        one node; between steps this is one comparison). Returns the lock that remains (None once
        the request reads none of the tree's rows)."""
        if lock is None or length < lock.recheck:
            return lock
        floor = self._window_floor(length)
        node = lock.node
        if node.start + node.n_pages * self.ps <= floor:
            self.unlock_window(lock)
            return None
        self._split_at(node, floor)
        rest = WindowLock(node, floor, self._release_length(floor))
        self.unlock_window(lock)
        self._add_window_lock(rest, 1)
        return rest

    def unlock_window(self, lock: WindowLock | None) -> None:
        self._add_window_lock(lock, -1)

    def _window_floor(self, length: int) -> int:
        """The first token (rounded down to a page) any window of a request at `length` reads: the
        same point its own row retires window rows up to (a chunked window reads from its chunk's
        start, not `window` tokens back)."""
        if not self.windows:
            return length // self.ps * self.ps
        keep = min(int(window_keep_from(length, w.window, w.lifetime.chunked)) for w in self.windows)
        return keep // self.ps * self.ps

    def _release_length(self, floor: int) -> int:
        """The first length at which every window reads nothing before `floor` plus a release step."""
        target = floor + self._release_step
        return max(-(-target // w.window) * w.window if w.lifetime.chunked else target + w.window
                   for w in self.windows)

    def _split_at(self, node: TreeNode, floor: int) -> None:
        """Split the node on the path to `node` that straddles token `floor`, if any."""
        walker = node
        while walker is not self.root and walker.start > floor:
            walker = walker.parent
        if walker is not self.root and walker.start < floor:
            self._split(walker, (floor - walker.start) // self.ps)

    def _add_window_lock(self, lock: WindowLock | None, sign: int) -> None:
        """Walk the nodes from `lock.node` up to its floor. Splits since the lock was taken copied
        its count to both halves, and both lie on this walk, so the walk always finds exactly the
        nodes that carry it."""
        if lock is None:
            return
        if sign < 0:  # an unlock: every node on the walk must hold a window lock to give back
            walker = lock.node
            while walker is not None and walker is not self.root and walker.start >= lock.floor:
                if walker.window_lock <= 0:
                    raise InvariantError("tree.lock_balance", f"window unlock of {lock.node} (floor {lock.floor}): "
                                         f"{walker} holds no window lock (a second unlock of the same lock?)")
                walker = walker.parent
        walker = lock.node
        while walker is not self.root and walker.start >= lock.floor:
            self._account(walker, -1)
            walker.window_lock += sign
            self._account(walker, 1)
            walker = walker.parent

    # -- inserting ------------------------------------------------------------------------------------

    def insert(self, tokens: np.ndarray, vpages: np.ndarray, window_lo: np.ndarray, state_slot: int = -1) -> InsertResult:
        """Insert whole pages of `tokens` held by `vpages`; each window binds the inserter's pages from
        `window_lo[w]` on. Pages the tree already holds come back as duplicates for the inserter to
        free; where the tree's window rows were evicted and the inserter's duplicates still bind
        them, they are rehomed onto the tree's pages without allocating (WIN-7). A state slot given
        for the end is taken unless the tree already has one there.

        InputError, with nothing changed, for token ids the tree cannot key (`token_ids`), fewer
        tokens than `len(vpages)` whole pages (tokens past them are left out), `vpages` the owner
        does not bind (or names twice), a `window_lo` that is not one integer per window, and a
        state slot on a plan without state or one the state sub-pool does not bind."""
        ps = self.ps
        tokens, vpages, window_lo, state_slot = self._insert_args(tokens, vpages, window_lo, state_slot)
        n_pages = len(vpages)
        tokens = tokens[: n_pages * ps]
        path = self._walk(tokens)
        node = self.root
        page = 0
        duplicates = []
        for child, k in path:
            if k < child.n_pages:
                child = self._split(child, k)
            seg = slice(page, page + k)
            mine = vpages[seg]
            dup = mine[mine != child.vpages]
            duplicates.append(dup)
            self._rehome(child, mine, [int(window_lo[w]) - page for w in range(len(self.windows))])
            node = child
            page += k
        new_pages = n_pages - page
        if new_pages:
            leaf = TreeNode(node, tokens[page * ps :].copy(), vpages[page:].copy(), len(self.windows), page * ps)
            leaf.window_lo = np.clip(window_lo - page, 0, new_pages)
            node.children[self._page_key(tokens, page)] = leaf
            self._account(leaf, 1)
            node = leaf
            self.stats["inserted_pages"] += new_pages
        stamp = next(self._clock)
        walker = node
        while walker is not None:
            walker.last_access = stamp
            walker = walker.parent
        taken = False
        if state_slot >= 0 and node is not self.root and node.state_slot < 0:
            self._account(node, -1)
            node.state_slot = state_slot
            node.state_used = stamp
            self._account(node, 1)
            taken = True
        dups = np.concatenate(duplicates) if duplicates else np.empty(0, dtype=np.int64)
        return InsertResult(node, new_pages, dups, taken)

    def _insert_args(self, tokens, vpages, window_lo, state_slot) -> tuple:
        """`insert`'s arguments checked (see there), before anything changes."""
        tokens = token_ids(tokens, "insert")
        vpages = boundary.id_array(vpages, "insert vpages")
        n = len(vpages)
        if len(tokens) < n * self.ps:
            raise InputError(f"insert tokens cover whole pages of {self.ps}: {n} vpages need {n * self.ps} "
                             f"tokens, got {len(tokens)}")
        chain = self.storage.allocator
        owner = chain.owner
        v2p = owner.ids.v2p
        if n:
            boundary.in_range(vpages, 0, len(v2p), "insert vpages")
            unbound = v2p[vpages] < 0
            if unbound.any():
                raise InputError(f"insert vpages {vpages[unbound][:8].tolist()} are not bound in "
                                 f"{self.plan.owner.name} (the owner): the tree holds only live pages")
            boundary.distinct(vpages, "insert vpages")
        window_lo = boundary.id_array(window_lo, "insert window_lo")
        if len(window_lo) != len(self.windows):
            raise InputError(f"insert window_lo holds one index per window ({len(self.windows)}), "
                             f"got {len(window_lo)}")
        state_slot = boundary.index(state_slot, "insert state_slot")
        if state_slot >= 0:
            if self.state is None:
                raise InputError(f"insert state_slot {state_slot}: the plan holds no state")
            slots = chain.state_band.ids.v2p
            if state_slot >= len(slots) or slots[state_slot] < 0:
                raise InputError(f"insert state_slot {state_slot} is not bound in {self.state.name}")
        return tokens, vpages, window_lo, state_slot

    def insert_running(self, row: int, tokens: np.ndarray, state_slot: int = -1) -> InsertResult | None:
        """Hand a running row's first `len(tokens)` tokens (whole pages) to the tree, with state
        `state_slot` at their end (-1: none): a checkpoint (WIN-14) or a prefilled prompt.

        Where the tree already holds part of that prefix under other pages (a sibling branch that
        was cached first and split off below it), the row moves onto the tree's pages, which hold
        the same tokens' KV, and frees its own copies; window rows the tree lacks but the row
        still binds are rehomed onto the tree's pages first (WIN-7). So the insert lands at the
        depth where the row's branch leaves the tree's, instead of being skipped, and the prefix is
        held once. The caller then releases the first pages to the tree
        (`KVStorage.release_to_tree`). None, with nothing changed, when the tree already has a
        state at that end (another request with the same prefix checkpointed it first)."""
        ps = self.ps
        table = self.storage.table
        tokens = token_ids(tokens, "insert_running")
        n = len(tokens) // ps
        tokens = tokens[: n * ps]
        mine = table.page_table[row, :n].copy()
        shared = int(table.shared_pages[row])
        path = self._walk(tokens)
        page = 0
        for child, k in path:
            differ = mine[page : page + k] != child.vpages[:k]
            if differ.any() and (not differ.all() or page < shared):
                # the row's tree-shared pages are locked and nodes never merge, so a node holds
                # either the row's pages or none of them
                raise InvariantError("tree.pages_live", f"row {row}: pages {page}..{page + k} of its "
                                     f"{shared} tree-shared pages are not the tree's")
            page += k
        if state_slot >= 0 and page == n and path and path[-1][1] == path[-1][0].n_pages \
                and path[-1][0].state_slot >= 0:
            return None  # the tree has this checkpoint already
        copies = []
        page = 0
        for child, k in path:
            if k < child.n_pages:
                child = self._split(child, k)
            seg = slice(page, page + k)
            if (mine[seg] != child.vpages).any():
                self._rehome(child, mine[seg], [int(table.window_lo[row, w]) - page for w in range(len(self.windows))])
                table.page_table[row, seg] = child.vpages
                copies.append(mine[seg])
            page += k
        if copies:
            self.storage.free_virtual_pages(np.concatenate(copies))
        return self.insert(tokens, table.page_table[row, :n].copy(), table.window_lo[row], state_slot)

    def _rehome(self, node: TreeNode, mine: np.ndarray, inserter_lo: list[int]) -> None:
        """Where the node's window rows are gone but the inserter's duplicate pages bind them from some
        page on up to the node's first bound page, move those bindings onto the node's pages."""
        k = len(mine)
        for w, pool in enumerate(self.windows):
            have = int(node.window_lo[w])
            start = max(inserter_lo[w], 0)
            if start >= have or have > k:
                continue  # nothing to revive, or the revived rows would not reach the node's bound tail
            dst = node.vpages[start:have]
            src = mine[start:have]
            same = src == dst
            if same.all():
                continue
            if same.any():
                continue  # mixed ownership: leave the tree as it is
            self.storage.rehome_window(pool.name, src, dst)
            self._account(node, -1)
            node.window_lo[w] = start
            self._account(node, 1)

    # -- eviction ------------------------------------------------------------------------------------

    def supersede_output_checkpoint(self, node: TreeNode, output_start: int) -> None:
        """A running request just checkpointed at `node`'s end, past its prompt: the nearest state
        above it on its path, if it too lies past token `output_start` (in the request's own
        output, so on a path no other request shares), can end no match any more (the next turn
        reaches the deeper one), and its slot goes before every other state
        (`unmatchable_first`). A checkpoint inside the prompt may be where another request's
        prompt leaves this one (a shared system prompt), so it ages as before."""
        if not self.unmatchable_first:
            return
        walker = node.parent
        while walker is not None and walker is not self.root and walker.state_slot < 0:
            walker = walker.parent
        if walker is not None and walker is not self.root and walker.start + walker.n_pages * self.ps > output_start:
            walker.state_used = 0

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def held_pages(self) -> dict[str, int]:
        """Live pages per sub-pool the tree owns (for the idle leak check)."""
        return {p.name: self._held[p.index] for p in self.plan.sub_pools}

    def _recount(self) -> tuple[dict[str, int], dict[str, int]]:
        """Held and reclaimable pages recomputed from every node (what the counters must equal)."""
        held = {p.name: 0 for p in self.plan.sub_pools}
        owner = self.plan.owner.name
        for node in self._nodes():
            held[owner] += node.n_pages
            for w, pool in enumerate(self.windows):
                held[pool.name] += node.n_pages - int(node.window_lo[w])
            if node.state_slot >= 0:
                held[self.state.name] += 1
        out = {p.name: 0 for p in self.plan.sub_pools}
        owner_name = self.plan.owner.name
        for node in self._nodes():
            if node.lock_ref == 0:
                out[owner_name] += node.n_pages
            if node.lock_ref == 0 or node.window_lock == 0:
                for w, pool in enumerate(self.windows):
                    out[pool.name] += node.n_pages - int(node.window_lo[w])
            if node.state_slot >= 0 and node is not self.copying:
                out[self.state.name] += 1
        return held, out

    def verify(self) -> None:
        """Every page a node holds is still live where the node says it is: the owner binds every
        virtual page, each window binds the pages from its `window_lo` on, a state slot is bound, and
        no virtual page is held twice. A match can then never hand out freed pages."""
        chain = self.storage.allocator
        seen: set[int] = set()
        problems = []
        for node in self._nodes():
            v = node.vpages
            if (chain.owner.ids.v2p[v] < 0).any():
                problems.append(f"{node}: owner pages unbound")
            if seen.intersection(v.tolist()):
                problems.append(f"{node}: a virtual page is held twice")
            seen.update(v.tolist())
            for w, pool in enumerate(self.windows):
                band = chain.bands[pool.index]
                if (band.ids.v2p[v[int(node.window_lo[w]):]] < 0).any():
                    problems.append(f"{node}: {pool.name} rows it claims are unbound")
            if node.state_slot >= 0 and chain.state_band.ids.v2p[node.state_slot] < 0:
                problems.append(f"{node}: state slot unbound")
            if node.lock_ref < 0 or node.window_lock < 0:
                problems.append(f"{node}: negative lock")
            if node.window_held != int((node.n_pages - node.window_lo).sum()):
                problems.append(f"{node}: window rows miscounted ({node.window_held})")
        held, reclaimable = self._recount()
        if held != self.held_pages() or reclaimable != self.reclaimable():
            problems.append(f"counters drifted: held {self.held_pages()} vs {held}, "
                            f"reclaimable {self.reclaimable()} vs {reclaimable}")
        if problems:
            raise InvariantError("tree.pages_live", "; ".join(problems[:5]))

    def reclaimable(self) -> dict[str, int]:
        """Pages per sub-pool eviction could give back now: unlocked subtrees whole, window rows no
        request reads, every state slot but the one an admission is copying (ADM-6)."""
        return {p.name: self._held[p.index] - self._locked[p.index] for p in self.plan.sub_pools}

    def _victims(self) -> Iterator[tuple[str, TreeNode]]:
        """Planned evictions, least recently used first: ('leaf', n) unlocked leaves whole (a parent
        becomes a candidate once all its children are planned away) and ('window', n) window rows
        no request reads, among nodes no match has reused yet and then among reused ones (a prefix
        that proved shared outlives one-off content); ('state', n) state slots by when the state
        itself was last taken or matched. A path's recency is refreshed by every match below it,
        but a checkpoint a deeper one has superseded (the previous turn's, on a path the
        conversation has since extended) is no longer matched: it ages on its own and goes before
        the pages and states still in use. On a model with state, leaves without a state go before
        all of these (`unmatchable_first`). Nothing is freed while planning."""
        # only nodes that can give something now start in the heap (a running request's nodes
        # mostly cannot); an unlocked parent joins once its children are planned away
        reuse = self.reuse() if self.reuse is not None else {}
        unmatchable = self.state is not None and self.unmatchable_first
        def tier(n: TreeNode) -> int:  # 0: no known reuse; then the reuse needed latest first
            rank = reuse.get(id(n))
            return 0 if rank is None else _REUSE_TIERS - rank

        def rank(n: TreeNode, leaf: bool) -> tuple:
            # a leaf that can end no match goes first, whatever its recency (`unmatchable_first`)
            dead = leaf and unmatchable and n.state_slot < 0
            return (not dead, tier(n), min(n.hits, 1), n.last_access, n.seq, False, n)

        heap = [rank(n, not n.children) for n in self._nodes()
                if (n.lock_ref == 0 and not n.children) or (n.window_lock == 0 and n.window_held)]
        heap += [(True, tier(n), 0, n.state_used, n.seq, True, n) for n in self._nodes()
                 if n.state_slot >= 0 and n is not self.copying]
        heapq.heapify(heap)
        planned_away: dict[int, int] = {}  # children planned away, per parent
        window_done: set[int] = set()
        state_done: set[int] = set()
        gone: set[int] = set()
        while heap:
            *_, state_entry, node = heapq.heappop(heap)
            key = id(node)
            if key in gone:
                continue
            if state_entry:
                if key not in state_done:
                    state_done.add(key)
                    yield "state", node
                continue
            if node.lock_ref == 0 and len(node.children) == planned_away.get(key, 0):
                gone.add(key)
                yield "leaf", node
                window_done.add(key)
                state_done.add(key)
                parent = node.parent
                if parent is not None and parent is not self.root:
                    up = planned_away[id(parent)] = planned_away.get(id(parent), 0) + 1
                    if up == len(parent.children) and parent.lock_ref == 0:
                        heapq.heappush(heap, rank(parent, True))
                continue
            if key not in window_done and node.window_lock == 0 and node.window_held:
                window_done.add(key)
                yield "window", node

    def evict(self, wanted, max_steps: int = 1 << 30) -> Evicted:
        """Evict in LRU order until `wanted(freed pages per sub-pool)` says enough: the walk is
        priced before anything is freed and stops at the first yes (ADM-8). Returns what it freed
        (nothing when no eviction would be enough)."""
        plan: list[tuple[str, TreeNode]] = []
        planned = Evicted({})
        counted: dict[int, set[str]] = {}  # per node, what earlier steps of the plan already freed
        enough = wanted(planned.pages)
        if not enough:
            for kind, node in self._victims():
                if len(plan) >= max_steps:
                    break
                plan.append((kind, node))
                self._count(kind, node, planned, counted.setdefault(id(node), set()))
                if wanted(planned.pages):
                    enough = True
                    break
        freed = Evicted({})
        if not enough:
            return freed
        for kind, node in plan:
            self._evict(kind, node, freed)
        return freed

    def _count(self, kind: str, node: TreeNode, out: Evicted, done: set[str]) -> None:
        """Add what evicting `node` as `kind` frees to `out`; a leaf planned after its window rows
        or its state were counts them once (`done`: what the plan already freed there)."""
        if kind in ("leaf", "window") and "window" not in done:
            done.add("window")
            for w, pool in enumerate(self.windows):
                out.add(pool.name, node.n_pages - int(node.window_lo[w]))
        if kind == "leaf":
            out.add(self.plan.owner.name, node.n_pages)
        if node.state_slot >= 0 and kind in ("leaf", "state") and "state" not in done:
            done.add("state")
            out.add(self.state.name, 1)

    def _evict(self, kind: str, node: TreeNode, freed: Evicted) -> None:
        storage = self.storage
        if self.on_evict is not None:
            self.on_evict(kind, node)
        self._account(node, -1)
        if kind in ("leaf", "window"):
            for w, pool in enumerate(self.windows):
                lo = int(node.window_lo[w])
                if lo < node.n_pages:
                    storage.free_window_rows(pool.name, node.vpages[lo:])
                    self.stats["evicted_window_pages"] += node.n_pages - lo
                    freed.add(pool.name, node.n_pages - lo)
                    node.window_lo[w] = node.n_pages
        if (kind == "leaf" or kind == "state") and node.state_slot >= 0:
            storage.free_state_slots(np.array([node.state_slot]))
            node.state_slot = -1
            self.stats["evicted_state_slots"] += 1
            freed.add(self.state.name, 1)
        if kind == "leaf":
            storage.free_virtual_pages(node.vpages)
            self.stats["evicted_pages"] += node.n_pages
            freed.add(self.plan.owner.name, node.n_pages)
            del node.parent.children[node.key[: self.ps].tobytes()]
            node.parent = None
            return
        self._account(node, 1)

    def evict_all(self) -> Evicted:
        """Evict everything no request locks (tests, shutdown)."""
        freed = Evicted({})
        for kind, node in list(self._victims()):
            self._evict(kind, node, freed)
        return freed


def _first_bound_of_suffix(flags: np.ndarray) -> int:
    """The first index of the trailing run of True in `flags` (len(flags) when it ends in False)."""
    if not len(flags) or not flags[-1]:
        return len(flags)
    false = np.flatnonzero(~flags)
    return int(false[-1]) + 1 if len(false) else 0

