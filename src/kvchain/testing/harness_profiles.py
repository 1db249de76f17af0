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


def _after_a_while(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """Device time passes with forwards in flight (on one rank a forward may be done, on the other
    not), the newest request is freed and a short one admitted, and the oldest forward processed."""
    return [{"op": "tick", "dt": round(rng.uniform(3.0, 30.0), 1)}, {"op": "free", "pick": -1},
            {"op": "admit", "len": rng.randint(1, 2 * config.page_size)}, {"op": "process", "advance": 0}]


def frees_under_queued_forward(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """A request's whole pages read by a forward queued behind another, then the request freed
    and its pages wanted again before that forward starts. The forwards in flight processed;
    state slots taken and let go (clean state holes, so the takes below need not wait the
    freed request's slot); a request admitted in whole pages and written, its forward
    processed (nothing in flight uses those pages now); a short request admitted and its forward
    launched (it runs); the first request decoded by one token (a start of -2 puts the second
    newest ready request first) and its forward launched behind the running one; the first
    request freed (the second newest); then a request admitted in fewer pages than the first
    one's whole pages, which takes holes first, then settled pending batches (its last page,
    which the queued forward writes, is waited by every take), and device time passes before
    a free and a take (`_after_a_while`)."""
    ps = config.page_size
    n = rng.randint(2, 4)
    ops = [{"op": "process", "advance": 0}, {"op": "process", "advance": 0},
           {"op": "slots", "n": rng.randint(3, 4)}, {"op": "free_slots", "pick": -1},
           {"op": "admit", "len": n * ps}, {"op": "forward"}, {"op": "process", "advance": 0},
           {"op": "admit", "len": rng.randint(1, ps)}, {"op": "forward"},
           {"op": "decode", "k": 1, "start": -2}, {"op": "forward"}, {"op": "free", "pick": -2},
           {"op": "admit", "len": rng.randint(1, (n - 1) * ps)}, *_after_a_while(rng, config)]
    return ops


def moves_under_queued_forward(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """A request's whole pages read by a forward queued behind another, moved while it waits,
    and their old places wanted again before it starts. The forwards in flight processed; state
    slots taken and let go (clean state holes, so no take below waits a slot); a long request
    and then one of whole pages admitted and written, their forward processed; the long one
    freed (the second newest), leaving holes beside the other's pages; a short request admitted
    and its forward launched (it runs); the whole-page request decoded by one token (its new
    page comes from the holes) and its forward launched behind the running one; an end
    compacted (its frontier pages, the queued forward's reads, move into the holes; the forward
    may still read their old places); then a short request admitted, and device time passes before
    a free and a take (`_after_a_while`)."""
    ps = config.page_size
    n = rng.randint(2, 3)
    return [{"op": "process", "advance": 0}, {"op": "process", "advance": 0},
            {"op": "admit", "len": rng.randint(3 * ps, 4 * ps)}, {"op": "admit", "len": n * ps}, {"op": "forward"},
            {"op": "process", "advance": 0}, {"op": "free", "pick": -2},
            {"op": "admit", "len": rng.randint(1, ps)}, {"op": "forward"},
            {"op": "decode", "k": 1, "start": -2}, {"op": "forward"},
            {"op": "flush"},
            {"op": "admit", "len": rng.randint(1, (n - 1) * ps)}, *_after_a_while(rng, config)]


def frees_under_transfer(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """A request's pages read by a host-tier backup or a PD send, the request freed, and its pages
    wanted again before the transfer ends. The forwards in flight processed; a short request (it
    stays, so no float empties and parks, which would fence its span), long ones (the arena
    fills) and one of whole pages admitted and written, their forward processed; a flush (no
    holes left but the freed request's); a backup or a send of the newest request, the request
    freed; a request admitted in at most its pages (a backup's pages are holes again, which the
    take finds first), then a longer one (a full arena has room only where the send's rows are:
    relief waits the transfer), each written; then the transfer ended (a host wait)."""
    ps = config.page_size
    n = rng.randint(2, 4)
    kind = rng.choice(("backup", "send"))
    ops = [{"op": "process", "advance": 0}, {"op": "process", "advance": 0}, {"op": "admit", "len": rng.randint(1, ps)}]
    ops += [{"op": "admit", "len": rng.randint(config.context // 4, config.context // 2)}
            for _ in range(rng.randint(1, 4))]
    ops += [{"op": "admit", "len": n * ps}, {"op": "forward"}, {"op": "process", "advance": 0}, {"op": "flush"},
            {"op": kind, "pick": -1}, {"op": "free", "pick": -1},
            {"op": "admit", "len": rng.randint(1, n * ps)}, {"op": "forward"},
            {"op": "admit", "len": rng.randint(n * ps, config.context // 2)}, {"op": "forward"},
            {"op": "end_copy" if kind == "backup" else "end_send", "pick": -1}]
    return ops


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


def state_then_growth(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """The state band at its high-water mark, let go, and the attention bands grown over the
    bytes it held: requests admitted (each takes a state slot) and written (their forward writes
    every slot), state slots copied, the forwards processed, most of them freed (negative picks
    count from the newest), flushes and an end compaction that pack the state band and retreat
    its frontier (a relief may relocate a float over the freed space), then long requests
    admitted, written, decoded and written again: the forward after the first reads every page
    they hold."""
    ps = config.page_size
    n = rng.randint(6, config.rows)
    ops = [{"op": "admit", "len": rng.randint(1, ps)} for _ in range(n)]
    ops += [{"op": "forward"}, *_ops(rng, config, _some(rng, ("copy_state",), 1, 3)),
            {"op": "process", "advance": 0}, {"op": "process", "advance": 0}]
    ops += [{"op": "free", "pick": -1} for _ in range(n - rng.randint(0, 2))]
    ops += [{"op": "flush"}, {"op": "compact", "end": 0, "fr": round(rng.uniform(0.5, 1.0), 2)}, {"op": "flush"}]
    ops += [{"op": "admit", "len": rng.randint(8 * ps, config.context // 3)} for _ in range(rng.randint(2, 4))]
    ops += [{"op": "forward"}, {"op": "decode", "k": 8, "start": 0}, {"op": "forward"}, {"op": "forward"}]
    return ops


def float_over_state(rng: random.Random, config: HarnessConfig) -> list[dict]:
    """A float hemmed in above grows down over bytes the state band held. The forwards in flight
    processed; long requests admitted (the arena fills: the full band grows down to the floats,
    the floats toward the state end); short requests admitted (their state slots sit above the
    long ones'), written and processed, then freed (negative picks count from the newest);
    tracking slots take the state slots they left while the long ones decode (the floats fill
    the holes the short ones left, so a flush does not pull them away from the state end), then
    let go; a flush retreats the state frontier; the long ones decode on (a float grows toward
    its larger room, which is now below it) and a request is admitted, its pages read by the
    forward after its own."""
    ps = config.page_size
    n_long, n_short = rng.randint(4, 6), rng.randint(2, 5)
    decode = [{"op": "decode", "k": 8, "start": 0}, {"op": "forward"}, {"op": "process", "advance": 0}]
    ops = [{"op": "process", "advance": 0}, {"op": "process", "advance": 0}]
    ops += [{"op": "admit", "len": rng.randint(config.context // 4, config.context // 2)} for _ in range(n_long)]
    ops += [{"op": "admit", "len": rng.randint(1, ps)} for _ in range(n_short)]
    ops += [{"op": "forward"}, {"op": "process", "advance": 0}]
    ops += [{"op": "free", "pick": -1} for _ in range(n_short)]
    ops += [{"op": "slots", "n": n_short}, *decode, *decode, {"op": "free_slots", "pick": -1}, {"op": "flush"}]
    ops += [*decode, *decode, *decode, {"op": "admit", "len": rng.randint(2 * ps, 6 * ps)}, {"op": "forward"},
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
    frees_under_queued_forward, moves_under_queued_forward, compaction_under_decode, moves_under_forward, frees_under_forward, settles_under_forward, state_churn,
    state_then_growth, float_over_state, frees_under_transfer, timing_races)}


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
    #: families whose runs open the sequence, on the fresh pool, in this order: a situation that
    #: needs the arena as a fresh pool leaves it (long requests that fill it from both ends)
    opening: tuple[str, ...] = ()

    def generate(self, rng: random.Random, n_ops: int, config: HarnessConfig,
                 opening_rng: random.Random | None = None) -> list[dict]:
        """`opening_rng` draws the opening families' arguments (default `rng`): a generator of its
        own leaves the draws of the rest of the sequence as they were without an opening."""
        ops: list[dict] = []
        for name in self.opening:
            ops += FAMILIES[name](opening_rng or rng, config)
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
    # compaction and moves with forwards in flight, from an arena long requests filled (a float
    # hemmed in above the state band)
    Profile("moves", _weights(flush=14, compact=6, relief=5, relayout=4, free=10),
            _families("compaction_under_decode", 0.12, moves_under_forward=0.04, moves_under_queued_forward=0.08,
                      frees_under_queued_forward=0.03),
            opening=("float_over_state",)),
    # frees under running forwards and transfers, and the takes that follow
    Profile("frees", _weights(free=14, admit=14, process=7, tick=5),
            _families("frees_under_forward", 0.10, settles_under_forward=0.04, frees_under_queued_forward=0.06,
                      moves_under_queued_forward=0.05),
            opening=("frees_under_transfer",)),
    # state slots written and let go, so the state band shrinks and grows against its neighbour
    Profile("state", _weights(slots=6, free_slots=6, copy_state=6, compact=6, free=12),
            _families("state_churn", state_then_growth=0.05, frees_under_queued_forward=0.03,
                      moves_under_queued_forward=0.05)),
    # device time between a forward and the frees and takes after it
    Profile("timing", _weights(tick=10, free=12), _families("timing_races", frees_under_transfer=0.06),
            opening=("float_over_state",)),
)}


def generate_ops(seed: int, n_ops: int, config: HarnessConfig | None = None) -> list[dict]:
    """A seed's operations: drawn from its profile's mix, with the profile's scenario families
    spliced in."""
    config = config or config_for_seed(seed)
    rng = random.Random(seed * 104729 + 3)
    return PROFILES[config.profile].generate(rng, n_ops, config, random.Random(seed * 7793 + 5))
