"""Where prefix hits are lost: every first admission's match set against the deepest prefix of its
prompt the tree had held before it, and for the tokens between, the eviction that took them.

For each request's first admission the trace records the deepest page end of its prompt the tree
had ever held before (with recurrent state: held with a state at that end), the tokens it matched,
and for the loss the first eviction since that end was last inserted of its page, the window rows
behind it or its state: the kind (`leaf`, `window`, `state`), the step, what caused it (`admit`:
making room for an admission, `grow`: the running requests' growth, `checkpoint`), whether the
victim was protected by `--eviction waiting-aware`, and where the request stood then (not yet
arrived, or its place in the waiting queue). It wraps the tree's and the pool's methods of one
run (`trace_hits`); nothing it records changes a decision.

Prefixes are named by a chained hash of whole pages, so the trace costs a walk of each evicted
node's path: a diagnostic for a few hundred requests, not part of a normal run."""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field

import numpy as np

from ..engine.request import ScheduledRequest
from .waiting import scheduler_class


@dataclass(frozen=True)
class Eviction:
    step: int
    kind: str  # leaf, window or state
    cause: str  # admit, grow, checkpoint or other
    protected: bool  # the waiting-aware order had ranked the node (nothing else was left)
    waiting: tuple[int, ...]  # ids of the waiting requests then, in queue order


@dataclass(frozen=True)
class Admission:
    rid: int
    arrival: int
    step: int
    prompt: int
    matched: int
    held: int  # deepest prefix the tree held before (tokens)
    held_state: int  # the same with a state at its end (equals `held` without state)
    lost_to: Eviction | None  # the eviction that took `held_state - matched` tokens

    @property
    def lost(self) -> int:
        return max(0, self.held_state - self.matched)

    def when(self) -> str:
        """Where the request stood when its prefix was taken."""
        e = self.lost_to
        if e is None:
            return "no eviction found"
        if e.step < self.arrival:
            return "before it arrived"
        place = e.waiting.index(self.rid) if self.rid in e.waiting else None
        if place is None:
            return "not waiting"
        return ("while it waited, in the first 8" if place < 8 else
                "while it waited, in the first 64" if place < 64 else "while it waited, past the first 64")


@dataclass
class HitTrace:
    admissions: list[Admission] = field(default_factory=list)
    #: per step: bytes the tree holds, live bytes, running, waiting
    series: list[tuple[int, int, int, int]] = field(default_factory=list)
    budget_bytes: int = 0
    steps: int = 0

    def summary(self) -> dict:
        """Shares of all prompt tokens admitted: matched, held before admission, lost by cause and
        by when; the tree's share of the budget and running requests over steps with a queue."""
        prompt = max(1, sum(a.prompt for a in self.admissions))
        by_cause: collections.Counter = collections.Counter()
        by_when: collections.Counter = collections.Counter()
        for a in self.admissions:
            if not a.lost:
                continue
            e = a.lost_to
            by_cause["unattributed" if e is None else
                     f"{e.kind} by {e.cause}{', protected' if e.protected else ''}"] += a.lost
            by_when[a.when()] += a.lost
        ser = np.asarray(self.series, dtype=np.float64).reshape(-1, 4)
        queued = ser[ser[:, 3] > 0] if len(ser) and (ser[:, 3] > 0).any() else ser
        return {
            "steps": self.steps,
            "hit_rate": sum(a.matched for a in self.admissions) / prompt,
            "held_before_admission": sum(a.held for a in self.admissions) / prompt,
            "held_with_state": sum(a.held_state for a in self.admissions) / prompt,
            "lost_by_cause": {k: v / prompt for k, v in by_cause.most_common()},
            "lost_by_when": {k: v / prompt for k, v in by_when.most_common()},
            "cache_share_queued": float(queued[:, 0].mean() / self.budget_bytes) if len(queued) else 0.0,
            "running_queued": float(queued[:, 2].mean()) if len(queued) else 0.0,
            "waiting_mean": float(ser[:, 3].mean()) if len(ser) else 0.0,
            "queue_delay": float(np.mean([a.step - a.arrival for a in self.admissions])) if self.admissions else 0.0,
        }


