"""The comparison table of docs/simulate.md: every preset x {mixed, multi-turn}, kvchain (both
admission modes) against the engines' policies and the ideal bound, side by side in one run each.

    PYTHONPATH=src python scripts/simulate_sweep.py --requests 300 --jobs 2 --out sweep.json
    PYTHONPATH=src python scripts/simulate_sweep.py --presets gpt-oss-120b,qwen3-next-80b --workloads mixed
    PYTHONPATH=src python scripts/simulate_sweep.py --pools kvchain --merge old.json --wide   # rerun one pool

Prints one markdown table (whole-run steps, seconds under the default step-time model, prefix hit
rate, preemptions; kvchain's steps over each pool's) and writes every figure as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvchain.errors import KVChainError
from kvchain.models import list_presets, model_from_preset
from kvchain.sim.baselines import PoolConfig
from kvchain.sim.compare import SchedulerConfig, compare
from kvchain.sim.runner import StepTimeModel
from kvchain.sim.waiting import EVICTION_ORDERS, WAITING_ORDERS
from kvchain.sim.workloads import MIXED_DEFAULTS, closed_loop_params, workload_from_name

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


def _requests(workload: str, requests: int, closed_loop: bool = False):
    name, params = WORKLOADS[workload]
    if closed_loop:
        params = {**params, **closed_loop_params(name)}
    return workload_from_name(name, requests, 0, **params)


def run(preset: str, workload: str, requests: int, jobs: int, pools=POOLS, host_budget: int = 0,
        waiting_order: str = "fcfs", eviction: str = "waiting-aware", closed_loop: bool = False) -> dict:
    reqs = _requests(workload, requests, closed_loop)
    budget = BUDGETS.get(preset, DEFAULT_BUDGET)
    t0 = time.time()
    result = compare(model_from_preset(preset).decls, PoolConfig(budget, host_budget=host_budget, waiting_order=waiting_order,
                                                                  eviction=eviction), reqs, pools,
                     SchedulerConfig(step_time=StepTimeModel()), jobs=jobs)
    return {"preset": preset, "workload": workload + (" (closed loop)" if closed_loop else ""),
            "budget_gib": budget / GiB, "requests": requests,
            "wall_s": round(time.time() - t0, 1), "results": [r.to_dict() for r in result.results]}


def trace(preset: str, workload: str, requests: int, pool: str, eviction: str = "waiting-aware") -> dict:
    """Where `pool`'s prefix hits are lost on this row (`kvchain.sim.hit_trace`): shares of all
    prompt tokens admitted."""
    from kvchain.sim.compare import _make
    from kvchain.sim.hit_trace import trace_hits

    name, params = WORKLOADS[workload]
    cfg = PoolConfig(BUDGETS.get(preset, DEFAULT_BUDGET), eviction=eviction)
    return trace_hits(_make(pool, model_from_preset(preset).decls, cfg, None),
                      workload_from_name(name, requests, 0, **params)).summary()


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


def memory_time_bound(preset: str, workload: str, requests: int) -> float:
    """Steps at which the chain would be busy every step: every request's bytes (its state, its
    prompt's KV and its output's as it grows one token a step) summed over the steps it decodes,
    over the chain's bytes. A bound no loop reaches: it needs a full pool through ramp and drain."""
    from kvchain.memory.arena import arena_layout
    from kvchain.plan import plan_kv_storage
    from kvchain.sim.baselines import _sizing

    plan = plan_kv_storage(model_from_preset(preset).decls, page_size=1)
    cfg = PoolConfig(BUDGETS.get(preset, DEFAULT_BUDGET))
    chain = arena_layout(plan, _sizing(plan, cfg).arena_bytes).chain_bytes
    token = plan.owner.unit_bytes + sum(w.unit_bytes for w in plan.windows)
    state = plan.state.page_bytes if plan.state is not None else 0
    name, params = WORKLOADS[workload]
    total = 0.0
    for r in workload_from_name(name, requests, 0, **params):
        total += r.output_len * (state + token * r.prompt_len) + token * r.output_len * (r.output_len - 1) / 2
    return total / chain


def _pool(row: dict, name: str) -> dict | None:
    return next((r for r in row["results"] if r["pool"] == name), None)


