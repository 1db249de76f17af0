"""kvchain's optional waiting order (`--waiting-order longest-prefix`; first come first served is
the default): the waiting request whose prompt the prefix tree holds most of goes first (a
longest-prefix-match order, as sglang's `lpm` schedule policy), among the first `LOOKAHEAD`
waiting requests, ties first come first served, and a request overtaken `MAX_OVERTAKEN` times
goes next whatever it matches. It raises hit rates on 18 of the 20 rows of docs/simulate.md's
table but costs whole-run steps on 7, so it is not the default.

Why: on multi-turn chat under a binding budget, a turn often arrives while requests ahead of it
in the queue share nothing with the tree, and by the time first come first served reaches it,
its previous turn's pages have been evicted to make room for those strangers. Admitting it while
its prefix is still cached turns the prefill it would recompute into a hit, and the memory the
hit saves is what the strangers then run in (Gemma 3 27B, 16 GiB, 100 chat requests: 28.8% hits
and 16,503 steps first come first served, 48.4% and 16,391 in this order without the bound).

The bound is there because a whole run's steps are often set by one long request: unbounded,
requests that share nothing are overtaken until the end, and gpt-oss-120b on 300 mixed requests
took 12,324 steps against 11,794 first come first served (16 overtakes: 11,935; 4: 11,797).

The match length is what a walk of the tree finds (`UnifiedRadixCache._walk`, which changes
nothing), cut back to the deepest node holding a state on a model with recurrent state; windows
are not checked, so it is an estimate of the hit, used for the order only. It is kept per request
until the tree's contents change (pages inserted or evicted, a state slot taken or given back),
so a step whose tree did not change walks nothing.

With `--eviction waiting-aware` as well (`LongestPrefixScheduler` is a `ReuseAwareScheduler`), the
request the order moves ahead cannot evict the prefix of one it made wait: on multi-turn chat that
puts kvchain's hit rate above vllm-hybrid's on the four presets docs/simulate.md measures, but it
costs steps on two of their eight rows, so neither is the default."""

from __future__ import annotations

from ..engine.request import ScheduledRequest
from ..engine.scheduler import Scheduler

#: waiting orders (`PoolConfig.waiting_order`, `--waiting-order`)
WAITING_ORDERS = ("longest-prefix", "fcfs")
#: waiting requests the order looks at from the head (sglang turns `lpm` off past 128 waiting)
LOOKAHEAD = 64
#: a waiting request overtaken this many times goes next, whatever the others match: bounded
#: unfairness, so a request that shares nothing (a long document, a long answer) is not pushed
#: to the end of a run whose length it then sets
MAX_OVERTAKEN = 4


#: how the prefix tree picks what to evict (`PoolConfig.eviction`, `--eviction`): least recently
#: used alone, or with what waiting requests will match kept until last (`WaitingReuse`)
EVICTION_ORDERS = ("waiting-aware", "lru")


class WaitingReuse:
    """What the waiting queue will match, for the tree's eviction order (`UnifiedRadixCache.reuse`):
    the nodes each of the first `LOOKAHEAD` waiting requests' matches need (the node it ends in,
    its state, the window rows behind its end), ranked by queue position.

    Why: a request admitted after every waiting one (any request not yet arrived, under first come
    first served) reuses nothing sooner than they do, so evicting everything else before what
    they will match evicts the content needed latest first. Least recently used alone evicts a
    waiting turn's previous turn (finished long ago, so old) for a stranger's first chunk, and the
    turn then recomputes it. Among the waiting, the last in the queue gives way first. Asked only
    when an eviction is planned; it walks the tree for each of those requests (`match_needs`)."""

    def __init__(self, scheduler: Scheduler, tree) -> None:
        self.scheduler = scheduler
        self.tree = tree
        self.lookahead = LOOKAHEAD

    def __call__(self) -> dict[int, int]:
        ranks: dict[int, int] = {}
        for i, req in enumerate(self.scheduler.waiting):
            if i >= self.lookahead:
                break
            for node in self.tree.match_needs(req.tokens(max(req.input_len - 1, 0))):
                ranks.setdefault(id(node), i)
        return ranks


class ReuseAwareScheduler(Scheduler):
    """The scheduler loop with the pool's prefix tree told what waiting requests will match, when
    the pool's `eviction` is `waiting-aware` (`WaitingReuse`); the loop itself is unchanged."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tree = getattr(self.pool, "tree", None)
        if tree is not None and getattr(self.pool, "eviction", "lru") == "waiting-aware":
            tree.reuse = WaitingReuse(self, tree)


class LongestPrefixScheduler(ReuseAwareScheduler):
    """The scheduler loop with the waiting head chosen by cached prefix length (module doc).
    Under priority scheduling priority still comes first; the prefix decides among equals."""

    lookahead = LOOKAHEAD
    max_overtaken = MAX_OVERTAKEN

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._memo: dict[ScheduledRequest, tuple[tuple, int]] = {}
        self._overtaken: dict[ScheduledRequest, int] = {}

    def _tree_version(self, tree) -> tuple:
        """Changes whenever a walk's answer may: pages inserted or evicted, state slots held."""
        stats = tree.stats
        state = tree._held[tree._state_i] if tree._state_i >= 0 else 0
        return stats["inserted_pages"], stats["evicted_pages"], stats["evicted_state_slots"], state

    def cached_len(self, req: ScheduledRequest) -> int:
        """Tokens of `req`'s prompt the tree holds (estimate: module doc)."""
        tree = getattr(self.pool, "tree", None)
        if tree is None:
            return 0
        version = (self._tree_version(tree), req.input_len)
        memo = self._memo.get(req)
        if memo is not None and memo[0] == version:
            return memo[1]
        path = tree._walk(req.tokens(max(req.input_len - 1, 0)))
        length = 0
        pages = 0
        for node, k in path:
            pages += k
            if tree.state is None or (k == node.n_pages and node.state_slot >= 0):
                length = pages
        length *= tree.ps
        self._memo[req] = (version, length)
        return length

    def _next_waiting(self) -> ScheduledRequest:
        if len(self.waiting) < 2 or getattr(self.pool, "tree", None) is None:
            return super()._next_waiting()
        best, best_key, best_i = None, None, 0
        overtaken = self._overtaken
        for i, req in enumerate(self.waiting):
            if i >= self.lookahead:
                break
            due = overtaken.get(req, 0) >= self.max_overtaken
            key = (req.priority if self.priority else 0, not due, 0 if due else -self.cached_len(req), i)
            if best_key is None or key < best_key:
                best, best_key, best_i = req, key, i
        if best_i:
            for i, req in enumerate(self.waiting):
                if i >= best_i:
                    break
                overtaken[req] = overtaken.get(req, 0) + 1
            self.waiting.remove(best)
            self.waiting.appendleft(best)
        return best

    def step(self):
        record = super().step()
        if len(self._memo) + len(self._overtaken) > 4 * self.lookahead:  # forget requests no longer waiting
            waiting = set(self.waiting)
            self._memo = {r: v for r, v in self._memo.items() if r in waiting}
            self._overtaken = {r: v for r, v in self._overtaken.items() if r in waiting}
        return record


def scheduler_class(pool) -> type[Scheduler]:
    """The loop `pool` is run with: its `waiting_order` (kvchain's pools), else first come first served."""
    if getattr(pool, "waiting_order", "fcfs") == "longest-prefix":
        return LongestPrefixScheduler
    return ReuseAwareScheduler if getattr(pool, "eviction", "lru") == "waiting-aware" else Scheduler
