"""Scheduling policies: what admission charges for a request's output, and which running requests
give way when a step cannot grow.

The scheduler loop and the pools are shared; a policy object answers the questions whose answers
differ between engines, so `kvchain simulate` compares engines (layout and policy), not layouts
alone:

* how many output tokens admission charges a new request, and what it keeps reserved for the
  output running requests have still to generate (`admit_output`, `reserve_output`);
* whether admission charges the whole prompt or only the chunk it schedules (`chunk_only`) and
  what it holds back (`watermark`);
* in which order running requests are retracted when a step cannot grow (`victim_order`), and
  whether running prefills pause before anything is retracted (`pauses_prefills`);
* how its estimate moves: every step (`on_step`), on a retraction (`on_retract`), on a finish.

Every policy here is documented with the engine behaviour it models. Retracted requests recompute
(their tokens are counted again as prefill tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InputError
from .request import ScheduledRequest

#: sglang's defaults: the output share charged starts at 0.7 and decays to 0.1 over 600 steps
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
#: sglang charges a new request at most this many output tokens at admission
CLIP_MAX_NEW_TOKENS = 4096
#: after a retraction sglang re-estimates as if each running request decodes this many more tokens
RETRACT_DECODE_STEPS = 20
#: vLLM's block-manager watermark: the share of blocks admission keeps free
VLLM_WATERMARK = 0.01


def _by_priority_then_newest(running: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
    """Victims in the order engines with priority scheduling preempt: the least important first
    (the largest priority value), newest admitted first among equals."""
    return sorted(running, key=lambda r: (-r.priority, -r.admitted_step, -r.rid))


@dataclass
class SchedulePolicy:
    """Base policy: full reservation (every request's whole remaining output), newest retracted
    first. Subclasses override what differs."""

    name: str = "exact"
    #: admission charges only the chunk it schedules (vLLM), not the whole prompt
    chunk_only: bool = False
    #: share of the pool admission keeps free
    watermark: float = 0.0
    #: pause running prefills before retracting anything when a step cannot grow
    pauses_prefills: bool = True
    #: a step that retracted admits nothing new (both engines)
    admit_after_retract: bool = False
    #: charge full attention at the projected peak of what requests hold (`ProjectedPrefillBudget`)
    #: instead of the sum of their reserved outputs
    projected: bool = False
    #: the waiting head keeps its cached match locked while it waits (given up when a running
    #: request needs the room), so the prefix it will reuse is not evicted under it
    pins_waiting: bool = True

    def admit_output(self, req: ScheduledRequest) -> int:
        """Output tokens admission charges a waiting request."""
        return max(req.max_new - req.generated, 0)

    def reserve_output(self, req: ScheduledRequest) -> int:
        """Output tokens still reserved for a running request."""
        return max(req.max_new - req.generated, 0)

    def victim_order(self, running: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        return _by_priority_then_newest(running)

    def on_step(self) -> None:
        """Called once per scheduler step."""

    def on_retract(self, victims: Sequence[ScheduledRequest], running: Sequence[ScheduledRequest]) -> None:
        """Called after `victims` were retracted; `running` is what still runs."""

    def on_finish(self, req: ScheduledRequest) -> None:
        """Called when a request finishes."""

    def describe(self) -> str:
        return self.name


@dataclass
class ExactPolicy(SchedulePolicy):
    """kvchain `exact`: admission reserves every request's whole remaining output (`max_new`), so a
    step always grows and nothing is ever retracted."""

    name: str = "exact"


@dataclass
class IdealPolicy(SchedulePolicy):
    """The `ideal` bound's policy: perfect knowledge of each request's real output length. Admission
    charges the projected peak of what the running requests and the new one hold as they grow and
    finish (`ProjectedPrefillBudget`), so nothing is reserved for tokens never generated nor for
    pages that a finished request will have given back, and nothing is ever retracted."""

    name: str = "ideal"
    projected: bool = True

    def admit_output(self, req: ScheduledRequest) -> int:
        return max(req.output_len - req.generated, 0)

    def reserve_output(self, req: ScheduledRequest) -> int:
        return max(req.output_len - req.generated, 0)


@dataclass
class DecayingRatioPolicy(SchedulePolicy):
    """A decaying output share (sglang's `new_token_ratio`): running requests keep `ratio` x their
    remaining output reserved; the ratio starts at `init` and decays linearly to `floor` over
    `decay_steps` steps, and a retraction re-estimates it from what running requests decoded so
    far (at least `init`, at most 1). New requests are charged `new_output` x their output
    (sglang: all of it, clipped to 4,096 tokens; kvchain `optimistic`: the same ratio)."""

    name: str = "optimistic-ratio"
    init: float = INIT_NEW_TOKEN_RATIO
    floor: float = MIN_NEW_TOKEN_RATIO
    decay_steps: int = NEW_TOKEN_RATIO_DECAY_STEPS
    #: charge new requests their whole output (clipped), as sglang does, instead of the ratio
    full_new_output: bool = False
    clip: int = CLIP_MAX_NEW_TOKENS
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.init <= 1:
            raise InputError(f"new-token ratio: need 0 <= floor ({self.floor}) <= init ({self.init}) <= 1")
        self.ratio = self.init

    def admit_output(self, req: ScheduledRequest) -> int:
        left = max(req.max_new - req.generated, 0)
        if self.full_new_output:
            return min(left, self.clip)
        return math.ceil(left * self.ratio)

    def reserve_output(self, req: ScheduledRequest) -> int:
        return math.ceil(max(req.max_new - req.generated, 0) * self.ratio)

    def on_step(self) -> None:
        self.ratio = max(self.floor, self.ratio - (self.init - self.floor) / max(self.decay_steps, 1))

    def on_retract(self, victims: Sequence[ScheduledRequest], running: Sequence[ScheduledRequest]) -> None:
        decoded = sum(r.generated for r in running)
        asked = sum(r.max_new for r in running)
        estimate = (decoded + RETRACT_DECODE_STEPS * len(running)) / asked if asked else 1.0
        self.ratio = min(1.0, max(self.init, estimate))


@dataclass
class SglangPolicy(DecayingRatioPolicy):
    """sglang's scheduler: new requests are charged their prompt and their output clipped to 4,096
    tokens, running ones `new_token_ratio` x their remaining output (0.7 decaying to 0.1); when a
    step cannot grow, running prefills pause first, then running requests are retracted, the one
    with the fewest output tokens first (the longest prompt first among those), and the ratio is
    re-estimated. sglang retracts decodes only; here a running prefill that has sampled nothing
    has the fewest output tokens and goes first, which gives back what sglang's chunked request
    would keep (the loop has no separate chunked request to hold it)."""

    name: str = "sglang"
    full_new_output: bool = True
    pins_waiting: bool = False

    def victim_order(self, running: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        return sorted(running, key=lambda r: (-r.priority, r.generated, -r.prompt_len, -r.rid))


@dataclass
class OnlineEstimatePolicy(SchedulePolicy):
    """An online estimate of the output from finished requests: each request is charged its
    remaining output up to `quantile` of the share of `max_new` finished requests generated
    (`prior` until `warmup` requests finished); retraction raises the estimate to 1 until the next
    finish."""

    name: str = "optimistic-online"
    quantile: float = 0.9
    prior: float = INIT_NEW_TOKEN_RATIO
    warmup: int = 16
    shares: list[float] = field(default_factory=list)
    share: float = field(init=False)

    def __post_init__(self) -> None:
        self.share = self.prior

    def _charge(self, req: ScheduledRequest) -> int:
        left = max(req.max_new - req.generated, 0)
        expected = math.ceil(req.max_new * self.share) - req.generated
        return min(left, max(expected, 1 if left else 0))

    def admit_output(self, req: ScheduledRequest) -> int:
        return self._charge(req)

    def reserve_output(self, req: ScheduledRequest) -> int:
        return self._charge(req)

    def on_finish(self, req: ScheduledRequest) -> None:
        self.shares.append(req.output_len / max(req.max_new, 1))
        if len(self.shares) >= self.warmup:
            s = sorted(self.shares[-512:])
            self.share = s[min(len(s) - 1, int(self.quantile * len(s)))]

    def on_retract(self, victims: Sequence[ScheduledRequest], running: Sequence[ScheduledRequest]) -> None:
        self.share = 1.0


@dataclass
class VllmPolicy(SchedulePolicy):
    """vLLM's scheduler: admit a waiting request while the blocks of the chunk it schedules fit
    with the watermark (1% of blocks) kept free; nothing is reserved for output, blocks are
    allocated on demand; when a running request cannot grow, the newest running request (the
    least important under priority scheduling) is preempted and recomputes later, down to the
    request being grown itself; a step that preempted admits nothing new."""

    name: str = "vllm"
    chunk_only: bool = True
    watermark: float = VLLM_WATERMARK
    pauses_prefills: bool = False
    pins_waiting: bool = False

    def admit_output(self, req: ScheduledRequest) -> int:
        return 0

    def reserve_output(self, req: ScheduledRequest) -> int:
        return 0


#: kvchain admission modes (`--admission`)
ADMISSION_MODES = ("optimistic", "exact", "optimistic-ratio", "optimistic-online")


def admission_policy(mode: str) -> SchedulePolicy:
    """kvchain's policy for an admission mode: `exact` (full reservation, never retracts) or
    `optimistic` (the default). Optimistic admission charges a new request the chunk it schedules
    and takes every request (running ones with the rest of their prompt) to grow by a decaying
    share of its output (0.7 to 0.1); full attention is charged at the projected peak of what they
    hold as they grow and finish one after another (`ProjectedPrefillBudget`), not at the sum of
    their reservations, which overstates the peak because requests do not all end at once. When a
    step cannot grow, running prefills pause first, then the fewest requests that make room are
    retracted (newest, or least important, first). The decaying share measured better than the
    online estimate from finished requests (`optimistic-online`, same admission otherwise), so it
    is the default (docs/simulate.md)."""
    if mode == "exact":
        return ExactPolicy()
    if mode in ("optimistic", "optimistic-ratio"):
        return DecayingRatioPolicy(name="optimistic", chunk_only=True, projected=True)
    if mode == "optimistic-online":
        return OnlineEstimatePolicy(name="optimistic-online", chunk_only=True, projected=True)
    raise InputError(f"unknown admission mode {mode!r} (known: {', '.join(ADMISSION_MODES)})")
