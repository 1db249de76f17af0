"""Benchmarks behind `kvchain bench`: each prints a ratio against a baseline measured in the same
run (machines are noisy; absolute numbers are not comparable across runs, ratios are)."""

from __future__ import annotations

import argparse

from ..cli_common import byte_size, dump_json, non_negative_int, positive_int, progress

#: timed flushes of `bench moves` (the best counts)
MOVES_REPEATS = 7


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    alloc = sub.add_parser("alloc", help="host us per decode iteration: chain allocator vs a static pool")
    alloc.add_argument("--iters", type=positive_int, default=2000)
    alloc.add_argument("--batch", type=positive_int, default=256)
    alloc.add_argument("--page-size", type=positive_int, default=64)
    alloc.add_argument("--seed", type=non_negative_int, default=0)
    alloc.add_argument("--json", action="store_true")
    moves = sub.add_parser("moves", help="compaction copy bandwidth vs a contiguous copy_")
    moves.add_argument("--page-size", type=positive_int, default=64)
    moves.add_argument("--device", default="cpu", help="cpu or cuda")
    moves.add_argument("--json", action="store_true")
    engine = sub.add_parser("engine", help="serving throughput: kvchain's engine vs transformers' generate_batch "
                            "and batched generate on tiny checkpoints")
    engine.add_argument("--families", default="gemma3,gpt_oss,qwen3_next,nemotron_h",
                        help="comma-separated tiny checkpoint families")
    engine.add_argument("--requests", type=positive_int, default=64)
    engine.add_argument("--seed", type=non_negative_int, default=0)
    engine.add_argument("--repeats", type=positive_int, default=3, help="timed runs per engine; the median counts")
    engine.add_argument("--budget", type=byte_size, default=None, help="kvchain's KV budget (default 4MiB)")
    engine.add_argument("--threads", type=positive_int, default=1, help="torch threads, the same for every engine")
    engine.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..errors import InputError

    if args.bench == "engine":
        return _run_engine(args)
    if args.bench == "alloc":
        from .alloc import run_alloc_bench

        with progress(disable=args.json) as bar:
            task = bar.add_task("bench alloc", total=args.iters)
            result = run_alloc_bench(iters=args.iters, batch=args.batch, page_size=args.page_size,
                                     seed=args.seed, progress=lambda n: bar.advance(task, n))
        rows = [("kvchain us/iter", "kvchain_us_per_iter"), ("static us/iter", "static_us_per_iter"),
                ("ratio (kvchain / static)", "ratio")]
    else:
        import torch

        from .moves import run_moves_bench

        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine")
        if args.device not in ("cpu",) and not args.device.startswith("cuda"):
            raise InputError(f"--device must be cpu or cuda, not {args.device!r}")
        with progress(disable=args.json, unit="repeats") as bar:
            task = bar.add_task("bench moves", total=MOVES_REPEATS)
            result = run_moves_bench(page_size=args.page_size, device=args.device, repeats=MOVES_REPEATS,
                                     progress=lambda n: bar.advance(task, n))
        rows = [("moves GB/s", "moves_gb_per_s"), ("copy_ GB/s", "copy_gb_per_s"), ("ratio (moves / copy_)", "ratio")]
    if args.json:
        print(dump_json(result))
        return 0
    table = Table(title=f"kvchain bench {args.bench}", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    shown = {key for _label, key in rows}
    for key, value in result.items():
        if key not in shown:
            table.add_row(key, str(value))
    for label, key in rows:
        table.add_row(f"[bold]{label}[/]", f"[bold]{result[key]}[/]")
    Console().print(table)
    return 0



def _run_engine(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .engine import DEFAULT_BUDGET, progress_total, render_engine_bench, run_engine_bench

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    with progress(disable=args.json) as bar:
        task = bar.add_task("bench engine", total=progress_total(families, args.repeats))
        result = run_engine_bench(families=families, requests=args.requests, seed=args.seed, repeats=args.repeats,
                                  budget=args.budget or DEFAULT_BUDGET, threads=args.threads,
                                  progress=lambda n: bar.advance(task, n))
    if args.json:
        print(dump_json(result))
    else:
        render_engine_bench(result, Console())
    return 0
