"""`kvchain simulate --pp N`: serve a workload through kvchain split into N pipeline stages.

Each stage plans and sizes its own layers over its own arena (at real scale, on the `meta` device),
every stage's geometry is installed on every stage's chain (PP-6), and the stages' schedulers run
side by side one iteration at a time (`sim/pp.py::run_stages_in_process`): every capacity question
is asked of every stage's simulated snapshot, and after each iteration each stage's capacity digest
is checked against the previous stage's (`chain.stage_capacity_agreement`). The baselines have no
stages, so `--pp` serves kvchain alone."""

from __future__ import annotations

import argparse

from ..alloc.stage_capacity import StageGeometry
from ..build import build_kv_storage
from ..cache.checkpoints import default_checkpoint_interval
from ..cache.radix import CheckpointStrategy
from ..cli_common import dump_json, say
from ..engine.pool import KVChainPool
from ..engine.request import ScheduledRequest
from ..env import invariant_level
from ..errors import InputError, InvariantError
from ..plan import plan_stages, stage_layer_ranges
from ..sizing import size_stages
from ..units import count_of, format_bytes
from .baselines import DEFAULT_STRATEGY, admission_policy
from .pp import install_stages, run_stages_in_process

#: iterations a stage run may take before it is called stuck (the scheduler's own guard fires first)
MAX_ITERATIONS = 10**7


def check_pp_flags(args: argparse.Namespace, default_pools: str) -> None:
    """Refuse the flags `--pp` cannot serve, in one line each."""
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    if args.pools != default_pools and pools != ["kvchain"]:
        raise InputError(f"--pp {args.pp}: only kvchain serves pipeline stages; --pools {args.pools} needs --pp 1")
    for flag, given in (("--plot", args.plot), ("--step-time", args.step_time), ("--priority", args.priority),
                        ("--spec-tokens", args.spec_tokens is not None),
                        ("--spec-acceptance", args.spec_acceptance is not None),
                        ("--host-budget", args.host_budget),
                        ("--waiting-order", args.waiting_order != "fcfs"),
                        ("--eviction", args.eviction != "waiting-aware")):
        if given:
            raise InputError(f"--pp {args.pp}: {flag} is not served with pipeline stages (use --pp 1)")


def stage_pools(model, args: argparse.Namespace) -> tuple[list[range], list[KVChainPool], object]:
    """Every stage's kvchain pool over its own `meta` arena, each stage's geometry installed."""
    plans = plan_stages(model.decls, args.pp, page_size=args.page_size, partition=args.pp_partition)
    sizing = size_stages(plans, args.budget, context_len=args.context, max_running_requests=args.max_running)
    ranges = stage_layer_ranges(max(d.layer_id for d in model.decls) + 1, args.pp, args.pp_partition)
    strategy = DEFAULT_STRATEGY if args.strategy == "auto" else CheckpointStrategy(args.strategy)
    pools = []
    for plan, sized in zip(plans, sizing.stages):
        interval = (args.checkpoint_every or default_checkpoint_interval(plan)) if plan.state is not None else None
        pool = KVChainPool(build_kv_storage(plan, sized, "meta"), prefix_cache=not args.no_prefix_cache,
                           strategy=strategy, checkpoint_interval=interval, policy=admission_policy(args.admission))
        pools.append(pool)
    install_stages(pools)
    return ranges, pools, sizing


def check_digests(loops) -> None:
    """Every stage's digests, iteration by iteration, equal the first stage's. At
    KVCHAIN_INVARIANT_CHECK 1 and above the loop checks each iteration as it runs and its digests
    fold every capacity question; at 0 they hold the units each stage holds, checked here."""
    for stage, loop in enumerate(loops[1:], start=1):
        for it, (mine, first) in enumerate(zip(loop.digests, loops[0].digests)):
            if mine != first:
                raise InvariantError("chain.stage_capacity_agreement",
                                     f"iteration {it}: stage {stage}'s capacity digest {mine} differs from stage "
                                     f"0's {first}")


def run_pp(model, args: argparse.Namespace, requests: list[ScheduledRequest]) -> int:
    ranges, pools, sizing = stage_pools(model, args)
    loops = run_stages_in_process(pools, requests, MAX_ITERATIONS, max_batched_tokens=args.max_batched_tokens,
                                  flush=False)
    check_digests(loops)
    first = loops[0].summary()
    steps = max(1, first["steps"])
    report = {
        "model": model.name, "pp_size": args.pp, "concurrency": sizing.concurrency,
        "limiting_stage": sizing.limiting_stage,
        "stages": [{"stage": i, "first_layer": r.start, "last_layer": r.stop - 1,
                    "arena_bytes": p.storage.sizing.arena_bytes,
                    "bytes_per_token": StageGeometry.of_chain(p.chain, i).bytes_per_token(),
                    "concurrency": s.concurrency}
                   for i, (r, p, s) in enumerate(zip(ranges, pools, sizing.stages))],
        "iterations_checked": len(loops[0].digests), "digests_agree": True,
        "digests_fold_questions": bool(invariant_level()),
        "steps": first["steps"], "finished": first["finished"], "aborted": first["aborted"],
        "rejected": first["rejected"], "preemptions": first["preemptions"],
        "output_tokens": first["output_tokens"], "throughput": first["output_tokens"] / steps,
    }
    if args.json:
        print(dump_json(report, indent=2))
        return 0
    say(f"{model.name} · {format_bytes(args.budget)}: {count_of(args.pp, 'pipeline stage')}, kvchain, "
        f"{count_of(len(requests), 'request')}")
    for s in report["stages"]:
        say(f"  stage {s['stage']}: layers {s['first_layer']}..{s['last_layer']}, arena {format_bytes(s['arena_bytes'])}, "
              f"{s['bytes_per_token']:,} B/token, concurrency {s['concurrency']:,}")
    say(f"  concurrency after the MIN-reduce: {report['concurrency']:,} (stage {report['limiting_stage']} limits)")
    say(f"  {report['steps']:,} steps, {report['finished']:,} finished, {report['preemptions']:,} preemptions, "
          f"{report['throughput']:.2f} output tokens/step")
    what = "questions, answers and units held" if report["digests_fold_questions"] else \
        "units held; KVCHAIN_INVARIANT_CHECK=1 folds every capacity question too"
    say(f"  capacity digests ({what}) agreed on all {report['iterations_checked']:,} iterations")
    return 0
