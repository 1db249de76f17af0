"""The `kvchain` command. Each subcommand parses its flags here and calls the library; any
`KVChainError` (or a bad flag) becomes one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from .errors import InputError, KVChainError
from .units import parse_bytes


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a built-in preset (see `kvchain models`)")
    src.add_argument("--config", help="path to a HuggingFace config.json")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--kv-dtype", default=None, help="attention KV dtype (default: the model's)")
    p.add_argument("--checkpoint-interval", type=_positive_int, default=None,
                   help="tokens between cached recurrent-state checkpoints")


def add_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=_byte_size, required=True, help="bytes for the KV pool, e.g. 80GiB")
    p.add_argument("--page-size", type=_positive_int, default=64, help="tokens per page (default 64)")
    p.add_argument("--context", type=_positive_int, default=None,
                   help="context length for the request table and concurrency (default: min(model, 32768))")
    p.add_argument("--max-running", type=_positive_int, default=256, help="request rows (default 256)")
    slots = p.add_mutually_exclusive_group()
    slots.add_argument("--state-slots", type=_positive_int, default=None, help="explicit state slot count")
    slots.add_argument("--state-share", type=_share, default=None, help="share of the chain for state slots")


def load_model(args: argparse.Namespace):
    from .models import load_config_file, model_from_config, model_from_preset

    kwargs = {"tp_size": args.tp, "kv_dtype": args.kv_dtype, "checkpoint_interval": args.checkpoint_interval}
    if args.model:
        return model_from_preset(args.model, **kwargs)
    return model_from_config(load_config_file(args.config), **kwargs)


def plan_and_size(args: argparse.Namespace):
    """Model -> plan -> sizing, with the flags every budgeted command shares."""
    from .plan import plan_kv_storage
    from .sizing import size_plan

    model = load_model(args)
    plan = plan_kv_storage(model.decls, page_size=args.page_size)
    context = args.context or min(model.max_context, 32768)
    sizing = size_plan(plan, args.budget, context_len=context, max_running_requests=args.max_running,
                       state_slots=args.state_slots, state_share=args.state_share)
    return model, plan, sizing


def cmd_plan(args: argparse.Namespace) -> int:
    from .report import plan_report, render_plan

    model, plan, sizing = plan_and_size(args)
    if args.json:
        print(json.dumps(plan_report(model, plan, sizing), indent=2))
    else:
        render_plan(model, plan, sizing)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .models import list_presets
    from .report import render_models

    presets = list_presets()
    if args.json:
        print(json.dumps([p.__dict__ for p in presets], indent=2))
    else:
        render_models(presets)
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help_text: str):
    def register(configure: Callable[[argparse.ArgumentParser], None]):
        def bind(run: Callable[[argparse.Namespace], int]):
            COMMANDS[name] = (help_text, configure, run)
            return run

        return bind

    return register


def _configure_plan(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_budget_args(p)
    p.add_argument("--json", action="store_true", help="print the plan and sizing as JSON")


def _configure_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the presets as JSON")


command("plan", "lay a model's KV state out in one arena for a byte budget")(_configure_plan)(cmd_plan)
command("models", "list the built-in model presets")(_configure_models)(cmd_models)


def _register_optional() -> None:
    """Subcommands that live with their subjects register themselves on import."""
    from . import bench  # noqa: F401
    from .sim import cli as _sim_cli  # noqa: F401
    from .testing import stress_cli  # noqa: F401


def build_parser() -> argparse.ArgumentParser:
    _register_optional()
    parser = _Parser(prog="kvchain", description="One unified KV-cache pool for hybrid models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, configure, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KVChainError as e:
        sys.stderr.write(f"kvchain {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
