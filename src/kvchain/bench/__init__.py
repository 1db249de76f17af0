"""Benchmarks behind `kvchain bench`: each prints a ratio against a baseline measured in the same
run (machines are noisy; absolute numbers are not comparable across runs, ratios are)."""

from __future__ import annotations

import argparse

from ..cli_common import (
    bounded_int,
    byte_size,
    dump_json,
    output_console,
    positive_int,
    progress,
    say,
    seed_int,
    share,
)

#: the pressure profile's default: its chain's bytes over the peak bytes the workload's requests
#: would hold if none were ever refused (here, so `--help` imports nothing heavy)
DEFAULT_PRESSURE = 0.9
#: timed repeats and requests a bench takes: more would run for hours on the tiny checkpoints
REPEATS = bounded_int(1000, "each repeat times every cell again")
REQUESTS = bounded_int(10_000, "each request is served in every repeat")
#: `bench alloc`'s iterations and batch: each iteration is timed in every profile and keeps a
#: sample; a batch past any engine's replays more rows per iteration than a run can time
ITERS = bounded_int(1_000_000, "each iteration runs in every profile and keeps its samples")
BATCH = bounded_int(65_536, "each iteration steps every running request in every profile")


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    alloc = sub.add_parser("alloc", help="host us per decode iteration: chain allocator vs a static pool")
    alloc.add_argument("--iters", type=ITERS, default=2000, help="timed decode iterations per profile (default 2000)")
    alloc.add_argument("--batch", type=BATCH, default=256, help="running requests per iteration (default 256)")
    alloc.add_argument("--page-size", type=positive_int, default=64, help="tokens per page (default 64)")
    alloc.add_argument("--seed", type=seed_int, default=0, help="the request stream's seed (default 0)")
    alloc.add_argument("--profile", choices=("both", "roomy", "pressure"), default="both",
                       help="roomy: 4x the workload's bytes, nothing moves; pressure: --pressure of them")
    alloc.add_argument("--pressure", type=share, default=None,
                       help="the pressure profile's chain bytes over the workload's unrefused peak "
                            f"(default {DEFAULT_PRESSURE})")
    alloc.add_argument("--json", action="store_true", help="print the result as JSON")
    moves = sub.add_parser("moves", help="compaction copy bandwidth vs a contiguous copy_, "
                           "swept over page sizes and torch threads")
    moves.add_argument("--repeats", type=REPEATS, default=5, help="per cell; the median counts")
    moves.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    moves.add_argument("--json", action="store_true", help="print the result as JSON")
    host = sub.add_parser("host", help="host-tier copy bandwidth of real page batches (backup, load) vs a "
                          "contiguous copy_ of the same bytes, swept over page sizes")
    host.add_argument("--repeats", type=REPEATS, default=5, help="per cell; the median counts")
    host.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    host.add_argument("--json", action="store_true", help="print the result as JSON")
    engine = sub.add_parser("engine", help="serving throughput: kvchain's engine vs transformers' generate_batch "
                            "and batched generate on tiny checkpoints")
    engine.add_argument("--families", default="gemma3,gpt_oss,qwen3_next,nemotron_h",
                        help="comma-separated tiny checkpoint families")
    engine.add_argument("--requests", type=REQUESTS, default=64, help="requests served per run (default 64)")
    engine.add_argument("--seed", type=seed_int, default=0, help="the workload's seed (default 0)")
    engine.add_argument("--repeats", type=REPEATS, default=3, help="timed runs per engine; the median counts")
    engine.add_argument("--budget", type=byte_size, default=None, help="kvchain's KV budget (default 4MiB)")
    engine.add_argument("--threads", type=bounded_int(1024, "torch's thread pool"), default=1, help="torch threads, the same for every engine")
    engine.add_argument("--json", action="store_true", help="print the result as JSON")
    pd = sub.add_parser("pd", help="PD transfer bandwidth of real page batches vs the transfer engine's "
                        "large-buffer bandwidth, between two loopback processes")
    pd.add_argument("--engine", choices=("nixl", "gloo"), default="nixl", help="the data plane (default nixl)")
    pd.add_argument("--repeats", type=REPEATS, default=5, help="batch and baseline pairs; medians count")
    pd.add_argument("--requests", type=REQUESTS, default=8, help="requests in the batch")
    pd.add_argument("--tokens", type=positive_int, default=2048, help="tokens per request")
    pd.add_argument("--budget", type=byte_size, default=256 * 2**20, help="each process's KV budget (default 256MiB)")
    pd.add_argument("--json", action="store_true", help="print the result as JSON")
    spec = sub.add_parser("spec", help="target forwards per generated token with and without a draft "
                          "(speculative decoding) on a tiny checkpoint")
    spec.add_argument("--family", default="qwen3_next", help="a tiny checkpoint family")
    spec.add_argument("--requests", type=REQUESTS, default=8, help="requests served (default 8)")
    spec.add_argument("--num-speculative-tokens", type=positive_int, default=3, help="draft tokens a round proposes (default 3)")
    spec.add_argument("--draft", default="whole", help="first: the target's first layers; whole: all of them")
    spec.add_argument("--max-new-tokens", type=bounded_int(4096, "the tiny checkpoints' context"), default=24)
    spec.add_argument("--seed", type=seed_int, default=0, help="the workload's seed (default 0)")
    spec.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError

    if args.action == "engine":
        return _run_engine(args)
    if args.action == "pd":
        return _run_pd(args)
    if args.action == "host":
        return _run_host(args)
    if args.action == "spec":
        from .spec import render_spec_bench, run_spec_bench

        result = run_spec_bench(family=args.family, requests=args.requests, k=args.num_speculative_tokens,
                                draft=args.draft, max_new_tokens=args.max_new_tokens, seed=args.seed)
        if args.json:
            print(dump_json(result))
        else:
            render_spec_bench(result, output_console())
        return 0
    if args.action == "alloc":
        from .alloc import PROFILES, run_alloc_bench

        profiles = PROFILES if args.profile == "both" else (args.profile,)
        if args.pressure is not None and "pressure" not in profiles:
            raise InputError("--pressure sizes the pressure profile, which --profile roomy leaves out")
        with progress(disable=args.json, unit="iterations") as bar:
            task = bar.add_task("bench alloc", total=args.iters)
            result = run_alloc_bench(iters=args.iters, batch=args.batch, page_size=args.page_size, seed=args.seed,
                                     profiles=profiles,
                                     pressure=DEFAULT_PRESSURE if args.pressure is None else args.pressure,
                                     progress=lambda n: bar.advance(task, n))
        if args.json:
            print(dump_json(result))
            return 0
        _print_titled(alloc_title(result), alloc_table(result))
        return 0
    import torch

    from .moves import default_threads, run_moves_bench

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda: CUDA is not available on this machine")
    if args.device not in ("cpu",) and not args.device.startswith("cuda"):
        raise InputError(f"--device must be cpu or cuda, not {args.device!r}")
    from .moves import SWEEP_LAYERS

    with progress(disable=args.json, unit="cells") as bar:
        task = bar.add_task("bench moves", total=len(SWEEP_LAYERS) * len(default_threads()))
        result = run_moves_bench(repeats=args.repeats, device=args.device, progress=lambda n: bar.advance(task, n))
    if args.json:
        print(dump_json(result))
        return 0
    _print_titled(moves_title(result), moves_table(result))
    return 0


