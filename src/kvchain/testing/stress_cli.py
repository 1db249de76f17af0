"""`kvchain stress` (HARN-15..17) and `kvchain trace` (TRACE-2/3): the commands over the page-safety
harness and the allocator traces. They own the terminal (a rich progress bar, a summary table);
the library modules they call never print."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .. import jsonio
from ..cli_common import (
    bounded_int,
    check_output_dir,
    check_output_file,
    dump_json,
    output_console,
    path_arg,
    progress,
    read_json_file,
    say,
)
from ..errors import InputError

#: seeds one run may take: each is a job held in memory and run to its end
MAX_SEEDS = 1_000_000
#: operations or steps per seed: a case holds its operations in memory
MAX_OPS = 100_000
#: the largest size field a saved case or trace may give (bytes, rows, tokens, pages): its run
#: allocates that much
MAX_FIELD = 2**30


def _seed_range(text: str) -> range:
    """`A:B` (seeds A..B-1) or a single seed `A`."""
    try:
        if ":" in text:
            a, b = (int(x) for x in text.split(":", 1))
        else:
            a = int(text)
            b = a + 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be A:B or A, not {text!r}") from None
    if a < 0 or b <= a:
        raise argparse.ArgumentTypeError(f"empty or negative seed range {text!r}")
    if b - a > MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"at most {MAX_SEEDS:,} seeds a run, got {b - a:,} in {text!r}")
    return range(a, b)


def _page_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"page sizes must be integers like 1,16,64, not {text!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"page sizes must be positive, got {text!r}")
    return sizes


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rate is a number in [0, 1], not {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a rate is a number in [0, 1], not {text!r}")
    return value


# ----------------------------------------------------------------------------------- shapes


def _field(obj: dict, key: str, kind: str, where: str, *, required: bool = True) -> None:
    """Refuse a field of the wrong JSON type: `int` (>= 0, at most MAX_FIELD), `size` (>= 1),
    `number` (>= 0), `bool`, `str`, `object`, `list` or `ints` (a list of `int`)."""
    if key not in obj:
        if required:
            raise InputError(f"{where}: missing field {key!r}")
        return
    v = obj[key]
    ok = {
        "int": lambda: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_FIELD,
        "size": lambda: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_FIELD,
        "index": lambda: isinstance(v, int) and not isinstance(v, bool) and -MAX_FIELD <= v <= MAX_FIELD,
        "number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_FIELD,
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str),
        "object": lambda: isinstance(v, dict),
        "list": lambda: isinstance(v, list),
        "ints": lambda: isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_FIELD for x in v),
    }[kind]()
    if not ok:
        shown = json.dumps(v)
        raise InputError(f"{where}: field {key!r} must be {_KIND_TEXT[kind]}, got {shown[:60]}")


_KIND_TEXT = {"int": f"an integer in [0, {MAX_FIELD}]", "size": f"an integer in [1, {MAX_FIELD}]",
              "index": f"an integer in [-{MAX_FIELD}, {MAX_FIELD}]", "number": f"a number in [0, {MAX_FIELD}]",
              "bool": "true or false", "str": "a string", "object": "a JSON object", "list": "a list",
              "ints": f"a list of integers in [0, {MAX_FIELD}]"}


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a JSON object, got a JSON {type(value).__name__}")
    return value


def _length(values: list, n: int, where: str, what: str) -> None:
    if len(values) != n:
        raise InputError(f"{where} must hold {n} entries ({what}), got {len(values)}")


def check_case_shape(data: object, where: str) -> None:
    """Refuse a saved stress case whose fields have the wrong types, before it is replayed."""
    from .harness_config import OP_WEIGHTS

    case = _object(data, where)
    config = _object(case.get("config"), f"{where}: config")
    _field(config, "seed", "int", f"{where}: config")
    for key in ("page_size", "state_floats", "chain_bytes", "rows", "context", "max_moves"):
        _field(config, key, "size", f"{where}: config")
    _field(config, "war_barrier", "bool", f"{where}: config")
    _field(config, "profile", "str", f"{where}: config", required=False)
    _field(config, "gap_fraction", "number", f"{where}: config")
    _field(config, "full", "ints", f"{where}: config")
    _length(config["full"], 2, f"{where}: config.full", "[heads, head_dim]")
    _field(config, "windows", "list", f"{where}: config")
    if not config["windows"]:
        raise InputError(f"{where}: config.windows must name at least one window")
    for k, w in enumerate(config["windows"]):
        _field({"window": w}, "window", "ints", f"{where}: config.windows[{k}]")
        _length(w, 3, f"{where}: config.windows[{k}]", "[window, heads, head_dim]")
    _field(config, "timing", "list", f"{where}: config")
    _length(config["timing"], 2, f"{where}: config.timing", "one object per rank")
    for k, t in enumerate(config["timing"]):
        timing = _object(t, f"{where}: config.timing[{k}]")
        _field(timing, "seed", "int", f"{where}: config.timing[{k}]")
        for key in ("forward", "copy", "network", "schedule"):
            _field(timing, key, "number", f"{where}: config.timing[{k}]", required=key != "schedule")
    _field(case, "ops", "list", where)
    for k, op in enumerate(case["ops"]):
        here = f"{where}: ops[{k}]"
        op = _object(op, here)
        if op.get("op") not in OP_WEIGHTS:
            raise InputError(f"{here}: field 'op' must be one of {', '.join(OP_WEIGHTS)}, got {op.get('op')!r}")
        for key, value in op.items():
            if key == "op":
                continue
            if key == "fr" and isinstance(value, list):
                _field(op, key, "list", here)
                for x in value:
                    _field({key: x}, key, "number", here)
            else:
                # a negative pick or start counts from the newest candidate
                kind = "number" if key in ("fr", "dt") else "index" if key in ("pick", "start", "src", "dst") else "int"
                _field(op, key, kind, here)
    if case.get("mutant") is not None:
        _field(case, "mutant", "str", where)
    if case.get("failure") is not None:
        _object(case["failure"], f"{where}: failure")


def check_trace_shape(path: Path) -> None:
    """Refuse a recorded trace whose lines have the wrong shape, before any run is replayed."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except IsADirectoryError:
        raise InputError(f"--trace {path}: is a folder, not a trace file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--trace {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    for k, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{k}"
        run = _object(jsonio.loads(text, where), where)
        _field(run, "run", "str", where)
        config = _object(run.get("config"), f"{where}: config")
        _field(config, "name", "str", f"{where}: config")
        for key in ("page_size", "chain_pages", "rows", "context_pages", "state_floats"):
            _field(config, key, "size", f"{where}: config", required=key == "page_size")
        _field(config, "windows", "ints", f"{where}: config")
        _field(config, "state", "bool", f"{where}: config")
        _field(run, "source", "object", where)
        _field(run, "calls", "list", where)
        for i, entry in enumerate(run["calls"]):
            entry = _object(entry, f"{where}: calls[{i}]")
            if not entry.get("skipped"):
                step = _object(entry.get("step"), f"{where}: calls[{i}].step")
                _field(step, "call", "str", f"{where}: calls[{i}].step")
                _field(entry, "decisions", "list", f"{where}: calls[{i}]", required="raised" not in entry)


# ----------------------------------------------------------------------------------- stress


def configure_stress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=_seed_range, default=range(0, 20), help="seed range A:B (default 0:20)")
    p.add_argument("--ops", type=bounded_int(MAX_OPS, "a case holds its operations in memory"), default=400,
                   help="operations per seed (default 400)")
    p.add_argument("--jobs", type=bounded_int(256, "one process each"), default=1,
                   help="worker processes (default 1)")
    p.add_argument("--minimize", action="store_true", help="shrink each failing sequence to a minimal one")
    p.add_argument("--out", type=path_arg, default=None, help="folder for failing cases (JSON)")
    p.add_argument("--replay", type=path_arg, default=None, help="replay a saved case instead of seeds")
    p.add_argument("--device", default="modeled",
                   help="modeled (default: every check), threads (real CPU threads) or cuda (real streams, "
                        "delayed kernels): threads and cuda check payloads, divergence and the ledger")
    p.add_argument("--mutant", default=None, help="run with one named fault injected (see --list-mutants)")
    p.add_argument("--list-mutants", action="store_true", help="list the mutants and the check each targets")
    p.add_argument("--mutant-table", action="store_true",
                   help="for every mutant (or --mutant's), the seeds its target check catches on --device")
    p.add_argument("--min-rate", type=_rate, default=0.0,
                   help="with --mutant-table: exit 1 when a mutant the device can show is caught by fewer seeds")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--processes", type=int, choices=(1, 2), default=1,
                   help="2: run each seed's two ranks as two real processes over gloo on the loopback interface, "
                        "comparing their decision digests after every operation (default 1: in one process)")


