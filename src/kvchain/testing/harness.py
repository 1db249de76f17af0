"""The page-safety stress harness (HARN-1..13): seeded random sequences of scheduler-level
operations against a real `ChainAllocator` over a real CPU arena, run on two simulated ranks whose
completion timing differs, with every check of `checks.py` after every operation.

An operation is a small JSON dict (`{"op": "admit", "len": 17}`), interpreted against the rank's
state when it runs (`pick` indices wrap around whatever candidates exist; an operation with no
candidate does nothing), so any subsequence of a sequence is a valid sequence: that is what lets
a failing sequence be shrunk (`minimize`) and saved (`Case`), and replayed to the same failure.

The chain (`harness_plan`): a full-attention owner end with the state end, one or two floating
windows, page sizes 1, 2 or 4, and KV head counts that differ per band so page bytes differ. Each
rank plays the scheduler, the prefix tree, the host tier and the PD engine (`Rank`); forwards read
every byte their rows hold and write fresh values, transfers check what they read.

The pieces: `harness_config` (configuration, the chain, operations), `harness_device` (the devices),
`harness_rank` (one rank, with `harness_records`, `harness_forwards`, `harness_maintenance`,
`harness_host` and `harness_pd`); this module runs cases, saves them and shrinks them, and
re-exports the names other code imports from it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from . import checks
from .checks import Finding
from .harness_config import (
    OP_WEIGHTS,
    HarnessConfig,
    RankTiming,
    config_for_seed,
    harness_plan,
    harness_storage,
    random_op,
)
from .harness_device import HarnessDevice, cuda_device
from .harness_forwards import MAX_IN_FLIGHT
from .harness_profiles import generate_ops
from .harness_rank import Rank
from .harness_records import HELD, LOADING, READY, RECEIVING, SENDING, Job, Req

__all__ = [
    "FINAL", "FORMAT_VERSION", "HELD", "LOADING", "MAX_IN_FLIGHT", "OP_WEIGHTS", "READY", "RECEIVING",
    "SENDING", "Case", "Failure", "HarnessConfig", "HarnessDevice", "Job", "Rank", "RankTiming",
    "Req", "RunResult", "config_for_seed", "cuda_device", "ddmin", "fails_with", "generate_ops",
    "harness_plan", "harness_storage", "minimize", "random_op", "run_case", "seed_case",
]

FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------- running a case

#: the implicit last operation of every run
FINAL = {"op": "quiesce"}


@dataclass(frozen=True)
class Failure:
    """The first operation after which a check failed (`op == len(ops)`: the final quiescence)."""

    op: int
    findings: tuple[Finding, ...]

    @property
    def checks(self) -> tuple[str, ...]:
        seen = {f.check for f in self.findings}
        return tuple(c for c in checks.ALL_CHECKS if c in seen)

    @property
    def check(self) -> str:
        return self.checks[0]

    def to_json(self) -> dict:
        return {"op": self.op, "checks": list(self.checks), "findings": [f.to_json() for f in self.findings]}

    def describe(self) -> str:
        first = self.findings[0]
        rank = "" if first.rank is None else f" rank {first.rank}"
        return f"{'/'.join(self.checks)} after op {self.op}{rank}: {first.message}"


@dataclass
class RunResult:
    failure: Failure | None
    ops_run: int
    seconds: float
    stats: dict = field(default_factory=dict)


@dataclass
class Case:
    """A sequence and everything its run depends on: JSON, so it can be saved and replayed."""

    config: HarnessConfig
    ops: list[dict]
    mutant: str | None = None
    failure: dict | None = None
    description: str = ""

    def to_json(self) -> dict:
        out = {"version": FORMAT_VERSION, "kind": "stress-case"}
        if self.description:
            out["description"] = self.description
        out.update({"config": self.config.to_json(), "mutant": self.mutant, "failure": self.failure, "ops": self.ops})
        return out

    @classmethod
    def from_json(cls, data: dict) -> Case:
        if data.get("version") != FORMAT_VERSION or data.get("kind", "stress-case") != "stress-case":
            raise InputError(f"not a stress case of format {FORMAT_VERSION}")
        # a "workarounds" key (cases saved while the harness offered known-bug workarounds) is ignored
        return cls(HarnessConfig.from_json(data["config"]), list(data["ops"]), data.get("mutant"), data.get("failure"),
                   data.get("description", ""))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Case:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"cannot read stress case {path}: {e}") from None


def seed_case(seed: int, n_ops: int) -> Case:
    config = config_for_seed(seed)
    return Case(config, generate_ops(seed, n_ops, config))


def run_case(case: Case, device: str = "modeled", on_op: Callable[[int], None] | None = None,
             until: str | None = None, ranks: Sequence[int] = (0, 1)) -> RunResult:
    """Run a case's operations on two ranks, checking after every one (HARN-5); stop at the first
    failure, or with `until`, at the first failure of that check (other checks' findings before it
    are kept in `RunResult.stats["seen"]`). The mutant, if any, must already be applied
    (`mutants.applied`)."""
    start = time.perf_counter()
    made = [Rank(case.config, r, device) for r in ranks]
    try:
        return _run(case, made, start, on_op, until)
    finally:
        for rank in made:
            rank.close()


def _run(case: Case, ranks: list[Rank], start: float, on_op: Callable[[int], None] | None,
         until: str | None) -> RunResult:
    ops = [*case.ops, FINAL]
    seen: dict[str, int] = {}
    for i, op in enumerate(ops):
        outcomes = [rank.step(op) for rank in ranks]
        findings = [f for rank in ranks for f in rank.take_findings()]
        logs = [rank.take_decisions() for rank in ranks]
        if len(ranks) == 2:
            diff = checks.divergence(*logs)
            if diff is not None:
                findings.append(Finding(checks.RANK_DIVERGENCE, f"{op['op']}: decisions differ: {diff}"))
            elif outcomes[0] != outcomes[1]:
                findings.append(Finding(checks.RANK_DIVERGENCE,
                                        f"{op['op']}: rank 0 {outcomes[0]!r}, rank 1 {outcomes[1]!r}"))
        if on_op is not None:
            on_op(1)
        if findings and (until is None or any(f.check == until for f in findings)):
            return RunResult(Failure(i, tuple(findings)), i + 1, time.perf_counter() - start, {"seen": seen})
        for f in findings:
            seen.setdefault(f.check, i)
    stats = {"moves": sum(b.stats["moves"] for b in ranks[0].chain.bands), "seen": seen}
    return RunResult(None, len(ops), time.perf_counter() - start, stats)


# ----------------------------------------------------------------------------------- shrinking


def fails_with(case: Case, check: str, device: str = "modeled", until: str | None = None,
               ranks: Sequence[int] = (0, 1)) -> Callable[[list[dict]], bool]:
    def predicate(ops: list[dict]) -> bool:
        result = run_case(Case(case.config, ops, case.mutant), device, until=until, ranks=ranks)
        return result.failure is not None and check in result.failure.checks
    return predicate


def ddmin(items: list, fails: Callable[[list], bool]) -> list:
    """Delta debugging (Zeller's ddmin): a 1-minimal failing subsequence of a failing `items`
    (HARN-13): removing any single item makes `fails` false."""
    n = 2
    while len(items) >= 2:
        chunk = -(-len(items) // n)
        subsets = [items[i : i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for k in range(len(subsets)):
            complement = [x for j, s in enumerate(subsets) if j != k for x in s]
            if fails(complement):
                items, n, reduced = complement, max(n - 1, 2), True
                break
        if not reduced:
            for subset in subsets:
                if len(subset) < len(items) and fails(subset):
                    items, n, reduced = subset, 2, True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def minimize(case: Case, failure: Failure, device: str = "modeled", check: str | None = None,
             until: str | None = None) -> Case:
    """Shrink a failing case to a 1-minimal one that fails the same check (`check`, by default
    the failure's first); its operations after the failing one are dropped first."""
    check = check or failure.check
    ops = case.ops[: failure.op + 1]
    # a check one rank saw alone shrinks on that rank only (half the work); divergence needs both
    seen = {f.rank for f in failure.findings if f.check == check}
    ranks: tuple[int, ...] = (0, 1)
    if check != checks.RANK_DIVERGENCE and seen and None not in seen:
        ranks = (min(seen),)  # type: ignore[assignment, type-var]
    fails = fails_with(case, check, device, until, ranks)
    if not fails(ops):  # the last operations only fail together with the final quiescence: keep them
        ops = case.ops
    if not fails(ops):
        ranks = (0, 1)
        fails = fails_with(case, check, device, until, ranks)
    ops = ddmin(ops, fails)
    if ranks != (0, 1) and not fails_with(case, check, device, until)(ops):
        ops = ddmin(ops, fails_with(case, check, device, until))  # both ranks together differ: redo
    small = Case(case.config, ops, case.mutant)
    result = run_case(small, device, until=until)
    small.failure = result.failure.to_json() if result.failure is not None else None
    return small