ALLOC_COLUMNS = (("kvchain us/iter", "kvchain_us_per_iter"), ("static us/iter", "static_us_per_iter"),
                 ("ratio", "ratio"), ("util mean", "utilisation_mean"), ("reliefs", "reliefs"),
                 ("moves", "moves"), ("moved GiB (what a device would copy)", "moved_bytes"), ("relocations", "relocations"), ("preemptions", "preemptions"), ("refused takes", "refused_takes"),
                 ("budget GiB", "budget_bytes"), ("static GiB", "static_pool_bytes"),
                 ("boundary checks' cost (own time)", "boundary_ratio"))


def _print_titled(title: str, table) -> None:
    """A bench's title as a line of prose (wrapped at 100 columns, not at the table's width), then
    its table."""
    say(title)
    output_console().print(table)


def alloc_title(result: dict) -> str:
    head = result["headline"]
    return (f"kvchain bench alloc: batch {result['batch']}, {result['iters']} iterations, medians of blocks of "
            f"{result['block']}; worst ratio {head['ratio']} ({head['worst_profile']})")


def _alloc_cell(key: str, value) -> str:
    """One figure of `alloc_table`, in its row's one format."""
    if key.endswith("_bytes"):
        return f"{value / 2**30:.2f}"
    if key == "utilisation_mean":
        return f"{value:.1%}"
    if isinstance(value, int):
        return f"{value:,}"
    if key.endswith("_us_per_iter"):
        return f"{value:.2f}"
    return f"{value:.3f}" if key == "ratio" else f"{value:.4f}"


