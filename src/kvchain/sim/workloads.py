"""Seeded synthetic workloads and trace replay for the model-free scheduler.

Every generator is `fn(n_requests, seed, **params) -> list[ScheduledRequest]`: deterministic for a seed,
request ids 0..n-1 in arrival order, arrivals integer scheduler steps from a Poisson process whose
long-run rate is `rate` requests per step. Token ids are drawn from a seeded generator over
[1, 2**31), so parts meant to be shared are byte-identical (a prefix tree matches them) and parts
not meant to be shared differ at their first token except with probability ~2**-31.

Each request carries its output token ids explicitly, so a later turn of a session can contain
exactly what the earlier turn generated and the prefix tree can match across turns.

Traces are JSONL, one request per line, with the public Mooncake fields (`timestamp` in ms,
`input_length`, `output_length`, `hash_ids`) plus our own optional ones (`arrival_step`, `rid`,
`max_new`). See docs/workloads.md.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import jsonio
from ..engine.request import MAX_REQUEST_TOKENS, ScheduledRequest
from ..errors import InputError
from ..units import is_finite_number, is_integer

VOCAB = 2**31  # token ids are drawn from [1, VOCAB): collisions between unrelated parts are ~2**-31
#: the most requests a generated workload holds (each holds its prompt and output tokens)
MAX_WORKLOAD_REQUESTS = 10_000_000
#: the most tokens (prompts plus outputs) one trace replay may hold: 4 GiB of int32 token ids
MAX_TRACE_TOKENS = 2**30

Workload = Callable[..., list[ScheduledRequest]]


# -- shared helpers -------------------------------------------------------------------------------


@dataclass
class _Spec:
    """A request before ids are assigned: arrival is a float time in steps."""

    arrival: float
    prompt: np.ndarray
    output_len: int
    max_new: int
    output: np.ndarray
    #: a closed-loop session's next turn: the index (in the generator's list) of the turn whose
    #: finish releases it, and the steps after that finish it arrives
    follows: int = -1
    gap: float = 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message)


def _integer(least: int, **values: Any) -> None:
    """Each of `values` an integer (a numpy one counts, a bool does not) of at least `least`."""
    for name, v in values.items():
        _check(is_integer(v) and v >= least, f"{name} must be an integer >= {least}, got {v!r}")


def _finite(least: float, **values: Any) -> None:
    """Each of `values` a finite number (not a bool) of at least `least`, or above it where `least` is 0."""
    for name, v in values.items():
        ok = is_finite_number(v) and (v > 0 if least == 0 else v >= least)
        _check(ok, f"{name} must be a finite number {'above 0' if least == 0 else f'>= {least}'}, got {v!r}")


def _trace_path(path: Any) -> Path:
    _check(isinstance(path, (str, os.PathLike)), f"a trace path must be a str or a path, not {type(path).__name__}")
    return Path(path)


def _rng(n_requests: int, seed: int) -> np.random.Generator:
    _integer(0, n_requests=n_requests, seed=seed)
    _check(n_requests <= MAX_WORKLOAD_REQUESTS, f"n_requests must be at most {MAX_WORKLOAD_REQUESTS:,} "
           f"(each request holds its tokens in memory), got {n_requests:,}")
    return np.random.default_rng(int(seed))


def _positive(**values: float) -> None:
    for name, v in values.items():
        _check(v > 0, f"{name} must be positive, got {v!r}")


def _non_negative(**values: float) -> None:
    for name, v in values.items():
        _check(v >= 0, f"{name} must be >= 0, got {v!r}")


def _common(rate: float, max_len: int, max_new_slack: float) -> None:
    _positive(rate=rate)
    _check(max_len >= 2, f"max_len must be >= 2, got {max_len!r}")
    _check(max_new_slack >= 1.0, f"max_new_slack must be >= 1.0, got {max_new_slack!r}")


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, VOCAB, size=int(n), dtype=np.int32)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal length with the given median, clipped to [lo, hi]."""
    v = round(median * math.exp(sigma * rng.standard_normal()))
    return min(max(v, lo), hi)


