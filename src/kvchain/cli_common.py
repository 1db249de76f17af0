"""What every `kvchain` subcommand shares: flag types that turn bad values into one-line errors,
the model flags, the error line, and the progress bar on stderr.

It sits below `cli.py` and the subcommand modules (`sim/cli.py`, `testing/stress_cli.py`,
`bench/`), so they import it and never `cli.py`: the command table in `cli.py` is the one place
that knows every subcommand, and no import runs back up to it."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import jsonio
from .errors import InputError, KVChainError
from .units import DTYPE_NAMES, parse_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, ProgressColumn
    from rich.table import Table

    from .models.spec import ModelSpec


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


#: the version of every JSON object the commands print; bumped when a documented key changes
SCHEMA_VERSION = 1
#: the largest byte budget a command takes: 1024 TiB is beyond any device, and larger sizes overflow
#: the int64 byte offsets of an arena
MAX_BUDGET_BYTES = 2**50
#: image formats `--plot` writes
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A seed or a count that may be zero."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


#: seeds are drawn into int64 generator state (numpy, torch): a larger one overflows it
MAX_SEED = 2**63 - 1


def path_arg(text: str) -> Path:
    """A path a flag names: never the empty string, which `Path` reads as the current folder."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def path_text(text: str) -> str:
    """`path_arg` for a flag whose value stays a string."""
    return str(path_arg(text))


#: the widest line a command prints as prose (tables wrap or stack to the same width)
WIDTH = 100


def say(text: str) -> None:
    """Print a line of prose wrapped at `WIDTH` columns, its continuation lines indented under its
    first word; a word (a number, a path) is never cut."""
    lead = len(text) - len(text.lstrip(" "))
    print(textwrap.fill(text, WIDTH, subsequent_indent=" " * (lead + 2), break_long_words=False,
                        break_on_hyphens=False))


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**63)."""
    value = non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"at most 2**63 - 1 (a seed is an int64), got {value}")
    return value


def bounded_int(limit: int, why: str):
    """A positive integer of at most `limit`: more would exhaust memory or time (`why` says how)."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"at most {limit:,} ({why}), got {value:,}")
        return value

    parse.__name__ = "integer"
    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number above zero (a rate, a duration)."""
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """A byte budget such as `80GiB`, `512MiB` or a plain number of bytes, at most 1024TiB."""
    try:
        number = float(str(text).strip().rstrip("bBkKmMgGtTpPiI") or "nan")
    except ValueError:
        number = 0.0  # not a number: parse_bytes names the problem
    if math.isnan(number) or math.isinf(number):
        raise argparse.ArgumentTypeError(f"not a finite byte size: {text[:24]!r}{'...' if len(text) > 24 else ''} "
                                         "(the largest budget is 1024TiB)")
    try:
        value = parse_bytes(text)
    except (InputError, OverflowError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > MAX_BUDGET_BYTES:
        raise argparse.ArgumentTypeError(f"{text} is above the largest budget, 1024TiB")
    return value


def share(text: str) -> float:
    """A fraction strictly between 0 and 1."""
    value = _number(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model or --config, and the flags that change how a model's KV state is declared."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a built-in preset (see `kvchain models`)")
    src.add_argument("--config", type=path_text, help="path to a HuggingFace config.json")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--kv-dtype", default=None, help="attention KV dtype: auto (default: the model's 16-bit dtype, "
                        f"bfloat16 for a float32 config, as engines serve it) or one of {', '.join(DTYPE_NAMES)}")
    p.add_argument("--checkpoint-interval", type=positive_int, default=None,
                   help="tokens between cached recurrent-state checkpoints")


def load_model(args: argparse.Namespace) -> ModelSpec:
    """The model the flags of `add_model_args` name."""
    from .models import load_config_file, model_from_config, model_from_preset

    kwargs = {"tp_size": args.tp, "kv_dtype": args.kv_dtype, "checkpoint_interval": args.checkpoint_interval}
    if args.model is not None:
        return model_from_preset(args.model, **kwargs)
    return model_from_config(load_config_file(args.config), **kwargs)


def check_context(model: ModelSpec, context: int | None) -> int:
    """The context length a command plans for: the flag's, at most the model's maximum."""
    if context is not None and context > model.max_context:
        raise InputError(f"--context {context:,} is above {model.name}'s maximum context of {model.max_context:,}")
    return context if context is not None else min(model.max_context, 32768)


def check_model_flags(model: ModelSpec, args: argparse.Namespace) -> None:
    """Refuse flags that mean nothing for the model: state flags for a model without state."""
    if has_state(model):
        return
    for flag, dest in (("--state-slots", "state_slots"), ("--state-share", "state_share"),
                       ("--checkpoint-interval", "checkpoint_interval"), ("--checkpoint-every", "checkpoint_every")):
        if getattr(args, dest, None) is not None:
            raise InputError(f"{flag}: {model.name} has no recurrent state")


def has_state(model: ModelSpec) -> bool:
    """Whether the model declares recurrent state (Mamba, linear attention)."""
    return any(not part.is_attention for decl in model.decls for part in decl.parts)


def read_json_file(path: str | os.PathLike, what: str) -> Any:
    """The JSON document in a file, or one `InputError` naming the file."""
    where = f"{what} {path}"
    return jsonio.loads(jsonio.read_text(path, where), where)


def check_output_file(path: str | os.PathLike, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """Refuse, before any work, a file the command could not write at the end: a folder, a
    missing or read-only parent folder, or a suffix outside `suffixes` (when given)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file name")
    if suffixes and path.suffix.lower() not in suffixes:
        raise InputError(f"{flag} {path}: unsupported suffix {path.suffix or '(none)'!r} (use {', '.join(suffixes)})")
    parent = path.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{flag} {path}: not writable")
    return path


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Refuse, before any work, a folder the command could not write into: an existing file, or
    a folder (or the nearest existing parent of one to create) that is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: is a file, not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: {existing} is not a writable folder")
    return path


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float as None, so the output is valid JSON (which has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dump_json(obj: dict, **kwargs: Any) -> str:
    """A command's JSON output: `schema_version` first, NaN and infinities as null."""
    return json.dumps({"schema_version": SCHEMA_VERSION, **json_safe(obj)}, allow_nan=False, **kwargs)


def report_error(command: str, error: KVChainError | str) -> int:
    """Print a refused command as its one error line on stderr; the exit code is 2."""
    sys.stderr.write(f"kvchain {command}: error: {error}\n")
    return 2


def progress_columns(unit: str = "") -> tuple[str | ProgressColumn, ...]:
    """The bar every long command shows: what runs, the bar, done/total `unit`, the time spent and
    the time left (rich's estimate from the recent pace)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn(unit), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())


def progress(*columns: str | ProgressColumn, disable: bool, unit: str = "", **kwargs: Any) -> Progress:
    """A transient progress bar on stderr (stdout stays for results), off when `disable` or when
    stderr is not a terminal (a pipe or a file gets no bar). With no `columns`, those of
    `progress_columns(unit)`: the bar, done/total, elapsed and the time left."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(*(columns or progress_columns(unit)), console=console, transient=True,
                    disable=disable or not console.is_terminal, **kwargs)


