"""The `kvchain` command. Every subcommand is one row of `COMMANDS`: a name, its help, the function
that adds its flags and the one that runs it. Any `KVChainError` (or a bad flag) becomes one line on
stderr and exit code 2.

The subcommands that live with their subjects (`sim/cli.py`, `testing/stress_cli.py`, `bench/`,
`generate_cli.py`)
expose their `configure`/`run` pair and import only `cli_common.py`, never this module, so the
table here is the only registration and `python -m kvchain.cli` sees every command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import __version__, bench, generate_cli
from .cli_common import (
    Parser,
    add_model_args,
    byte_size,
    check_context,
    check_model_flags,
    dump_json,
    load_model,
    positive_int,
    report_error,
    share,
)
from .errors import KVChainError
from .sim import cli as sim_cli
from .testing import stress_cli


def add_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=byte_size, required=True, help="bytes for the KV pool, e.g. 80GiB")
    p.add_argument("--page-size", type=positive_int, default=64, help="tokens per page (default 64)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="context length for the request table and concurrency (default: min(model, 32768))")
    p.add_argument("--max-running", type=positive_int, default=256, help="request rows (default 256)")
    slots = p.add_mutually_exclusive_group()
    slots.add_argument("--state-slots", type=positive_int, default=None, help="explicit state slot count")
    slots.add_argument("--state-share", type=share, default=None, help="share of the chain for state slots")


def plan_and_size(args: argparse.Namespace):
    """Model -> plan -> sizing, with the flags every budgeted command shares."""
    from .plan import plan_kv_storage
    from .sizing import size_plan

    model = load_model(args)
    check_model_flags(model, args)
    context = check_context(model, args.context)
    plan = plan_kv_storage(model.decls, page_size=args.page_size)
    sizing = size_plan(plan, args.budget, context_len=context, max_running_requests=args.max_running,
                       state_slots=args.state_slots, state_share=args.state_share)
    return model, plan, sizing


def plan_stages_and_size(args: argparse.Namespace):
    """Model -> one plan per pipeline stage -> each stage sized, the concurrency MIN-reduced."""
    from .plan import plan_stages, stage_layer_ranges
    from .sizing import size_stages

    model = load_model(args)
    check_model_flags(model, args)
    context = check_context(model, args.context)
    plans = plan_stages(model.decls, args.pp, page_size=args.page_size, partition=args.pp_partition)
    sizing = size_stages(plans, args.budget, context_len=context, max_running_requests=args.max_running,
                         state_slots=args.state_slots, state_share=args.state_share)
    ranges = stage_layer_ranges(max(d.layer_id for d in model.decls) + 1, args.pp, args.pp_partition)
    return model, ranges, plans, sizing


def layer_counts(text: str) -> tuple[int, ...]:
    """Layers per pipeline stage, such as `26,22`."""
    return tuple(positive_int(part) for part in text.split(","))


def configure_plan(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_budget_args(p)
    p.add_argument("--json", action="store_true", help="print the plan and sizing as JSON")
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline stages: plan and size each stage's layers (default 1)")
    p.add_argument("--pp-partition", type=layer_counts, default=None,
                   help="layers per stage, comma separated (default: an even split, as engines do)")


def run_plan(args: argparse.Namespace) -> int:
    from .report import plan_report, render_plan, render_stages, stages_report

    if args.pp > 1 or args.pp_partition is not None:
        report = stages_report(*plan_stages_and_size(args))
        if args.json:
            print(dump_json(report, indent=2))
        else:
            render_stages(report)
        return 0
    model, plan, sizing = plan_and_size(args)
    if args.json:
        print(dump_json(plan_report(model, plan, sizing), indent=2))
    else:
        render_plan(model, plan, sizing)
    return 0


def configure_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the presets as JSON")


def run_models(args: argparse.Namespace) -> int:
    from .models import list_presets
    from .report import render_models

    presets = list_presets()
    if args.json:
        print(dump_json({"presets": [p.__dict__ for p in presets]}, indent=2))
    else:
        render_models(presets)
    return 0


@dataclass(frozen=True)
class Command:
    """One subcommand: `configure` adds its flags to its parser, `run` returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: every subcommand, in the order `kvchain --help` lists them
COMMANDS: tuple[Command, ...] = (
    Command("plan", "lay a model's KV state out in one arena for a byte budget", configure_plan, run_plan),
    Command("models", "list the built-in model presets", configure_models, run_models),
    Command("generate", "serve a Hugging Face checkpoint through one kvchain pool (greedy decoding)",
            generate_cli.configure_generate, generate_cli.run_generate),
    Command("make-checkpoint", "write a tiny random checkpoint of a model family to try `generate` on",
            generate_cli.configure_make_checkpoint, generate_cli.run_make_checkpoint),
    Command("bench", "benchmarks that print a ratio against a baseline from the same run",
            bench.configure, bench.run),
    Command("simulate", "serve a workload through kvchain and today's pools, side by side",
            sim_cli.configure, sim_cli.run),
    Command("stress", "page-safety stress harness: random scheduler operations on two modeled ranks, "
            "checked after every operation", stress_cli.configure_stress, stress_cli.run_stress),
    Command("trace", "record allocator traces and compare this checkout against them",
            stress_cli.configure_trace, stress_cli.run_trace),
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvchain", description="One unified KV-cache pool for hybrid models.")
    parser.add_argument("--version", action="version", version=f"kvchain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.configure(p)
        p.set_defaults(run=command.run)
    _name_choices(parser)
    return parser


def _name_choices(parser: argparse.ArgumentParser) -> None:
    """A missing sub-command's error lists the sub-commands ("required: {plan,simulate,...}"), not
    argparse's internal name for them ("command", "action"), at every level."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.metavar = "{" + ",".join(action.choices) + "}"
            for sub in action.choices.values():
                _name_choices(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # an error line names the command as typed: `bench alloc`, `trace compare`
    command = f"{args.command} {args.action}" if getattr(args, "action", None) else args.command
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a reader that left is caught, not at the interpreter's exit
        return code
    except KVChainError as e:
        return report_error(command, e)
    except BrokenPipeError:  # the reader left (`| head`): nothing more to say, as other tools do
        _quiet_stdout()
        return 0
    except OSError as e:  # a write the checks up front could not foresee: a full disk, a read-only mount
        where = f" {e.filename}" if e.filename else ""
        return report_error(command, f"cannot write or read{where}: {e.strerror or e}")
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush into the closed pipe does not
    print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