def _poisson_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times (steps, float) of a Poisson process; the first arrives at 0."""
    if n == 0:
        return np.zeros(0)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _output(rng: np.random.Generator, output_len: int, slack: float, room: int) -> tuple[int, np.ndarray]:
    """max_new (what the client asks for: output_len times the slack, within the room left under
    max_len) and the max_new output token ids."""
    max_new = min(max(output_len, math.ceil(output_len * slack)), room)
    return max_new, _tokens(rng, max_new)


def _finalize(specs: list[_Spec]) -> list[ScheduledRequest]:
    """Sort by arrival (ties keep generation order), number 0..n-1, floor arrivals to steps."""
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival, i))
    rid_of = {i: rid for rid, i in enumerate(order)}
    out = []
    for rid, i in enumerate(order):
        s = specs[i]
        out.append(ScheduledRequest(rid, math.floor(s.arrival), s.prompt, s.max_new, s.output_len,
                              output=s.output, follows=rid_of[s.follows] if s.follows >= 0 else -1,
                              gap=math.floor(s.gap)))
    return out


def _sessions(rng: np.random.Generator, n: int, *, rate: float, mean_turns: float,
              opening: Callable[[], np.ndarray], continuation: Callable[[], np.ndarray],
              output_len: Callable[[int], int], gap_mean: float, prefill_per_step: int, max_len: int,
              slack: float, closed_loop: bool = False) -> list[_Spec]:
    """Sessions of turns: turn k+1's prompt is turn k's prompt + its output + `continuation()`, and
    it arrives no earlier than turn k could have finished (its prefill at `prefill_per_step`
    tokens a step, then one output token a step) plus an exponential gap. Session starts are a
    Poisson process at rate / mean_turns, so requests arrive at `rate` in the long run. A session
    ends early when its next prompt would leave no room under max_len.

    Open loop (the default) fixes every arrival in advance: on a pool that serves slower than an
    idle one, a turn arrives while the turn before it still waits or runs. `closed_loop` makes
    turn k+1 follow turn k: it arrives its gap after turn k really finishes (the scheduler holds
    it, `ScheduledRequest.follows`), as a user answers only what they have read."""
    specs: list[_Spec] = []
    start = 0.0
    first = True
    while len(specs) < n:
        if not first:
            start += rng.exponential(mean_turns / rate)
        first = False
        turns = 1 + int(rng.poisson(mean_turns - 1.0))
        prompt = opening()
        at = start
        follows, gap = -1, 0.0
        for k in range(turns):
            if len(specs) >= n or len(prompt) >= max_len:
                break
            out_len = output_len(max_len - len(prompt))
            max_new, output = _output(rng, out_len, slack, max_len - len(prompt))
            specs.append(_Spec(at, prompt, out_len, max_new, output, follows, gap))
            if k == turns - 1:
                break
            busy = math.ceil(len(prompt) / prefill_per_step) + out_len - 1
            gap = rng.exponential(gap_mean) if gap_mean > 0 else 0.0
            at += busy + 1 + gap
            if closed_loop:
                follows = len(specs) - 1
            prompt = np.concatenate([prompt, output[:out_len], continuation()])
    return specs


# -- generators -----------------------------------------------------------------------------------


def chat(n_requests: int, seed: int, *, rate: float = 0.5, prompt_median: float = 1000.0,
         prompt_sigma: float = 1.0, output_median: float = 300.0, output_sigma: float = 0.8,
         max_len: int = 16384, max_new_slack: float = 1.0) -> list[ScheduledRequest]:
    """Independent requests with lognormal prompt (median 1000) and output (median 300) lengths."""
    rng = _rng(n_requests, seed)
    _common(rate, max_len, max_new_slack)
    _positive(prompt_median=prompt_median, output_median=output_median)
    _non_negative(prompt_sigma=prompt_sigma, output_sigma=output_sigma)
    specs = []
    for t in _poisson_times(rng, n_requests, rate):
        p = _lognormal(rng, prompt_median, prompt_sigma, 1, max_len - 1)
        o = _lognormal(rng, output_median, output_sigma, 1, max_len - p)
        max_new, output = _output(rng, o, max_new_slack, max_len - p)
        specs.append(_Spec(float(t), _tokens(rng, p), o, max_new, output))
    return _finalize(specs)


def multi_turn(n_requests: int, seed: int, *, rate: float = 0.5, turns: float = 4.0, system_len: int = 0,
               user_median: float = 200.0, user_sigma: float = 1.0, output_median: float = 300.0,
               output_sigma: float = 0.8, think_steps: float = 100.0, prefill_per_step: int = 8192,
               max_len: int = 16384, max_new_slack: float = 1.0, closed_loop: bool = False) -> list[ScheduledRequest]:
    """Chat sessions: each turn's prompt is the previous turn's prompt + its output + a new user message.

    `closed_loop`: a turn arrives `think_steps` (on average) after the turn before it finishes on
    the pool being measured, not after an idle pool would have finished it (`_sessions`)."""
    rng = _rng(n_requests, seed)
    _common(rate, max_len, max_new_slack)
    _check(turns >= 1, f"turns must be >= 1, got {turns!r}")
    _positive(user_median=user_median, output_median=output_median, prefill_per_step=prefill_per_step)
    _non_negative(user_sigma=user_sigma, output_sigma=output_sigma, think_steps=think_steps,
                  system_len=system_len)
    _check(system_len < max_len - 1, f"system_len {system_len} leaves no room under max_len {max_len}")
    system = _tokens(rng, system_len)

    def opening() -> np.ndarray:
        user = _lognormal(rng, user_median, user_sigma, 1, max_len - 1 - system_len)
        return np.concatenate([system, _tokens(rng, user)])

    def continuation() -> np.ndarray:
        return _tokens(rng, _lognormal(rng, user_median, user_sigma, 1, max_len))

    def output_len(room: int) -> int:
        return _lognormal(rng, output_median, output_sigma, 1, room)

    return _finalize(_sessions(rng, n_requests, rate=rate, mean_turns=turns, opening=opening,
                               continuation=continuation, output_len=output_len, gap_mean=think_steps,
                               prefill_per_step=prefill_per_step, max_len=max_len, slack=max_new_slack,
                               closed_loop=closed_loop))


def long_doc_qa(n_requests: int, seed: int, *, rate: float = 0.5, n_docs: int = 4, doc_min: int = 8192,
                doc_max: int = 30720, question_median: float = 40.0, question_sigma: float = 0.6,
                output_median: float = 100.0, output_sigma: float = 0.8, max_len: int = 32768,
                max_new_slack: float = 1.0, prime_docs: bool = False,
                prefill_per_step: int = 8192) -> list[ScheduledRequest]:
    """A few long documents (8k-30k tokens), each asked many short questions (the document is the shared prefix).

    With `prime_docs`, the first requests (counted in n_requests) are the documents alone with a
    one-token output, at step 0, and questions start once those could have been prefilled at
    `prefill_per_step`: a sliding-window model can only reuse a prefix that ends a cached
    sequence, and the document's end is otherwise never one."""
    rng = _rng(n_requests, seed)
    _common(rate, max_len, max_new_slack)
    _check(n_docs >= 1, f"n_docs must be >= 1, got {n_docs!r}")
    _check(1 <= doc_min <= doc_max, f"need 1 <= doc_min <= doc_max, got {doc_min!r}, {doc_max!r}")
    _check(doc_max <= max_len - 2, f"doc_max {doc_max} leaves no room for a question under max_len {max_len}")
    _positive(question_median=question_median, output_median=output_median)
    _non_negative(question_sigma=question_sigma, output_sigma=output_sigma)
    _positive(prefill_per_step=prefill_per_step)
    docs = [_tokens(rng, int(rng.integers(doc_min, doc_max + 1))) for _ in range(n_docs)]
    specs = []
    offset = 0.0
    if prime_docs:
        for doc in docs[:n_requests]:
            specs.append(_Spec(0.0, doc, 1, 1, _tokens(rng, 1)))
        offset = float(sum(math.ceil(len(d) / prefill_per_step) for d in docs) + 1)
    for t in _poisson_times(rng, n_requests - len(specs), rate) + offset:
        doc = docs[int(rng.integers(n_docs))]
        q = _lognormal(rng, question_median, question_sigma, 1, max_len - 1 - len(doc))
        prompt = np.concatenate([doc, _tokens(rng, q)])
        o = _lognormal(rng, output_median, output_sigma, 1, max_len - len(prompt))
        max_new, output = _output(rng, o, max_new_slack, max_len - len(prompt))
        specs.append(_Spec(float(t), prompt, o, max_new, output))
    return _finalize(specs)