def alloc_table(result: dict):
    """A row per figure, a column per profile (the title is `alloc_title`)."""
    from rich.table import Table

    table = Table()
    table.add_column("")
    profiles = result["profiles"]
    for name in profiles:
        table.add_column(name, justify="right")
    for label, key in ALLOC_COLUMNS:
        cells = [_alloc_cell(key, row[key]) for row in profiles.values()]
        table.add_row(f"[bold]{label}[/]" if key == "ratio" else label, *cells)
    return table


def moves_title(result: dict) -> str:
    head = result["headline"]
    return (f"kvchain bench moves on {result['device']}, medians of {result['repeats']}; worst ratio "
            f"{head['worst_ratio']} ({head['page_bytes'] // 1024} KiB pages, {head['threads']} threads)")


def moves_table(result: dict):
    """A row per cell of the sweep (the title is `moves_title`)."""
    from rich.table import Table

    table = Table()
    for label in ("page KiB", "threads", "pages moved", "moves GB/s", "copy_ GB/s", "ratio (moves / copy_)"):
        table.add_column(label, justify="right")
    for c in result["cells"]:
        table.add_row(f"{c['page_bytes'] // 1024:,}", str(c["threads"]), f"{c['pages_moved']:,}",
                      f"{c['moves_gb_per_s']:.2f}", f"{c['copy_gb_per_s']:.2f}", f"{c['ratio']:.3f}")
    return table


def _run_engine(args: argparse.Namespace) -> int:
    from .engine import DEFAULT_BUDGET, progress_total, render_engine_bench, run_engine_bench

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    with progress(disable=args.json, unit="runs") as bar:
        task = bar.add_task("bench engine", total=progress_total(families, args.repeats))
        result = run_engine_bench(families=families, requests=args.requests, seed=args.seed, repeats=args.repeats,
                                  budget=args.budget or DEFAULT_BUDGET, threads=args.threads,
                                  progress=lambda n: bar.advance(task, n))
    if args.json:
        print(dump_json(result))
    else:
        render_engine_bench(result, output_console())
    return 0


def _run_pd(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..dist.transfer import TransferError, nixl_available
    from .pd import run_pd_bench

    if args.engine == "nixl" and nixl_available() is not None:
        raise TransferError(f"--engine nixl: {nixl_available()} (give --engine gloo)")
    result = run_pd_bench(engine=args.engine, repeats=args.repeats, requests=args.requests, tokens=args.tokens,
                          budget=args.budget)
    if args.json:
        print(dump_json(result))
        return 0
    table = Table()
    for label in ("page batch GB/s", "large buffer GB/s", "ratio (batch / large)"):
        table.add_column(label, justify="right")
    table.add_row(str(result["batch_gb_per_s"]), str(result["large_gb_per_s"]), str(result["ratio"]))
    _print_titled(f"kvchain bench pd over {result['engine']}: {result['requests']} requests of {result['tokens']} "
                  f"tokens, {result['bytes']:,} bytes in {result['segments']} segments, medians of "
                  f"{result['repeats']}", table)
    return 0


def _run_host(args: argparse.Namespace) -> int:
    from .host import SWEEP_LAYERS, _backend, host_table, host_title, run_host_bench

    _backend(args.device).__getitem__(0).close()  # refuses an unknown device or a missing CUDA first
    with progress(disable=args.json, unit="cells") as bar:
        task = bar.add_task("bench host", total=len(SWEEP_LAYERS))
        result = run_host_bench(repeats=args.repeats, device=args.device, progress=lambda n: bar.advance(task, n))
    if args.json:
        print(dump_json(result))
        return 0
    _print_titled(host_title(result), host_table(result))
    return 0