def wide_table(rows: list[dict]) -> str:
    """One line a preset and workload, as docs/simulate.md prints it: kvchain's steps over each
    pool's, seconds, hit rates and preemptions side by side."""
    lines = ["| model | workload | budget | kvchain steps | kvchain / vllm-hybrid | kvchain / sglang-static | "
             "kvchain / ideal | exact / optimistic | seconds: kvchain, vllm-hybrid, sglang-static, ideal | "
             "hit rate: kvchain, vllm-hybrid, ideal | preempted: kvchain, kvchain-exact, vllm-hybrid, sglang-static |",
             "| - | - | - | - | - | - | - | - | - | - | - |"]

    def get(row, pool, key, fmt):
        r = _pool(row, pool)
        return "-" if r is None or r.get(key) is None else format(r[key], fmt)

    for row in rows:
        k = _pool(row, "kvchain")
        ratio = {p: (k["steps"] / _pool(row, p)["steps"]) if _pool(row, p) else None
                 for p in ("vllm-hybrid", "sglang-static", "ideal", "kvchain-exact")}
        exact = f"{1 / ratio['kvchain-exact']:.3f}x" if ratio["kvchain-exact"] else "-"
        cells = [row["preset"], row["workload"], f"{row['budget_gib']:.0f} GiB", f"{k['steps']:,}",
                 *(f"{ratio[p]:.3f}x" if ratio[p] else "-" for p in ("vllm-hybrid", "sglang-static", "ideal")), exact,
                 ", ".join(get(row, p, "seconds", ".0f") for p in ("kvchain", "vllm-hybrid", "sglang-static", "ideal")),
                 ", ".join(get(row, p, "hit_rate", ".1%") for p in ("kvchain", "vllm-hybrid", "ideal")),
                 ", ".join(get(row, p, "preemptions", "d")
                           for p in ("kvchain", "kvchain-exact", "vllm-hybrid", "sglang-static"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(rows: list[dict], previous: list[dict]) -> list[dict]:
    """Each row with the pools it did not run taken from `previous` (the same preset, workload,
    budget and requests), marked `from_previous`."""
    out = []
    for row in rows:
        old = next((p for p in previous if (p["preset"], p["workload"], p["budget_gib"], p["requests"])
                    == (row["preset"], row["workload"], row["budget_gib"], row["requests"])), None)
        ran = {r["pool"] for r in row["results"]}
        kept = [{**r, "from_previous": True} for r in (old["results"] if old else []) if r["pool"] not in ran]
        out.append({**row, "results": row["results"] + kept})
    return out


def _has_attention(preset: str) -> bool:
    """What `kvchain simulate` compares: a model with attention (a state-only one it refuses)."""
    return any(part.is_attention for decl in model_from_preset(preset).decls for part in decl.parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(i.name for i in list_presets() if _has_attention(i.name)),
                   help="comma-separated presets (default: every preset with attention)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--closed-loop", action="store_true",
                   help="each session's next turn arrives its gap after the turn before it finishes")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    p.add_argument("--pools", default=",".join(POOLS), help="pools to run (default: all five)")
    p.add_argument("--merge", default=None,
                   help="a previous --out JSON: pools not run here are taken from its matching rows")
    p.add_argument("--host-budget", type=int, default=0, help="bytes of kvchain's host tier (default none)")
    p.add_argument("--waiting-order", default="fcfs", choices=list(WAITING_ORDERS),
                   help="kvchain's waiting order (default fcfs)")
    p.add_argument("--eviction", default="waiting-aware", choices=list(EVICTION_ORDERS),
                   help="kvchain's eviction order (default waiting-aware)")
    p.add_argument("--trace-hits", action="store_true",
                   help="trace where each pool's prefix hits are lost (kvchain.sim.hit_trace; one process, slow)")
    p.add_argument("--memory-time", action="store_true",
                   help="print each preset and workload's memory-time bound in steps (no simulation)")
    p.add_argument("--wide", action="store_true", help="print the one-line-a-row table of docs/simulate.md")
    args = p.parse_args(argv)
    try:
        state_only = [name for name in args.presets.split(",") if not _has_attention(name)]
    except KVChainError as exc:
        p.error(f"--presets: {exc}")
    if state_only:
        p.error(f"--presets: {', '.join(state_only)} keep only recurrent state, which simulate does not compare")
    pools = tuple(args.pools.split(","))
    previous = []
    for path in (args.merge.split(",") if args.merge else []):
        with open(path) as f:
            previous += json.load(f)
    if args.memory_time:
        for preset in args.presets.split(","):
            for workload in args.workloads.split(","):
                print(f"{preset} {workload}: {memory_time_bound(preset, workload, args.requests):,.0f} steps")
        return 0
    if args.trace_hits:
        for preset in args.presets.split(","):
            for workload in args.workloads.split(","):
                for pool in pools:
                    print(json.dumps({"preset": preset, "workload": workload, "pool": pool,
                                      **trace(preset, workload, args.requests, pool, args.eviction)}), flush=True)
        return 0
    rows = []
    for preset in args.presets.split(","):
        for workload in args.workloads.split(","):
            rows.append(run(preset, workload, args.requests, args.jobs, pools, args.host_budget, args.waiting_order,
                            args.eviction, args.closed_loop))
            if previous:
                rows[-1:] = merge(rows[-1:], previous)
            print(f"{preset} {workload}: {rows[-1]['wall_s']} s", file=sys.stderr, flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    print(wide_table(rows) if args.wide else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