def agentic(n_requests: int, seed: int, *, rate: float = 0.5, prefix_len: int = 4096, n_prefixes: int = 1,
            task_median: float = 200.0, task_sigma: float = 0.8, iterations: float = 8.0,
            tool_median: float = 300.0, tool_sigma: float = 1.0, output_median: float = 40.0,
            output_sigma: float = 0.5, tool_steps: float = 10.0, prefill_per_step: int = 8192,
            max_len: int = 16384, max_new_slack: float = 1.0, closed_loop: bool = False) -> list[ScheduledRequest]:
    """Agent loops over a long shared prefix (system prompt + tools); each call appends the last tool output.

    `closed_loop`: a call arrives `tool_steps` (on average) after the call before it finishes on
    the pool being measured (`_sessions`)."""
    rng = _rng(n_requests, seed)
    _common(rate, max_len, max_new_slack)
    _check(iterations >= 1, f"iterations must be >= 1, got {iterations!r}")
    _check(n_prefixes >= 1, f"n_prefixes must be >= 1, got {n_prefixes!r}")
    _check(1 <= prefix_len <= max_len - 2, f"prefix_len must be in [1, max_len - 2], got {prefix_len!r}")
    _positive(task_median=task_median, tool_median=tool_median, output_median=output_median,
              prefill_per_step=prefill_per_step)
    _non_negative(task_sigma=task_sigma, tool_sigma=tool_sigma, output_sigma=output_sigma, tool_steps=tool_steps)
    prefixes = [_tokens(rng, prefix_len) for _ in range(n_prefixes)]

    def opening() -> np.ndarray:
        prefix = prefixes[int(rng.integers(n_prefixes))]
        task = _lognormal(rng, task_median, task_sigma, 1, max_len - 1 - prefix_len)
        return np.concatenate([prefix, _tokens(rng, task)])

    def continuation() -> np.ndarray:
        return _tokens(rng, _lognormal(rng, tool_median, tool_sigma, 1, max_len))

    def output_len(room: int) -> int:
        return _lognormal(rng, output_median, output_sigma, 1, room)

    return _finalize(_sessions(rng, n_requests, rate=rate, mean_turns=iterations, opening=opening,
                               continuation=continuation, output_len=output_len, gap_mean=tool_steps,
                               prefill_per_step=prefill_per_step, max_len=max_len, slack=max_new_slack,
                               closed_loop=closed_loop))