#: the width the tables are laid out for when stdout is not a terminal (a pipe, a file)
TABLE_WIDTH = 100


def output_console() -> Console:
    """Where a command prints its tables: the terminal's own width, or, piped to a file or another
    program, `TABLE_WIDTH` columns (rich would lay them out for 80 and cut names and figures)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            """The reader left (`| head`): rich exits 1 here; the CLI ends quietly with 0 instead."""
            self.quiet = True
            raise BrokenPipeError

    console = _Console()
    return console if console.is_terminal else _Console(width=TABLE_WIDTH)


def _fitted_table(columns: list[str], lead: int) -> Table:
    """Headers are broken onto lines no wider than their figures, so the tables keep their natural
    width; `fold` would break a word rather than hide its end behind an ellipsis, but
    `print_fitted` never lets a table be squeezed that far. The `lead` columns (names) sit left."""
    from rich.table import Table

    table = Table()
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < lead else "right", overflow="fold")
    return table


def natural_width(console: Console, table: Table) -> int:
    """The width `table` takes unsqueezed (measured as if the console had no right edge)."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(10**6), table).maximum


def print_fitted(console: Console, title: str, columns: list[str], rows: list[list[str]], *, lead: int = 1,
                 caption: str | None = None) -> None:
    """One table of `columns`, or, where its natural width is past the console's, consecutive
    tables of as many columns as fit, each led by the first `lead` columns (what names a row): a
    figure or a name is never folded onto two lines nor cut. The title goes above each table and
    `caption` after the last, as text wrapped at the console's width (a table's own title and
    caption wrap at the table's width, a thin column under a narrow table)."""
    def build(cols: list[int]) -> Table:
        table = _fitted_table([columns[i] for i in cols], lead)
        for row in rows:
            table.add_row(*(row[i] for i in cols))
        return table

    head = list(range(lead))
    pending = list(range(lead, len(columns)))
    part = 0
    while pending:
        cols = [*head, pending[0]]
        for i in pending[1:]:
            if natural_width(console, build([*cols, i])) > console.width:
                break
            cols.append(i)
        pending = pending[len(cols) - lead:]
        part += 1
        name = title if part == 1 and not pending else f"{title} ({part})"
        console.print(name, markup=False, highlight=False)
        console.print(build(cols))
    if caption:
        console.print(caption, markup=False, highlight=False)