@dataclass
class _Job:
    seed: int
    ops: int
    device: str
    minimize: bool
    out: str | None
    until: str | None
    mutant: str | None


#: the mutant context a worker process entered for its whole life (kept so it stays referenced)
_WORKER_MUTANT: list = []


def _init_worker(mutant: str | None) -> None:
    """Each worker injects the mutant once, for its whole life."""
    import torch

    from . import mutants

    torch.set_num_threads(1)
    context = mutants.applied(mutant)
    context.__enter__()
    _WORKER_MUTANT.append(context)


def _run_seed(job: _Job) -> dict:
    from .harness import minimize, run_case, seed_case

    case = seed_case(job.seed, job.ops)
    case.mutant = job.mutant
    result = run_case(case, job.device, until=job.until)
    out = {"seed": job.seed, "ops": result.ops_run, "seconds": result.seconds, "failure": None, "case": None}
    if result.failure is not None:
        failure = result.failure
        out["failure"] = failure.to_json()
        out["describe"] = failure.describe()
        saved = case
        if job.minimize:
            saved = minimize(case, failure, job.device, check=job.until, until=job.until)
            out["minimized_ops"] = len(saved.ops)
        else:
            saved.ops = saved.ops[: failure.op + 1]
            saved.failure = failure.to_json()
        if job.out:
            path = Path(job.out) / f"seed{job.seed}-{failure.check}.json"
            saved.save(path)
            out["case"] = str(path)
    return out


