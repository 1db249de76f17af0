"""The stress harness's configuration and operations (HARN-1, HARN-2, HARN-4): what a seed gives
(`config_for_seed`: the chain, its page size, windows and head counts, the arena size, two
ranks' timing and the operation-mix profile), the chain's plan and storage (`harness_plan`,
`harness_storage`), and the single operations (`random_op`, `make_op`) that a seed's sequence
(`harness_profiles.generate_ops`) is drawn from."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

from ..decl import MHA, State, StateTensor
from ..device.base import Device
from ..models.small import small_hybrid
from ..plan import KVStoragePlan, plan_kv_storage
from ..sizing import check_bs1_floor, fixed_allocations, size_plan
from ..storage import KVStorage

# ----------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RankTiming:
    """One simulated rank's device: its seed and mean durations per stream."""

    seed: int
    forward: float
    copy: float
    network: float
    schedule: float = 1.0


@dataclass(frozen=True)
class HarnessConfig:
    """Everything a sequence's run depends on besides its operations (saved with each case)."""

    seed: int
    page_size: int
    full: tuple[int, int]  # kv heads, head dim
    windows: tuple[tuple[int, int, int], ...]  # window, kv heads, head dim
    state_floats: int
    chain_bytes: int
    rows: int
    context: int
    war_barrier: bool  # persistent metadata and the write-after-read barrier; else per-forward metadata
    max_moves: int
    gap_fraction: float
    timing: tuple[RankTiming, RankTiming]
    #: the operation mix its sequence is drawn from (`harness_profiles.PROFILES`); a saved case
    #: holds its operations, so the profile only says where they came from
    profile: str = "mixed"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HarnessConfig:
        data = dict(data)
        data["full"] = tuple(data["full"])
        data["windows"] = tuple(tuple(w) for w in data["windows"])
        data["timing"] = tuple(RankTiming(**t) for t in data["timing"])
        return cls(**data)


