"""The page-safety stress harness on real processes: each rank of a case in its own process, over
gloo on the loopback interface (HARN-4 across processes).

Every process builds the case's rank (`Rank(config, rank)`: its own arena and modeled device, whose
completion timing differs per rank) and runs the same operations. After each operation every rank
folds what its allocator decided, the operation's outcome and the units it holds into a digest
(`dist/tp.py::digest`) and the ranks all-gather their digests and their findings: a digest that
differs is `rank_divergence` (HARN-10), naming the first differing decision; a finding on any rank
stops every rank at the same operation. The result is the in-process harness's `RunResult`."""

from __future__ import annotations

import time
from typing import Any

from ..alloc.stage_capacity import shared_counts
from ..dist.pp import run_stage_processes
from ..dist.tp import RankLink, digest, first_difference
from . import checks, mutants
from .checks import Finding
from .harness import FINAL, Case, Failure, RunResult
from .harness_rank import Rank


def _log(rank: Rank, outcome: str) -> list:
    counts = shared_counts(rank.chain)
    return [*rank.take_decisions(), ("outcome", outcome), ("held", counts.held, counts.virtual_held,
                                                             counts.slots_held)]


def rank_process(rank_index: int, n_ranks: int, port: int, case_json: dict, device: str = "modeled",
                 corrupt: tuple[int, int] | None = None, until: str | None = None, timeout_s: float = 20.0) -> dict:
    """One rank of `case_json` in this process: run every operation, exchanging each operation's
    digest and findings with the other ranks; stop at the first finding (with `until`, at the first
    of that check). `corrupt`, a (rank, operation), corrupts that rank's count of live owner pages
    before that operation (a test of the check)."""
    case = Case.from_json(case_json)
    link = RankLink.join(rank_index, n_ranks, port, timeout_s)
    start = time.perf_counter()
    digests: list[str] = []
    failure: dict[str, Any] | None = None
    ops = [*case.ops, FINAL]
    with mutants.applied(case.mutant):
        rank = Rank(case.config, rank_index, device)
        try:
            for i, op in enumerate(ops):
                if corrupt == (rank_index, i):
                    rank.chain.owner.n_live += 1
                log = _log(rank, rank.step(op))
                mine = digest(log)
                digests.append(mine)
                found = [f.to_json() for f in rank.take_findings()]
                gathered = link.all_gather((mine, found))
                findings = [Finding(f["check"], f["message"], f["rank"]) for _d, fs in gathered for f in fs]
                if any(d != gathered[0][0] for d, _fs in gathered):
                    where = first_difference(link.all_gather(log))
                    findings.append(Finding(checks.RANK_DIVERGENCE, f"{op['op']}: decisions differ across "
                                                                    f"processes: {where}"))
                if findings and (until is None or any(f.check == until for f in findings)):
                    failure = Failure(i, tuple(findings)).to_json()
                    failure["describe"] = Failure(i, tuple(findings)).describe()
                    break
        finally:
            rank.close()
    link.close()
    return {"ops": i + 1, "seconds": time.perf_counter() - start, "failure": failure, "digests": digests,
            "moves": sum(b.stats["moves"] for b in rank.chain.bands)}


def run_case_processes(case: Case, device: str = "modeled", corrupt: tuple[int, int] | None = None,
                       until: str | None = None, timeout_s: float = 120.0
                       ) -> tuple[RunResult, dict[int, tuple[str, Any]]]:
    """Run `case` on two rank processes; the result as `run_case` gives it, and each process's
    report. A process that raised or did not answer is an `error` finding."""
    out = run_stage_processes(rank_process, 2, (case.to_json(), device, corrupt, until), timeout_s=timeout_s)
    broken = [(r, status, value) for r, (status, value) in sorted(out.items()) if status != "ok"]
    if broken:
        r, status, value = broken[0]
        text = str(value).splitlines()[0] if value else "no answer"
        failure = Failure(len(case.ops), (Finding(checks.ERROR, f"rank process {r}: {status}: {text}", r),))
        return RunResult(failure, 0, 0.0, {}), out
    first = out[0][1]
    failure = None
    if first["failure"] is not None:
        f = first["failure"]
        failure = Failure(f["op"], tuple(Finding(x["check"], x["message"], x["rank"]) for x in f["findings"]))
    return RunResult(failure, first["ops"], first["seconds"], {"moves": first["moves"], "seen": {}}), out


def run_seed_processes(seed: int, n_ops: int, device: str = "modeled", mutant: str | None = None,
                       until: str | None = None, out_dir: str | None = None) -> dict:
    """One seed of `kvchain stress --processes 2`, reported as an in-process seed is: its
    operations, seconds, failure and the saved case (cut after the failing operation)."""
    from pathlib import Path

    from .harness import seed_case

    case = seed_case(seed, n_ops)
    case.mutant = mutant
    result, _out = run_case_processes(case, device, until=until)
    report: dict[str, Any] = {"seed": seed, "ops": result.ops_run, "seconds": result.seconds, "failure": None,
                              "case": None}
    if result.failure is not None:
        report["failure"] = result.failure.to_json()
        report["describe"] = result.failure.describe()
        case.ops = case.ops[: result.failure.op + 1]
        case.failure = result.failure.to_json()
        if out_dir:
            path = Path(out_dir) / f"seed{seed}-{result.failure.check}.json"
            case.save(path)
            report["case"] = str(path)
    return report