def _check_processes(args: argparse.Namespace) -> None:
    """Refuse what two rank processes per seed cannot serve, in one line."""
    if args.jobs > 1:
        raise InputError("--processes 2 runs one seed at a time (its two ranks are the processes): drop --jobs")
    if args.minimize:
        raise InputError("--processes 2 does not shrink failures: replay the saved case with --minimize")
    if args.device == "cuda":
        raise InputError("--processes 2 runs on --device modeled or threads (the ranks would share one GPU)")
    if args.replay is not None or args.mutant_table:
        raise InputError("--processes 2 runs seeds: --replay and --mutant-table run in one process")


def _list_mutants(as_json: bool) -> int:
    from .mutants import MUTANTS

    if as_json:
        print(dump_json({"mutants": [{"name": m.name, "target": m.target, "description": m.description}
                                     for m in MUTANTS.values()]}, indent=1))
        return 0
    for m in MUTANTS.values():
        say(f"{m.name}  {m.target}  {m.description}")
    return 0


def _check_device(device: str) -> None:
    if device not in ("modeled", "threads", "cuda"):
        raise InputError(f"--device must be modeled, threads or cuda, not {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine")


def _target(mutant: str | None, device: str) -> str | None:
    """The check a mutant run stops at on `device`; refused where the device cannot show it."""
    from . import mutants
    from .mutant_table import target_on

    if mutant is None:
        return None
    m = mutants.get(mutant)
    target = target_on(m, device)
    if target is None:
        raise InputError(f"--mutant {mutant}: --device {device} cannot show it: {m.real_reason}")
    return target