def _chain(tokens: np.ndarray, ps: int) -> list[int]:
    """A hash per whole page of `tokens`, each naming the prefix that ends there."""
    out, h = [], 0
    for i in range(len(tokens) // ps):
        h = hash((h, tokens[i * ps:(i + 1) * ps].tobytes()))
        out.append(h)
    return out


def _path(node) -> np.ndarray:
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return np.concatenate(parts[::-1]) if parts else np.empty(0, np.int32)


def trace_hits(pool, requests: list[ScheduledRequest], *, max_batched_tokens: int = 8192,
               max_running: int = 256) -> HitTrace:
    """Run fresh copies of `requests` through `pool` (with a prefix tree) as `run_pool` does and
    trace every first admission's hit and loss (module doc)."""
    tree = pool.tree
    ps = tree.ps
    reach = max((w.window for w in tree.windows), default=0) // ps + 1
    reqs = [copy.deepcopy(r) for r in requests]
    sched = scheduler_class(pool)(pool, max_batched_tokens=max_batched_tokens, max_running=max_running)
    sched.add(reqs)
    inserted: dict[int, int] = {}  # prefix hash -> step it was last inserted
    stated: set[int] = set()  # prefix hashes that have held a state
    evicted: dict[int, list[Eviction]] = collections.defaultdict(list)
    cause = ["other"]
    ranked: list[dict] = [{}]
    out = HitTrace(budget_bytes=pool.stats().budget_bytes)

    def note_insert(tokens, state: bool) -> None:
        hs = _chain(np.asarray(tokens), ps)
        for h in hs:
            inserted[h] = sched.step_no
        if state and hs:
            stated.add(hs[-1])

    insert, insert_running, evict_one, evict = tree.insert, tree.insert_running, tree._evict, tree.evict

    def traced_insert(tokens, vpages, window_lo, state_slot=-1):
        result = insert(tokens, vpages, window_lo, state_slot)
        note_insert(np.asarray(tokens)[: len(vpages) * ps], result.state_taken)
        return result

    def traced_insert_running(row, tokens, state_slot=-1):
        result = insert_running(row, tokens, state_slot)
        if result is not None:
            note_insert(tokens, state_slot >= 0)
        return result

    def traced_evict(wanted, max_steps=1 << 30):
        ranked[0] = tree.reuse() if tree.reuse is not None else {}
        return evict(wanted, max_steps)

    def traced_evict_one(kind, node, freed):
        e = Eviction(sched.step_no, kind, cause[0], id(node) in ranked[0], tuple(r.rid for r in sched.waiting))
        hs = _chain(_path(node), ps)
        if hs:
            if kind != "state":
                for h in hs[node.start // ps:]:
                    evicted[h].append(e)
            if kind == "state" or (kind == "leaf" and node.state_slot >= 0):
                evicted[hs[-1]].append(Eviction(e.step, "state", e.cause, e.protected, e.waiting))
        return evict_one(kind, node, freed)

    tree.insert, tree.insert_running, tree._evict, tree.evict = (traced_insert, traced_insert_running,
                                                                traced_evict_one, traced_evict)
    try_admit, extend, checkpoint = pool.try_admit, pool.extend, pool.checkpoint_into_tree

    def caused(name, fn):
        def wrapped(*args, **kwargs):
            before, cause[0] = cause[0], name
            try:
                return fn(*args, **kwargs)
            finally:
                cause[0] = before
        return wrapped

    def traced_admit(ctx, req, limit):
        first = req.preemptions == 0 and req.admitted_step < 0
        hs = _chain(req.tokens(max(req.input_len - 1, 0)), ps) if first else []
        a = caused("admit", try_admit)(ctx, req, limit)
        if first and a.decision.name == "ADMIT":
            held = max((i + 1 for i, h in enumerate(hs) if h in inserted), default=0)
            held_state = held if tree.state is None else max(
                (i + 1 for i, h in enumerate(hs) if h in stated), default=0)
            m = req.cached // ps
            lost_to = None
            if held_state > m:
                since = inserted.get(hs[held_state - 1], 0)
                span = hs[max(m, held_state - reach):held_state]
                lost_to = min((e for h in span for e in evicted.get(h, ()) if since <= e.step <= sched.step_no),
                              key=lambda e: e.step, default=None)
            out.admissions.append(Admission(req.rid, req.arrival, sched.step_no, req.input_len, req.cached,
                                            held * ps, held_state * ps, lost_to))
        return a

    pool.try_admit, pool.extend = traced_admit, caused("grow", extend)
    pool.checkpoint_into_tree = caused("checkpoint", checkpoint)
    while not sched.idle:
        sched.step()
        st = pool.stats()
        out.series.append((st.cached_bytes, st.live_bytes, len(sched.running), len(sched.waiting)))
    out.steps = sched.stats.steps
    return out