#: What `mixed` serves by default: long-context, reasoning-era traffic at saturation. Reasoning
#: models think before they answer (outputs of thousands of tokens); documents are many and asked
#: about a few times each; agent loops append long tool outputs to a few shared system prompts and
#: multi-turn chats carry long histories, so contexts run to tens of thousands of tokens. Requests
#: arrive faster than any pool serves them, so a comparison measures what each pool holds.
MIXED_DEFAULTS: dict[str, dict[str, Any]] = {
    "chat": {"prompt_median": 4000.0, "output_median": 2000.0},
    "multi_turn": {"system_len": 4000, "user_median": 2000.0, "output_median": 1500.0},
    "long_doc_qa": {"n_docs": 256, "output_median": 500.0},
    "agentic": {"prefix_len": 4096, "n_prefixes": 4, "tool_median": 3000.0, "output_median": 300.0,
                "max_len": 32768},
}
MIXED_FRACTIONS = {"chat": 0.2, "multi_turn": 0.2, "long_doc_qa": 0.3, "agentic": 0.3}
MIXED_RATE = 4.0


def mixed(n_requests: int, seed: int, *, rate: float = MIXED_RATE, chat: float = MIXED_FRACTIONS["chat"],
          multi_turn: float = MIXED_FRACTIONS["multi_turn"], long_doc_qa: float = MIXED_FRACTIONS["long_doc_qa"],
          agentic: float = MIXED_FRACTIONS["agentic"],
          params: dict[str, dict[str, Any]] | None = None) -> list[ScheduledRequest]:
    """A saturating mix of chat, multi_turn, long_doc_qa and agentic (fractions as parameters),
    interleaved by arrival; each part's defaults are overridden by MIXED_DEFAULTS, then `params`."""
    rng = _rng(n_requests, seed)
    _positive(rate=rate)
    fractions = {"chat": chat, "multi_turn": multi_turn, "long_doc_qa": long_doc_qa, "agentic": agentic}
    _non_negative(**fractions)
    total = sum(fractions.values())
    _check(total > 0, "the mixed fractions must not all be zero")
    given = dict(params or {})
    params = {name: {**MIXED_DEFAULTS.get(name, {}), **given.get(name, {})} for name in set(MIXED_DEFAULTS) | set(given)}
    unknown = sorted(set(given) - set(fractions))
    _check(not unknown, f"mixed params name unknown workloads: {', '.join(unknown)}")
    counts = _apportion(n_requests, [f / total for f in fractions.values()])
    seeds = rng.integers(0, 2**63 - 1, size=len(fractions))
    merged: list[tuple[int, int, int, ScheduledRequest]] = []
    for k, ((name, frac), count, sub_seed) in enumerate(zip(fractions.items(), counts, seeds)):
        if count == 0:
            continue
        sub_params = params.get(name) or {}
        _check(isinstance(sub_params, dict), f"mixed params[{name!r}] must be a dict, got {sub_params!r}")
        _check("rate" not in sub_params, f"mixed sets the rate of {name} from its fraction; drop params[{name!r}]['rate']")
        sub_params = _validated(name, sub_params)
        for r in _GENERATORS[name](count, int(sub_seed), rate=rate * frac / total, **sub_params):
            merged.append((r.arrival, k, r.rid, r))
    merged.sort(key=lambda e: e[:3])
    new_rid = {(k, old): rid for rid, (_, k, old, _) in enumerate(merged)}
    out = []
    for rid, (_, k, _, r) in enumerate(merged):
        r.rid = rid
        if r.follows >= 0:
            r.follows = new_rid[(k, r.follows)]
        out.append(r)
    return out


