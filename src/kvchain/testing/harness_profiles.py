"""Operation-mix profiles: what kind of sequence a seed draws (HARN-1, HARN-3).

One random mix reaches some hazards rarely: a move's source that a running forward still reads
and is then handed out, a page freed under a forward and taken again before it ends, state bytes
that an attention band grows over. A seed therefore draws a profile (`profile_for_seed`): a mix of
operations (`weights`), and scenario families spliced in at a rate, each a short run of ordinary
operations that builds one such situation: a forward launched, then maintenance or frees while it
runs, then takes. Every spliced operation is an ordinary one with ordinary `pick`s, so a sequence
stays a plain list that any subsequence of still runs (what shrinking relies on), and no family
knows of any fault."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .harness_config import OP_WEIGHTS, PROFILE_CYCLE, HarnessConfig, config_for_seed, make_op, random_op

__all__ = ["FAMILIES", "PROFILES", "PROFILE_CYCLE", "Profile", "generate_ops"]

Family = Callable[[random.Random, HarnessConfig], list[dict]]


def _ops(rng: random.Random, config: HarnessConfig, kinds: list[str]) -> list[dict]:
    return [make_op(k, rng, config) for k in kinds]


def _some(rng: random.Random, choices: tuple[str, ...], lo: int, hi: int) -> list[str]:
    return [rng.choice(choices) for _ in range(rng.randint(lo, hi))]


_TAKES = ("admit", "decode", "decode", "load")
_MAINTENANCE = ("flush", "flush", "compact", "relief", "relayout")


def moves_under_forward(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """Tokens to write, a forward launched, then flushes, compactions, reliefs or relocations
    while it runs (moving pages it reads), then takes that may reuse what the moves vacated."""
    kinds = [*_some(rng, ("admit", "decode"), 0, 1), "forward", *_some(rng, _MAINTENANCE, 1, 3),
             *_some(rng, _TAKES, 1, 3)]
    if rng.random() < 0.5:
        kinds.append("forward")
    return _ops(rng, config, kinds)


def compaction_under_decode(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """A short request finishes while a longer one decodes: the forwards in flight processed, two
    small requests admitted and written, the older freed (a negative pick counts from the
    newest), the survivor decoded with its forward running (a negative start puts the newest
    ready request first), then a flush or an end compaction packs its pages into the holes the
    finished one left, and small takes grow over the space the moves left."""
    ps = config.page_size
    ops = [{"op": "process", "advance": 0}, {"op": "process", "advance": 0},
           {"op": "admit", "len": rng.randint(2 * ps + 1, 3 * ps)}, {"op": "admit", "len": ps * rng.randint(1, 2)},
           {"op": "forward"}, {"op": "process", "advance": 0}, {"op": "free", "pick": -2},
           {"op": "decode", "k": 1, "start": -1}, {"op": "forward"},
           rng.choice(({"op": "flush"}, {"op": "compact", "end": 1, "fr": round(rng.uniform(0.3, 1.0), 2)}))]
    for kind in _some(rng, ("decode", "admit", "load"), 1, 2):
        if kind == "decode":
            ops.append({"op": "decode", "k": 1, "start": -1})
        elif kind == "admit":
            ops.append({"op": "admit", "len": rng.randint(1, 2 * ps)})
        else:
            ops.append({"op": "load", "pages": rng.randint(1, 2)})
    return ops


def frees_under_forward(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """The newest request decoded and its forward launched, then it (and maybe another) freed
    while the forward runs, new requests taking what they let go, and their forwards: the
    second reads what the first wrote and the rest of its last page, which must read zero."""
    ps = config.page_size
    return [rng.choice(({"op": "decode", "k": 1, "start": -1}, {"op": "admit", "len": rng.randint(1, 2 * ps)})),
            {"op": "forward"}, *({"op": "free", "pick": -1} for _ in range(rng.randint(1, 2))),
            *({"op": "admit", "len": rng.randint(1, 2 * ps)} for _ in range(rng.randint(1, 2))),
            {"op": "forward"}, {"op": "decode", "k": 8, "start": -1}, {"op": "forward"}]


def settles_under_forward(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """Frees under a running forward, then a relief or relocation that settles the pending pages
    early, then takes."""
    kinds = ["forward", *_some(rng, ("free",), 1, 2), *_some(rng, ("relief", "compact", "relayout"), 1, 2),
             *_some(rng, _TAKES, 1, 2)]
    return _ops(rng, config, kinds)


def state_churn(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """State slots written and let go, so the state band shrinks and its neighbour grows over
    bytes last written as state: requests admitted and written (their forward writes their
    state slots), slots copied, the forwards processed, the requests freed (negative picks count
    from the newest), the state end compacted, then new requests whose pages end part-written
    (the rest of their last page is read by the forward after the next)."""
    ps = config.page_size
    n = rng.randint(1, 3)
    ops = [*({"op": "admit", "len": rng.randint(1, 2 * ps)} for _ in range(n)), {"op": "forward"},
           *_ops(rng, config, _some(rng, ("copy_state", "slots"), 0, 2)),
           {"op": "process", "advance": 0}, {"op": "process", "advance": 0},
           *({"op": "free", "pick": -1} for _ in range(rng.randint(1, n))),
           *_ops(rng, config, _some(rng, ("free_slots", "flush"), 0, 2)),
           rng.choice(({"op": "flush"}, {"op": "compact", "end": 0, "fr": round(rng.uniform(0.3, 1.0), 2)},
                       make_op("relief", rng, config), make_op("relayout", rng, config)))]
    for _ in range(rng.randint(1, 3)):
        ops.append({"op": "admit", "len": rng.randint(1, 3 * ps)})
    ops += [{"op": "forward"}, {"op": "decode", "k": 8, "start": rng.randint(0, 15)}, {"op": "forward"},
            {"op": "forward"}]
    return ops


def timing_races(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """Tokens to write and a forward launched, then device time passes in steps (its event fires
    on one rank before the other) with frees and takes between them, whose decisions must not
    depend on which rank's forward is done."""
    ops = [{"op": "decode", "k": 8, "start": rng.randint(0, 15)}, {"op": "forward"}]
    for _ in range(rng.randint(2, 3)):
        ops.append({"op": "tick", "dt": round(rng.uniform(1.0, 8.0), 2)})
        ops += _ops(rng, config, _some(rng, ("free", "free", "admit", "decode", "flush"), 1, 2))
    return ops


