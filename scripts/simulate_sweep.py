"""The comparison table of docs/simulate.md: every preset x {mixed, multi-turn}, kvchain (both
admission modes) against the engines' policies and the ideal bound, side by side in one run each.

    PYTHONPATH=src python scripts/simulate_sweep.py --requests 300 --jobs 2 --out sweep.json
    PYTHONPATH=src python scripts/simulate_sweep.py --presets gpt-oss-120b,qwen3-next-80b --workloads mixed

Prints one markdown table (whole-run steps, seconds under the default step-time model, prefix hit
rate, preemptions; kvchain's steps over each pool's) and writes every figure as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvchain.models import list_presets, model_from_preset
from kvchain.sim.baselines import PoolConfig
from kvchain.sim.compare import SchedulerConfig, compare
from kvchain.sim.runner import StepTimeModel
from kvchain.sim.workloads import MIXED_DEFAULTS, workload_from_name

GiB = 2**30
#: budgets where memory binds for the large models (the issue's targets); smaller models share 16 GiB
BUDGETS = {"qwen3-next-80b": 8 * GiB}
DEFAULT_BUDGET = 16 * GiB
POOLS = ("kvchain", "kvchain-exact", "vllm-hybrid", "sglang-static", "ideal")
#: multi-turn chat with long turns (the mixed workload's multi-turn part) at a rate that saturates
WORKLOADS = {
    "mixed": ("mixed", {}),
    "multi-turn": ("multi_turn", {**MIXED_DEFAULTS["multi_turn"], "rate": 4.0}),
}


def run(preset: str, workload: str, requests: int, jobs: int) -> dict:
    name, params = WORKLOADS[workload]
    reqs = workload_from_name(name, requests, 0, **params)
    budget = BUDGETS.get(preset, DEFAULT_BUDGET)
    t0 = time.time()
    result = compare(model_from_preset(preset).decls, PoolConfig(budget), reqs, POOLS,
                     SchedulerConfig(step_time=StepTimeModel()), jobs=jobs)
    return {"preset": preset, "workload": workload, "budget_gib": budget / GiB, "requests": requests,
            "wall_s": round(time.time() - t0, 1), "results": [r.to_dict() for r in result.results]}


def table(rows: list[dict]) -> str:
    head = ("| model | workload | budget | pool | steps | kvchain/pool | seconds | hit rate | preempted | "
            "recomputed |\n| - | - | - | - | - | - | - | - | - | - |")
    lines = [head]
    for row in rows:
        base = next(r for r in row["results"] if r["pool"] == "kvchain")["steps"]
        for r in row["results"]:
            lines.append(f"| {row['preset']} | {row['workload']} | {row['budget_gib']:.0f} GiB | {r['pool']} | "
                         f"{r['steps']} | {base / r['steps']:.3f}x | {r['seconds']:.0f} | {r['hit_rate']:.1%} | "
                         f"{r['preemptions']} | {r['recomputed_tokens']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(i.name for i in list_presets()))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args(argv)
    rows = []
    for preset in args.presets.split(","):
        for workload in args.workloads.split(","):
            rows.append(run(preset, workload, args.requests, args.jobs))
            print(f"{preset} {workload}: {rows[-1]['wall_s']} s", file=sys.stderr, flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