def config_for_seed(seed: int) -> HarnessConfig:
    """A seed's chain and timing: page size, windows, head counts and arena size all vary."""
    rng = random.Random(seed * 7919 + 17)
    page_size = rng.choice((1, 2, 4))
    n_windows = rng.choice((1, 2))
    lengths = sorted(rng.sample((4, 8, 12, 16, 24, 32), n_windows), reverse=True)
    windows = tuple((w, rng.choice((1, 2)), rng.choice((4, 8))) for w in lengths)
    timing = tuple(RankTiming(seed * 2 + r, rng.choice((2.0, 4.0, 8.0)), rng.choice((1.0, 3.0, 6.0)),
                              rng.choice((1.0, 4.0, 9.0))) for r in (0, 1))
    config = HarnessConfig(
        seed=seed, page_size=page_size, full=(rng.choice((1, 2)), rng.choice((4, 8))), windows=windows,
        state_floats=rng.choice((16, 32, 64)), chain_bytes=rng.choice((6, 8, 12, 16)) * 1024, rows=12,
        context=96, war_barrier=rng.random() < 0.5, max_moves=rng.choice((2, 8, 64)),
        gap_fraction=rng.choice((0.25, 1.0)), timing=timing,  # type: ignore[arg-type]
        profile=profile_for_seed(seed),
    )
    # at least the batch-size-1 floor's chain share (DECL-12), and room for one request beyond it
    plan = harness_plan(config)
    fixed = fixed_allocations(plan, config.context, config.rows).total
    floor = check_bs1_floor(plan, 2**30, config.context, config.rows).total - fixed
    if config.chain_bytes < floor + 2048:
        config = replace(config, chain_bytes=-(-(floor + 2048) // 1024) * 1024)
    return config


#: the profile of seed s is PROFILE_CYCLE[s % len(PROFILE_CYCLE)] (`harness_profiles.PROFILES`): every
#: window of seeds draws each profile in the same share
PROFILE_CYCLE: tuple[str, ...] = ("moves", "frees", "state", "timing", "mixed", "moves", "frees", "state", "timing")


def profile_for_seed(seed: int) -> str:
    """The seed's operation-mix profile (`harness_profiles`): by its place in the profiles' cycle,
    so the chain and timing a seed gave before profiles existed stay the same."""
    return PROFILE_CYCLE[seed % len(PROFILE_CYCLE)]


def harness_plan(config: HarnessConfig) -> KVStoragePlan:
    """The chain: state end, windows floating, full attention owning the other end; all float32
    so payload values are exact."""
    heads, dim = config.full
    decls = small_hybrid(MHA(heads, dim, dtype="float32"), [w for w, _h, _d in config.windows],
                         window_geometry=[MHA(h, d, dtype="float32") for _w, h, d in config.windows],
                         state=State((StateTensor("ssm", (config.state_floats,), "float32"),)))
    return plan_kv_storage(decls, page_size=config.page_size)


def harness_storage(config: HarnessConfig, backend: Device, arena_device: str = "cpu") -> KVStorage:
    from ..build import build_kv_storage

    plan = harness_plan(config)
    kwargs = dict(context_len=config.context, max_running_requests=config.rows, state_slots=config.rows)
    probe = size_plan(plan, 2**30, **kwargs)
    sizing = size_plan(plan, probe.fixed.total + config.chain_bytes, **kwargs)
    storage = build_kv_storage(plan, sizing, arena_device, backend=backend)
    chain = storage.allocator
    chain.compaction_gap_fraction = config.gap_fraction
    chain.max_moves_per_call = config.max_moves
    return storage


# ----------------------------------------------------------------------------------- operations

#: operation kinds and their weights in the `mixed` profile's random sequence
OP_WEIGHTS: dict[str, int] = {
    "admit": 10, "decode": 16, "forward": 14, "process": 10, "free": 8, "advance": 3, "flush": 10,
    "relief": 3, "compact": 3, "relayout": 2, "load": 3, "backup": 3, "end_copy": 4, "send": 3,
    "end_send": 3, "recv": 2, "publish": 3, "end_recv": 3, "copy_state": 3, "slots": 3, "free_slots": 3,
    "tick": 3, "quiesce": 1,
}


def random_op(rng: random.Random, config: HarnessConfig, weights: Mapping[str, int] = OP_WEIGHTS) -> dict:
    """One operation drawn from `weights`, its arguments drawn for `config`."""
    return make_op(rng.choices(list(weights), weights=list(weights.values()))[0], rng, config)


def make_op(kind: str, rng: random.Random, config: HarnessConfig) -> dict:
    """An operation of `kind` with random arguments."""
    op: dict = {"op": kind}
    if kind in ("admit", "recv"):
        op["len"] = rng.randint(1, 32)
    elif kind == "process":
        op["advance"] = rng.randint(0, 1)
    elif kind == "decode":
        op["k"] = rng.randint(1, 8)
        op["start"] = rng.randint(0, 15)
    elif kind in ("free", "advance", "backup", "send", "end_copy", "end_send", "publish", "end_recv",
                  "free_slots", "relayout"):
        op["pick"] = rng.randint(0, 99)
    elif kind == "compact":
        op["end"] = rng.randint(0, 1)
        op["fr"] = round(rng.uniform(0.3, 1.0), 2)
    elif kind == "relief":
        op["fr"] = [round(rng.random(), 2) for _ in range(len(config.windows) + 2)]
    elif kind == "load":
        op["pages"] = rng.randint(1, max(1, 16 // config.page_size))
    elif kind == "copy_state":
        op["src"] = rng.randint(0, 99)
        op["dst"] = rng.randint(0, 99)
    elif kind == "slots":
        op["n"] = rng.randint(1, 6)
    elif kind == "tick":
        op["dt"] = round(rng.uniform(0.5, 12.0), 2)
    return op