def _mutant_table(args: argparse.Namespace) -> int:
    """`--mutant-table`: each mutant's catching seeds by its target check, one mutant at a time."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from . import mutants
    from .mutant_table import mutant_row

    if args.device == "cuda" and args.jobs > 1:
        raise InputError("--device cuda runs one job (the ranks share one GPU)")
    names = [mutants.get(args.mutant).name] if args.mutant else list(mutants.MUTANTS)
    seeds = list(args.seeds)
    start = time.perf_counter()
    rows = []
    with progress(TextColumn("[bold]mutants[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), disable=args.json) as bar:
        task = bar.add_task(f"{len(names)} x {len(seeds)} seeds x {args.ops} ops", total=len(names) * len(seeds))
        if args.jobs == 1:
            for name in names:
                rows.append(mutant_row(name, seeds, args.ops, args.device, lambda: bar.update(task, advance=1)))
        else:
            ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
                futures = [pool.submit(mutant_row, name, seeds, args.ops, args.device) for name in names]
                for fut in futures:
                    rows.append(fut.result())
                    bar.update(task, advance=len(seeds))
    short = [r.name for r in rows if r.target is not None and r.rate < args.min_rate]
    summary = {"device": args.device, "seeds": f"{args.seeds.start}:{args.seeds.stop}", "ops": args.ops,
               "seconds": round(time.perf_counter() - start, 2), "min_rate": args.min_rate,
               "mutants": [r.to_json() for r in rows], "below_min_rate": short}
    if args.json:
        print(dump_json(summary, indent=1))
        return 1 if short else 0
    table = Table(title=f"mutants on {args.device}: seeds {summary['seeds']} x {args.ops} ops", title_justify="left")
    for column in ("mutant", "target", "caught", "first seed"):
        table.add_column(column, justify="right" if column in ("caught", "first seed") else "left")
    for r in rows:
        if r.target is None:
            table.add_row(r.name, "-", "cannot show", "-")
            continue
        low = r.rate < args.min_rate
        table.add_row(r.name, r.target, f"[{'red' if low else 'green'}]{len(r.caught)}/{r.seeds}[/]",
                      str(r.caught[0]) if r.caught else "-")
    out = output_console()
    out.print(table)
    for r in rows:
        if r.target is None:
            out.print(f"{r.name}: {r.reason}", markup=False)
    out.print(f"{summary['seconds']:,.1f} s" + (f"; below {args.min_rate:.0%}: {', '.join(short)}" if short else ""))
    return 1 if short else 0


def _replay(args: argparse.Namespace) -> int:

    from . import mutants
    from .harness import Case, run_case

    check_case_shape(read_json_file(args.replay, "--replay"), f"--replay {args.replay}")
    case = Case.load(args.replay)
    mutant = args.mutant or case.mutant
    until = _target(mutant, args.device)
    with mutants.applied(mutant):
        case.mutant = mutant
        result = run_case(case, args.device, until=until)
    console = output_console()
    saved = case.failure
    same = result.failure is not None and saved is not None and saved.get("op") == result.failure.op and \
        list(saved.get("checks", [])) == list(result.failure.checks)
    if args.json:
        print(dump_json({"ops": len(case.ops), "mutant": mutant, "device": args.device,
                         "failure": None if result.failure is None else result.failure.describe(),
                         "saved_failure": saved, "same_as_saved": same}, indent=1))
        return 0 if result.failure is None else 1
    if result.failure is None:
        console.print(f"replayed {len(case.ops)} ops: [green]no failure[/]"
                      + (" (the saved case failed: it no longer reproduces)" if saved else ""))
        return 0
    console.print(f"replayed {len(case.ops)} ops: [red]{result.failure.describe()}[/]")
    if saved is not None:
        console.print("same failure as saved" if same else f"[yellow]differs from the saved failure[/]: {saved}")
    return 1


def run_stress(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    from . import checks, mutants

    if args.list_mutants:
        return _list_mutants(args.json)
    _check_device(args.device)
    if args.processes == 2:
        _check_processes(args)
    if args.mutant_table:
        for flag, given in (("--replay", args.replay is not None), ("--minimize", args.minimize),
                            ("--out", args.out is not None)):
            if given:
                raise InputError(f"--mutant-table counts the seeds each mutant's check catches: {flag} does not apply")
        return _mutant_table(args)
    if args.min_rate:
        raise InputError("--min-rate sets --mutant-table's bar; --mutant-table is not given")
    until = _target(args.mutant, args.device)
    if args.replay is not None:
        for flag, given in (("--minimize", args.minimize), ("--out", args.out is not None)):
            if given:
                raise InputError(f"--replay runs the saved case once: {flag} does not apply")
        return _replay(args)
    if args.device == "cuda" and args.jobs > 1:
        raise InputError("--device cuda runs one job (the ranks share one GPU)")
    if args.device != "modeled" and args.minimize:
        raise InputError("--minimize needs --device modeled (a real device does not replay the same timing)")
    if args.out is not None:
        check_output_dir(args.out, "--out")
    jobs = [_Job(s, args.ops, args.device, args.minimize, str(args.out) if args.out else None, until, args.mutant)
            for s in args.seeds]
    results: list[dict] = []
    start = time.perf_counter()
    with progress(TextColumn("[bold]stress[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                  disable=args.json) as bar:
        task = bar.add_task(f"{len(jobs)} seeds x {args.ops} ops", total=len(jobs), rate="")

        def done(out: dict) -> None:
            results.append(out)
            ops = sum(r["ops"] for r in results)
            failed = sum(1 for r in results if r["failure"])
            bar.update(task, advance=1, rate=f"{ops / (time.perf_counter() - start):,.0f} ops/s"
                            + (f"  [red]{failed} failed[/]" if failed else ""))

        if args.processes == 2:
            from .stress_processes import run_seed_processes

            for job in jobs:
                done(run_seed_processes(job.seed, job.ops, job.device, job.mutant, job.until, job.out))
        elif args.jobs == 1:
            with mutants.applied(args.mutant):
                for job in jobs:
                    done(_run_seed(job))
        else:
            ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_worker,
                                        initargs=(args.mutant,)) as pool:
                for fut in cf.as_completed([pool.submit(_run_seed, job) for job in jobs]):
                    done(fut.result())
    elapsed = time.perf_counter() - start
    results.sort(key=lambda r: r["seed"])
    total_ops = sum(r["ops"] for r in results)
    failed = [r for r in results if r["failure"]]
    by_check = Counter(c for r in failed for c in r["failure"]["checks"])
    summary = {
        "seeds": len(results), "ops": total_ops, "seconds": round(elapsed, 2),
        "ops_per_second": round(total_ops / elapsed, 1) if elapsed else None, "failed_seeds": len(failed),
        "failures_by_check": {c: by_check.get(c, 0) for c in checks.ALL_CHECKS},
        "mutant": args.mutant, "target": until, "device": args.device, "processes": args.processes,
        "failures": [{"seed": r["seed"], "describe": r["describe"], "case": r["case"],
                      "minimized_ops": r.get("minimized_ops")} for r in failed],
    }
    if args.json:
        print(dump_json(summary, indent=1))
        return 1 if failed else 0
    table = Table(title="kvchain stress", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("seeds", f"{args.seeds.start}:{args.seeds.stop} ({len(results)})")
    table.add_row("operations", f"{total_ops:,}")
    table.add_row("seconds", f"{elapsed:,.1f}")
    table.add_row("[bold]operations per second[/]", f"[bold]{summary['ops_per_second']:,.0f}[/]")
    if args.mutant:
        table.add_row("mutant (target check)", f"{args.mutant} ({until})")
    table.add_row("failed seeds", f"[{'red' if failed else 'green'}]{len(failed)}[/]")
    for c in checks.ALL_CHECKS:
        table.add_row(f"  {c}", str(by_check.get(c, 0)))
    out = output_console()
    out.print(table)
    for r in failed[:20]:
        line = f"seed {r['seed']}: {r['describe']}"
        if r.get("minimized_ops") is not None:
            line += f" (minimal: {r['minimized_ops']} ops)"
        if r["case"]:
            line += f" -> {r['case']}"
        out.print(line, overflow="fold", markup=False)
    if len(failed) > 20:
        out.print(f"... and {len(failed) - 20} more failed seeds")
    return 1 if failed else 0



# ----------------------------------------------------------------------------------- trace


def configure_trace(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    rec = sub.add_parser("record", help="record allocator traces from the scenarios and seeds")
    rec.add_argument("--page-sizes", type=_page_sizes, default=[1, 16, 64], help="e.g. 1,16,64 (default)")
    rec.add_argument("--out", type=path_arg, required=True, help="the JSONL trace to write")
    rec.add_argument("--seeds", type=_seed_range, default=range(0, 4), help="seeded runs per configuration (0:4)")
    rec.add_argument("--steps", type=bounded_int(MAX_OPS, "a run holds its steps in memory"), default=120,
                     help="steps per seeded run (default 120)")
    rec.add_argument("--scenarios", type=path_arg, default=None, help="scenario folder (default tests/scenarios)")
    cmp = sub.add_parser("compare", help="replay a recorded trace against this checkout")
    cmp.add_argument("--trace", type=path_arg, required=True, help="a JSONL trace from `kvchain trace record`")
    cmp.add_argument("--json", action="store_true", help="print one JSON object per run")


def _scenario_folder(path: Path | None) -> Path:
    if path is not None:
        if not path.is_dir():
            raise InputError(f"--scenarios {path}: not a folder")
        return path
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        folder = base / "tests" / "scenarios"
        if folder.is_dir():
            return folder
    raise InputError("no tests/scenarios folder found; pass --scenarios")


def run_trace(args: argparse.Namespace) -> int:

    from . import trace

    console = output_console()
    if args.action == "record":
        check_output_file(args.out, "--out")
        scenarios = trace.load_scenarios(_scenario_folder(args.scenarios))
        n = trace.write_jsonl(trace.record_runs(args.page_sizes, scenarios, args.seeds, args.steps), args.out)
        console.print(f"recorded {n} runs ({len(scenarios)} scenarios, seeds {args.seeds.start}:{args.seeds.stop}, "
                      f"page sizes {','.join(map(str, args.page_sizes))}) -> {args.out}")
        return 0
    check_trace_shape(args.trace)
    diverged = 0
    runs = 0
    for run in trace.read_jsonl(args.trace):
        runs += 1
        found = trace.replay(trace.StorageAdapter(run.config), run)
        if found is not None:
            diverged += 1
        if args.json:
            print(dump_json({"run": run.name, "matches": found is None,
                              "divergence": None if found is None else {"call": found.call, "what": found.what}}))
        elif found is None:
            console.print(f"{run.name}: [green]matches[/] ({len(run.calls)} calls)")
        else:
            console.print(found.describe(run.name), markup=False)
    if not runs:
        raise InputError(f"--trace {args.trace}: no runs in the file")
    if not args.json:
        console.print(f"{runs - diverged} of {runs} runs match" + (f", {diverged} diverge" if diverged else ""))
    return 1 if diverged else 0

