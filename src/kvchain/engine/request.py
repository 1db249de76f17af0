"""A request as the model-free scheduler sees it: token ids, how long its output will be, and
where it is in its life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


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
        self.prompt = np.asarray(self.prompt, dtype=np.int32)
        self.prompt_len = len(self.prompt)
        if self.output is None:
            rng = np.random.default_rng(self.rid * 7919 + 17)
            self.output = rng.integers(1, 2**30, size=max(self.max_new, 1), dtype=np.int64).astype(np.int32)

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