#: the workloads made of sessions, whose turns `closed_loop` chains to each other's finish
SESSION_WORKLOADS = ("multi_turn", "agentic")


def closed_loop_params(name: str) -> dict[str, Any]:
    """The parameters that make workload `name`'s sessions closed loop (`_sessions`): its own
    `closed_loop`, or for `mixed` each session part's. InputError for a workload without sessions."""
    _lookup(name)
    if name in SESSION_WORKLOADS:
        return {"closed_loop": True}
    if name == "mixed":
        return {"params": {part: {"closed_loop": True} for part in SESSION_WORKLOADS}}
    raise InputError(f"--closed-loop needs a workload of sessions ({', '.join(SESSION_WORKLOADS)} or mixed), "
                     f"not {name!r}")


def _apportion(n: int, shares: list[float]) -> list[int]:
    """Split n by shares (largest remainder), so counts always add up to n."""
    exact = [n * s for s in shares]
    counts = [math.floor(e) for e in exact]
    rest = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in rest[: n - sum(counts)]:
        counts[i] += 1
    return counts


_GENERATORS: dict[str, Workload] = {
    "chat": chat,
    "multi_turn": multi_turn,
    "long_doc_qa": long_doc_qa,
    "agentic": agentic,
}

WORKLOADS: dict[str, Workload] = {**_GENERATORS, "mixed": mixed}


def describe_workloads() -> dict[str, str]:
    """Name -> one-line description (the generator's first docstring line), for a CLI listing."""
    return {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in WORKLOADS.items()}


def workload_params(name: str) -> dict[str, Any]:
    """A workload's parameters and their defaults, for a CLI's help."""
    fn = _lookup(name)
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _lookup(name: str) -> Workload:
    if not isinstance(name, str) or name not in WORKLOADS:
        raise InputError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def workload_from_name(name: str, n_requests: int, seed: int, **params: Any) -> list[ScheduledRequest]:
    """Build a named workload. Unknown names or parameters raise InputError; string values (from a
    command line) are converted to the type of the parameter's default."""
    return _lookup(name)(n_requests, seed, **_validated(name, params))


def _validated(name: str, params: dict[str, Any]) -> dict[str, Any]:
    defaults = workload_params(name)
    converted = {}
    for key, value in params.items():
        if key not in defaults:
            raise InputError(f"workload {name!r} has no parameter {key!r}; it takes: {', '.join(defaults)}")
        converted[key] = _coerce(name, key, value, defaults[key])
    return converted


def _coerce(name: str, key: str, value: Any, default: Any) -> Any:
    """`value` as the type of the parameter's default: a string (a command line's) converted, any
    other value checked, so a bool, a list or a NaN never reaches the generator's arithmetic."""
    if isinstance(default, str) or default is None:
        return value
    want = "a bool" if isinstance(default, bool) else "an integer" if isinstance(default, int) else "a number"
    if isinstance(value, str):
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            value = int(value) if isinstance(default, int) else float(value)
        except ValueError:
            raise InputError(f"workload {name!r} parameter {key!r} wants {want}, got {value!r}") from None
    if isinstance(default, bool):
        ok = isinstance(value, (bool, np.bool_))
    elif isinstance(default, int):
        ok = is_integer(value)
    else:
        ok = is_finite_number(value)
    if not ok:
        raise InputError(f"workload {name!r} parameter {key!r} wants {want}"
                         f"{'' if isinstance(default, (bool, int)) else ' (finite)'}, got {value!r}")
    return value