FAMILIES: dict[str, Family] = {f.__name__: f for f in (
    compaction_under_decode, moves_under_forward, frees_under_forward, settles_under_forward, state_churn, timing_races)}


def _weights(**changes: int) -> dict[str, int]:
    out = dict(OP_WEIGHTS)
    out.update(changes)
    return out


@dataclass(frozen=True)
class Profile:
    """A seed's operation mix: single operations drawn from `weights`; before each, with chance
    `families[name]`, a scenario family's run is spliced in instead."""

    name: str
    weights: Mapping[str, int] = field(default_factory=lambda: dict(OP_WEIGHTS))
    families: Mapping[str, float] = field(default_factory=dict)

    def generate(self, rng: random.Random, n_ops: int, config: HarnessConfig) -> list[dict]:
        ops: list[dict] = []
        names = list(self.families)
        while len(ops) < n_ops:
            r = rng.random()
            for name in names:
                r -= self.families[name]
                if r < 0:
                    ops += FAMILIES[name](rng, config)
                    break
            else:
                ops.append(random_op(rng, config, self.weights))
        return ops[:n_ops]


def _families(main: str, rate: float = 0.10, **others: float) -> dict[str, float]:
    """Every family at a low rate (`others` overriding), the profile's own at `rate`."""
    out = {"compaction_under_decode": 0.06, "frees_under_forward": 0.04, "settles_under_forward": 0.02,
           "state_churn": 0.04, "timing_races": 0.04, "moves_under_forward": 0.02}
    out.update(others)
    out[main] = rate
    return out


PROFILES: dict[str, Profile] = {p.name: p for p in (
    # the original mix: every operation, no family
    Profile("mixed"),
    # compaction and moves with forwards in flight
    Profile("moves", _weights(flush=14, compact=6, relief=5, relayout=4, free=10),
            _families("compaction_under_decode", 0.12, moves_under_forward=0.04)),
    # frees under running forwards, and the takes that follow
    Profile("frees", _weights(free=14, admit=14, process=7, tick=5),
            _families("frees_under_forward", 0.10, settles_under_forward=0.04)),
    # state slots written and let go, so the state band shrinks and grows against its neighbour
    Profile("state", _weights(slots=6, free_slots=6, copy_state=6, compact=6, free=12), _families("state_churn")),
    # device time between a forward and the frees and takes after it
    Profile("timing", _weights(tick=10, free=12), _families("timing_races")),
)}


def generate_ops(seed: int, n_ops: int, config: HarnessConfig | None = None) -> list[dict]:
    """A seed's operations: drawn from its profile's mix, with the profile's scenario families
    spliced in."""
    config = config or config_for_seed(seed)
    rng = random.Random(seed * 104729 + 3)
    return PROFILES[config.profile].generate(rng, n_ops, config)
