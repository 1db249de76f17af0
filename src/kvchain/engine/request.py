"""A request as the model-free scheduler sees it: token ids, how long its output will be, and
where it is in its life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from ..units import is_integer

#: the longest request (prompt plus output) kvchain serves or simulates, above any model's context:
#: a request's tokens are held in memory
MAX_REQUEST_TOKENS = 2**24
#: token ids are int32 in a request (a vocabulary never reaches 2**31)
_TOKEN_END = 2**31


class Phase(enum.Enum):
    PENDING = "pending"  # not arrived yet
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"  # admitted nowhere: unschedulable
    REJECTED = "rejected"  # larger than an empty pool


@dataclass(eq=False)
class ScheduledRequest:
    rid: int
    arrival: int  # step
    prompt: np.ndarray  # token ids
    max_new: int  # what the client asked for (the memory clip may lower it)
    output_len: int  # how many tokens it will really generate (<= max_new)
    output: np.ndarray | None = None  # the token ids it generates (synthesised when None)
    priority: int = 0  # lower is more important (priority scheduling); ties by arrival
    #: a closed-loop session's next turn: the rid of the turn whose finish releases it (-1: none),
    #: and the steps after that finish it arrives (the user reading and typing); `arrival` is then
    #: set when it is released
    follows: int = -1
    gap: int = 0
    phase: Phase = Phase.PENDING
    reason: str = ""
    # runtime, owned by the scheduler and the pool
    computed: int = 0  # tokens whose KV exists
    generated: int = 0
    row: int = -1
    cached: int = 0  # prompt tokens the prefix cache supplied
    admitted_step: int = -1
    finished_step: int = -1
    first_token_step: int = -1  # the step that sampled its first output token
    preemptions: int = 0
    lost_tokens: int = 0  # KV computed before its latest retraction, to compute again
    chunk_cap: int | None = None  # the prefill chunk its admission fitted it at (`Admission.chunk_cap`)
    pool_state: dict = field(default_factory=dict)
    #: how the engine samples its outputs (`engine.sampling.SamplingParams`; None: greedy)
    sampling: object = None
    #: token ids that end it besides the pool's end-of-sequence ids (which `ignore_eos` drops, not these)
    stop: frozenset = frozenset()
    #: how many alternatives to report with each output token's log-probability (None: none reported)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_fields()
        self.prompt = np.asarray(self.prompt, dtype=np.int32)
        self.prompt_len = len(self.prompt)
        if self.output is None:
            rng = np.random.default_rng(self.rid * 7919 + 17)
            self.output = rng.integers(1, 2**30, size=max(self.max_new, 1), dtype=np.int64).astype(np.int32)

    def _check_fields(self) -> None:
        """Refuse, where the request is made, what the scheduler's arithmetic would misread: counts
        that are not integers >= 0 (an arrival of 1.5, a max_new of None), an output_len past
        max_new, and token ids that are not integers in int32's range (1.5 was truncated, 2**40 an
        OverflowError). An empty prompt is the admission's to refuse (it says why)."""
        for name in ("rid", "arrival", "max_new", "output_len", "gap"):
            value = getattr(self, name)
            if not is_integer(value) or value < 0:
                raise InputError(f"request {self.rid!r}: {name} must be an integer >= 0, not {value!r}")
        if not is_integer(self.priority) or not is_integer(self.follows) or self.follows < -1:
            raise InputError(f"request {self.rid}: priority and follows must be integers (follows >= -1), "
                             f"not {self.priority!r} and {self.follows!r}")
        if self.output_len > self.max_new:
            raise InputError(f"request {self.rid}: output_len {self.output_len} is past max_new {self.max_new}")
        self.prompt = _token_ids(self.rid, "prompt", self.prompt)
        if len(self.prompt) + self.max_new > MAX_REQUEST_TOKENS:
            raise InputError(f"request {self.rid}: {len(self.prompt) + self.max_new:,} tokens (prompt plus "
                             f"max_new) is above the most a request may hold, {MAX_REQUEST_TOKENS:,}")
        if self.output is not None:
            self.output = _token_ids(self.rid, "output", self.output, writable=True)
            if len(self.output) < self.output_len:
                raise InputError(f"request {self.rid}: {len(self.output)} output tokens for an output_len "
                                 f"of {self.output_len}")

    @property
    def input_len(self) -> int:
        """What a (re)admission must compute: the prompt, plus outputs already generated when a
        preempted request comes back to recompute."""
        g = self.generated
        return self.prompt_len + (g - 1 if g > 1 else 0)

    def tokens(self, n: int) -> np.ndarray:
        """The first `n` tokens of prompt + output."""
        if n <= len(self.prompt):
            return self.prompt[:n]
        return np.concatenate([self.prompt, self.output[: n - len(self.prompt)]])

    @property
    def prefilling(self) -> bool:
        return self.computed < self.input_len

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


def _token_ids(rid: int, what: str, ids: object, writable: bool = False) -> np.ndarray:
    """`ids` as a 1-D integer array (an empty one of any dtype counts), each id in 0..2**31 - 1."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputError(f"request {rid}: {what} must be a 1-D sequence of integer token ids, not {ids!r:.60}")
    if not arr.size:
        return arr.astype(np.int64 if writable else np.int32)
    if int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_END:
        raise InputError(f"request {rid}: {what} token ids must lie in 0..{_TOKEN_END - 1}, got "
                         f"{int(arr.min())}..{int(arr.max())}")
    return arr
