"""JSON a user hands in (configs, traces, prompts, saved cases), read as one `InputError` for every
way it can be wrong: bytes that are not UTF-8, a syntax error, a nesting deep enough to exhaust the
parser's recursion, an integer of more digits than Python converts. Every reader of user JSON goes
through here, so each refuses the same inputs with the same one line."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from .errors import InputError


def loads(text: str, where: str, object_hook: Callable[[dict], Any] | None = None) -> Any:
    """The document in `text`; `where` names it in the error (a file, a line of one)."""
    try:
        return json.loads(text, object_hook=object_hook)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer past the interpreter's digit limit
        raise InputError(f"{where}: invalid JSON: {e}") from None


@contextlib.contextmanager
def reading(path: str | Path, where: str) -> Iterator[TextIO]:
    """A UTF-8 text file open for reading (line by line, for a file too long to hold whole), a
    leading byte-order mark dropped (editors on Windows write one); a missing, unreadable or
    undecodable file, found at open or while reading, is one `InputError`."""
    try:
        with Path(path).open(encoding="utf-8-sig") as f:
            yield f
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a folder, not a file") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{where}: cannot read ({e.strerror or e})") from None


def read_text(path: str | Path, where: str) -> str:
    """A file's text as UTF-8, refused as `reading` refuses it."""
    with reading(path, where) as f:
        return f.read()
