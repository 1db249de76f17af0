"""How often each mutant bites: for every mutant, the seeds of a range whose run its target check
fails (`kvchain stress --mutant-table`). A run stops at the first failure of the target check
(`run_case(until=...)`); findings of other checks on the way do not count as a catch.

On a real device (`threads`, `cuda`) only the payload, divergence and ledger checks apply
(HARN-14), so a mutant is held to its `real_target` there (an ordering fault shows as a lost
write), and a mutant with none is listed with the reason the device cannot show it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .mutants import MUTANTS, Mutant, applied


@dataclass
class MutantRow:
    """One mutant's catches over a seed range."""

    name: str
    target: str | None  # None: this device cannot show the mutant's hazard
    seeds: int
    caught: list[int] = field(default_factory=list)
    reason: str = ""  # why the device cannot show it (target None)

    @property
    def rate(self) -> float:
        return len(self.caught) / self.seeds if self.seeds else 0.0

    def to_json(self) -> dict:
        return {"mutant": self.name, "target": self.target, "seeds": self.seeds, "caught": len(self.caught),
                "rate": round(self.rate, 3), "caught_seeds": self.caught, "reason": self.reason}


def target_on(mutant: Mutant, device: str) -> str | None:
    """The check that must catch `mutant` on `device` (None: the device cannot show it)."""
    return mutant.target if device == "modeled" else mutant.real_target


def mutant_row(name: str, seeds: Sequence[int], n_ops: int, device: str = "modeled",
               on_seed: Callable[[], None] | None = None) -> MutantRow:
    """Run `seeds` under mutant `name` and note each seed whose run its target check fails."""
    from .harness import run_case, seed_case

    mutant = MUTANTS[name]
    target = target_on(mutant, device)
    row = MutantRow(name, target, len(seeds), reason="" if target else mutant.real_reason)
    if target is None:
        return row
    with applied(name):
        for seed in seeds:
            case = seed_case(seed, n_ops)
            case.mutant = name
            result = run_case(case, device, until=target)
            if result.failure is not None and target in result.failure.checks:
                row.caught.append(seed)
            if on_seed is not None:
                on_seed()
    return row
