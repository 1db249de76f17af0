"""What every `kvchain` subcommand shares: flag types that turn bad values into one-line errors,
the model flags, the error line, and the progress bar on stderr.

It sits below `cli.py` and the subcommand modules (`sim/cli.py`, `testing/stress_cli.py`,
`bench/`), so they import it and never `cli.py`: the command table in `cli.py` is the one place
that knows every subcommand, and no import runs back up to it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from .errors import InputError, KVChainError
from .units import parse_bytes

if TYPE_CHECKING:
    from rich.progress import Progress, ProgressColumn

    from .models.spec import ModelSpec


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def byte_size(text: str) -> int:
    """A byte budget such as `80GiB`, `512MiB` or a plain number of bytes."""
    try:
        return parse_bytes(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def share(text: str) -> float:
    """A fraction strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model or --config, and the flags that change how a model's KV state is declared."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a built-in preset (see `kvchain models`)")
    src.add_argument("--config", help="path to a HuggingFace config.json")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--kv-dtype", default=None, help="attention KV dtype (default: the model's)")
    p.add_argument("--checkpoint-interval", type=positive_int, default=None,
                   help="tokens between cached recurrent-state checkpoints")


def load_model(args: argparse.Namespace) -> ModelSpec:
    """The model the flags of `add_model_args` name."""
    from .models import load_config_file, model_from_config, model_from_preset

    kwargs = {"tp_size": args.tp, "kv_dtype": args.kv_dtype, "checkpoint_interval": args.checkpoint_interval}
    if args.model:
        return model_from_preset(args.model, **kwargs)
    return model_from_config(load_config_file(args.config), **kwargs)


def report_error(command: str, error: KVChainError) -> int:
    """Print a refused command as its one error line on stderr; the exit code is 2."""
    sys.stderr.write(f"kvchain {command}: error: {error}\n")
    return 2


def progress(*columns: str | ProgressColumn, disable: bool, **kwargs: Any) -> Progress:
    """A transient progress bar on stderr (stdout stays for results), off when `disable`."""
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(stderr=True), transient=True, disable=disable, **kwargs)
