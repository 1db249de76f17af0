"""Every `KVCHAIN_*` environment variable, declared once with its default and meaning.

Nothing else in the package reads `os.environ`: call `env.get(NAME)` (read at call time, so tests
can set variables with monkeypatch)."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

from .errors import EnvVarError


def _live_lookup() -> Callable[[str], str | None]:
    """A read of one variable as `os.environ` holds it now, without `os.environ.get`'s cost.

    On POSIX CPython `os.environ` writes through to one dict of encoded bytes (`os.environb`'s
    too); a plain `get` on it sees every set and delete at once, at a dict lookup's cost, where
    `os.environ.get` of an unset name raises and catches a KeyError inside (about 1 us: the hot
    path asks for the check level several times a step). Anywhere else, `os.environ.get`."""
    data = getattr(os.environ, "_data", None)
    if (os.name != "posix" or type(data) is not dict or getattr(os, "environb", None) is None
            or os.environb._data is not data):
        return os.environ.get
    enc = os.environ.encodekey
    dec = os.environ.decodevalue
    keys: dict[str, bytes] = {}  # each name encoded once

    def lookup(name: str) -> str | None:
        key = keys.get(name)
        if key is None:
            key = keys[name] = enc(name)
        raw = data.get(key)
        return None if raw is None else dec(raw)

    return lookup


#: `os.environ.get`, read live (`_live_lookup`)
_getenv = _live_lookup()


class InvariantCheckLevel(enum.IntEnum):
    """`KVCHAIN_INVARIANT_CHECK`: 0 off, 1 warn (fatal checks still raise), 2 strict."""

    OFF = 0
    WARN = 1
    STRICT = 2


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    parse: Callable[[str], object]
    doc: str


def _bool(text: str) -> bool:
    return text.strip().lower() in {"1", "true", "yes", "on"}


def _level(text: str) -> InvariantCheckLevel:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value not in (0, 1, 2):
        raise EnvVarError(f"KVCHAIN_INVARIANT_CHECK must be 0, 1 or 2, not {text!r}")
    return InvariantCheckLevel(value)


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("KVCHAIN_INVARIANT_CHECK", None, _level, "Invariant check level: 0 off, 1 warn, 2 strict."),
        EnvVar(
            "KVCHAIN_ENABLE_ASYNC_ASSERT",
            None,
            _bool,
            "Older switch: when set and KVCHAIN_INVARIANT_CHECK is unset, the level is strict.",
        ),
        EnvVar(
            "KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL",
            "64",
            int,
            "Most pages one opportunistic flush moves per band per call.",
        ),
        EnvVar(
            "KVCHAIN_LAZY_COMPACTION_GAP_FRACTION",
            "0.25",
            float,
            "An opportunistic flush moves pages in an end band only while the free gap beside it is "
            "below this fraction of the chain (0: only when its neighbour touches it; 1: always).",
        ),
        EnvVar(
            "KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE",
            "1",
            _bool,
            "An idle leak raises instead of warning.",
        ),
        EnvVar(
            "KVCHAIN_CHECK_KV_PAGE_INVARIANTS",
            "0",
            _bool,
            "Check request-length bounds every busy iteration.",
        ),
        EnvVar("KVCHAIN_LOG_LAZY_COMPACTION_STATS", "0", _bool, "Log compaction counters per sub-pool."),
        EnvVar(
            "KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH",
            "0",
            _bool,
            "A PD decode node publishes destination ids in a later iteration, read back on a stream of "
            "their own (PD-12, PD-13); only under the overlap scheduler, on a device with real stream "
            "asynchrony, without pipeline parallelism.",
        ),
        EnvVar(
            "KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT",
            "600",
            float,
            "Seconds a host wait for a transfer may last before it raises naming the transfers in flight.",
        ),
    )
}


def get(name: str) -> object:
    """The parsed value of a declared variable (its default when unset; None when it has none)."""
    var = VARIABLES.get(name)
    if var is None:
        raise EnvVarError(f"{name} is not a declared variable ({len(VARIABLES)} are: see kvchain.env.VARIABLES)")
    raw = _getenv(name)
    if raw is None or raw == "":
        return None if var.default is None else var.parse(var.default)
    try:
        return var.parse(raw)
    except EnvVarError:
        raise
    except ValueError:
        kind = getattr(var.parse, "__name__", "value").lstrip("_")
        raise EnvVarError(f"{name}={raw!r} does not parse as {kind} (default {var.default!r})") from None


_LEVELS = {str(int(v)): v for v in InvariantCheckLevel}


def invariant_level() -> InvariantCheckLevel:
    """The effective check level: unset means off, or strict when the older assert switch is set.
    Read at most once per allocator operation (at its first check, `alloc.invariants.level`), so
    it stays cheap: two lookups, no parsing unless a value is set."""
    raw = _getenv("KVCHAIN_INVARIANT_CHECK")
    if raw:
        level = _LEVELS.get(raw.strip())
        return level if level is not None else _level(raw)
    if _getenv("KVCHAIN_ENABLE_ASYNC_ASSERT") and get("KVCHAIN_ENABLE_ASYNC_ASSERT"):
        return InvariantCheckLevel.STRICT
    return InvariantCheckLevel.OFF