# -- traces ---------------------------------------------------------------------------------------


@dataclass
class _Line:
    lineno: int
    step: int
    time_ms: float
    input_length: int
    output_length: int
    max_new: int | None
    rid: int | None
    hash_ids: list[Any]
    priority: int = 0


def _number(obj: dict, key: str, where: str, *, integer: bool, required: bool = True) -> Any:
    if key not in obj:
        if required:
            raise InputError(f"{where}: missing field {key!r}")
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise InputError(f"{where}: field {key!r} must be a number, got {v!r}")
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise InputError(f"{where}: field {key!r} must be an integer, got {v!r}")
        v = int(v)
    if v < 0:
        raise InputError(f"{where}: field {key!r} must be >= 0, got {v!r}")
    return v


def _parse_line(obj: Any, where: str, lineno: int, block_tokens: int) -> _Line:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    input_length = _number(obj, "input_length", where, integer=True)
    if input_length < 1:
        raise InputError(f"{where}: field 'input_length' must be >= 1, got {input_length}")
    output_length = max(_number(obj, "output_length", where, integer=True), 1)  # a step always samples one
    step = _number(obj, "arrival_step", where, integer=True, required=False)
    time_ms = _number(obj, "timestamp", where, integer=False, required=step is None)
    max_new = _number(obj, "max_new", where, integer=True, required=False)
    if max_new is not None and max_new < output_length:
        raise InputError(f"{where}: max_new {max_new} is below output_length {output_length}")
    rid = _number(obj, "rid", where, integer=True, required=False)
    hash_ids = obj.get("hash_ids")
    if hash_ids is None:
        hash_ids = []
    if not isinstance(hash_ids, list) or not all(
            isinstance(h, (int, str)) and not isinstance(h, bool) for h in hash_ids):
        raise InputError(f"{where}: field 'hash_ids' must be a list of integers or strings")
    blocks = -(-input_length // block_tokens)
    if len(hash_ids) > blocks:
        raise InputError(f"{where}: {len(hash_ids)} hash_ids but input_length {input_length} spans only "
                         f"{blocks} blocks of {block_tokens} tokens (wrong block_tokens? `kvchain simulate "
                         "--block-tokens` sets the trace's block size)")
    priority = _number(obj, "priority", where, integer=True, required=False) or 0
    tokens = input_length + (output_length if max_new is None else max_new)
    if tokens > MAX_REQUEST_TOKENS:
        raise InputError(f"{where}: {tokens:,} tokens (input_length plus output) is above the most a request "
                         f"may hold, {MAX_REQUEST_TOKENS:,}")
    return _Line(lineno, -1 if step is None else step, -1.0 if time_ms is None else float(time_ms),
                 input_length, output_length, max_new, rid, hash_ids, priority)


def load_trace(path: str | Path, *, ms_per_step: float = 50.0, block_tokens: int = 512,
               max_new_slack: float = 1.0, limit: int | None = None, seed: int = 0) -> list[ScheduledRequest]:
    """Replay a JSONL trace (Mooncake fields plus ours) as requests. Blocks with the same hash id
    become identical token blocks, so the trace's prefix sharing reaches the prefix tree; blocks
    without one are fresh tokens. Arrival step = (timestamp - first timestamp) / ms_per_step,
    floored, unless `arrival_step` is given; requests in the same step keep timestamp, then file,
    order. Lines without `rid` get ids in that order. Token contents depend on `seed`."""
    _finite(0, ms_per_step=ms_per_step)
    _finite(1.0, max_new_slack=max_new_slack)
    _integer(1, block_tokens=block_tokens)
    _integer(0, seed=seed, **({} if limit is None else {"limit": limit}))
    path = _trace_path(path)
    lines: list[_Line] = []
    held = 0
    with jsonio.reading(path, f"trace {path}") as f:
        for lineno, text in enumerate(f, 1):
            if limit is not None and len(lines) >= limit:
                break
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            obj = jsonio.loads(text, where)
            line = _parse_line(obj, where, lineno, block_tokens)
            held += line.input_length + (line.max_new or line.output_length)
            if held > MAX_TRACE_TOKENS:
                raise InputError(f"{where}: the trace holds more than {MAX_TRACE_TOKENS:,} tokens so far; "
                                 "replay fewer requests (--requests)")
            lines.append(line)

    times = [ln.time_ms for ln in lines if ln.step < 0]
    t0 = min(times) if times else 0.0
    for ln in lines:
        if ln.step < 0:
            ln.step = math.floor((ln.time_ms - t0) / ms_per_step + 1e-9)
            ln.time_ms -= t0
        else:
            ln.time_ms = ln.step * ms_per_step
    lines.sort(key=lambda ln: (ln.step, ln.time_ms, ln.lineno))

    seen: dict[int, int] = {}
    for ln in lines:
        if ln.rid is not None:
            if ln.rid in seen:
                raise InputError(f"{path}:{ln.lineno}: rid {ln.rid} already used on line {seen[ln.rid]}")
            seen[ln.rid] = ln.lineno
    free = (i for i in range(len(lines) + len(seen) + 1) if i not in seen)

    rng = np.random.default_rng(seed)
    blocks: dict[Any, np.ndarray] = {}
    out = []
    for ln in lines:
        parts = []
        for b, lo in enumerate(range(0, ln.input_length, block_tokens)):
            size = min(block_tokens, ln.input_length - lo)
            if b < len(ln.hash_ids):
                key = ln.hash_ids[b]
                block = blocks.get(key)
                if block is None:
                    block = blocks[key] = _tokens(rng, block_tokens)
                parts.append(block[:size])
            else:
                parts.append(_tokens(rng, size))
        prompt = np.concatenate(parts)
        max_new = ln.max_new if ln.max_new is not None else max(ln.output_length,
                                                               math.ceil(ln.output_length * max_new_slack))
        if ln.input_length + max_new > MAX_REQUEST_TOKENS:
            raise InputError(f"{path}:{ln.lineno}: {ln.input_length + max_new:,} tokens (input_length plus "
                             f"output_length x max_new_slack {max_new_slack}) is above the most a request may "
                             f"hold, {MAX_REQUEST_TOKENS:,}")
        rid = ln.rid if ln.rid is not None else next(free)
        out.append(ScheduledRequest(rid, ln.step, prompt, max_new, ln.output_length, output=_tokens(rng, max_new),
                              priority=ln.priority))
    return out


def prompt_hash_ids(prompt: np.ndarray, block_tokens: int, ids: dict[bytes, int]) -> list[int]:
    """Mooncake-style block hash ids of a prompt: each block's id names its content and everything
    before it (a chained hash), so equal ids mean equal prefixes. `ids` maps digests to small
    integers and is shared across the requests of one trace."""
    out = []
    prev = b""
    data = np.ascontiguousarray(prompt, dtype=np.int32)
    for lo in range(0, len(data), block_tokens):
        digest = hashlib.blake2b(prev + data[lo:lo + block_tokens].tobytes(), digest_size=16).digest()
        out.append(ids.setdefault(digest, len(ids)))
        prev = digest
    return out


def save_trace(requests: list[ScheduledRequest], path: str | Path, ms_per_step: float = 50.0, *,
               block_tokens: int = 512) -> None:
    """Write requests as a JSONL trace that `load_trace` reads back to equivalent requests: same
    arrivals, lengths, max_new, ids, and the same prefix sharing at block granularity (hash ids
    are chained block hashes of each prompt). Output tokens are not recorded."""
    _finite(0, ms_per_step=ms_per_step)
    _integer(1, block_tokens=block_tokens)
    path = _trace_path(path)
    ids: dict[bytes, int] = {}
    rows = []
    for req in sorted(requests, key=lambda r: (r.arrival, r.rid)):
        ts = req.arrival * ms_per_step
        rows.append(json.dumps({
            "timestamp": int(ts) if float(ts).is_integer() else round(ts, 6),
            "input_length": len(req.prompt),
            "output_length": int(req.output_len),
            "hash_ids": prompt_hash_ids(req.prompt, block_tokens, ids),
            "arrival_step": int(req.arrival),
            "rid": int(req.rid),
            "max_new": int(req.max_new),
            **({"priority": int(req.priority)} if req.priority else {}),
        }))
    try:
        path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    except OSError as e:
        raise InputError(f"{path}: cannot write trace: {e.strerror or e}") from None
