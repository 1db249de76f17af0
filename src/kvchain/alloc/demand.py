"""`KVDemand` and `request_demand`: what one request needs from each sub-pool.

Every place that prices a request (admission, the memory clip, a host-tier load-back, a PD decode
preallocation) calls `request_demand` with its purpose; the purpose's row of `DEMAND_RULES` says
which tokens count for full attention, how much of each window is charged, and how many state slots.
One demand model, so the clip and admission can never disagree (ADM-14, ADM-16)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..plan import KVStoragePlan, PoolKind, checked_plan
from ..sizing import pages_for, state_slots_per_request


class DemandPurpose(enum.Enum):
    CEILING = "ceiling"  # the most a request can ever hold: the memory clip, oversize checks
    ADMIT = "admit"  # a prefill admission of one chunk
    LOAD_BACK = "load_back"  # a host-tier load of a cached prefix
    DECODE_PREALLOC = "decode_prealloc"  # a PD decode node receiving a prefilled request


class WindowRetirement(enum.Enum):
    """When the scheduler retires a window's rows."""

    EAGER = "eager"  # every advance frees the rows that left the window
    NEVER = "never"  # rows stay until the request ends: the window holds every row


class FullCharge(enum.Enum):
    LIFETIME = "input + output - cached"  # every token the request will hold, beyond its cached prefix
    CACHED = "cached prefix"  # only the prefix being loaded


class WindowCharge(enum.Enum):
    PEAK = "lifetime peak"  # the most rows the window holds at once over the request's life
    PASS = "retained + this pass's tail"  # the retained window plus the tokens this pass writes
    RETAINED = "retained at the prefix end"  # the window behind a loaded prefix


class StateCharge(enum.Enum):
    FULL = "running + tracking slots"
    CHECKPOINT = "one checkpoint slot"


@dataclass(frozen=True)
class DemandRule:
    full: FullCharge
    window: WindowCharge
    state: StateCharge


#: Rules as data: one row per purpose, read by `request_demand` alone.
DEMAND_RULES: dict[DemandPurpose, DemandRule] = {
    DemandPurpose.CEILING: DemandRule(FullCharge.LIFETIME, WindowCharge.PEAK, StateCharge.FULL),
    DemandPurpose.ADMIT: DemandRule(FullCharge.LIFETIME, WindowCharge.PASS, StateCharge.FULL),
    DemandPurpose.LOAD_BACK: DemandRule(FullCharge.CACHED, WindowCharge.RETAINED, StateCharge.CHECKPOINT),
    DemandPurpose.DECODE_PREALLOC: DemandRule(FullCharge.LIFETIME, WindowCharge.PEAK, StateCharge.FULL),
}


@dataclass(frozen=True)
class KVDemand:
    """Pages per band in chain order (state band: slots), and the owner virtual ids to mint."""

    pages: tuple[int, ...]
    virtual_pages: int
    state_slots: int

    def __add__(self, other: KVDemand) -> KVDemand:
        return KVDemand(
            tuple(a + b for a, b in zip(self.pages, other.pages)),
            self.virtual_pages + other.virtual_pages,
            self.state_slots + other.state_slots,
        )

    @staticmethod
    def zero(n_bands: int) -> KVDemand:
        return KVDemand((0,) * n_bands, 0, 0)


def span_pages(tokens: int, page_size: int) -> int:
    """Most pages `tokens` consecutive tokens can span, misaligned against pages."""
    if tokens <= 0:
        return 0
    return (tokens - 1 + page_size - 1) // page_size + 1


def retained_window(window: int, checkpoint_interval: int | None, shares_prefixes: bool) -> int:
    """Rows a window keeps behind the tail: the window, plus up to one checkpoint interval when the
    prefix cache shares prefixes and keeps the window behind the latest checkpoint (WIN-11)."""
    if shares_prefixes and checkpoint_interval:
        return window + checkpoint_interval
    return window


def _check_arguments(purpose, window_retirement, **values) -> None:
    """The slow path of `request_demand`'s checks, run only when some argument is not a plain int
    (or None where that is allowed) or an enum is not its enum: names the argument at fault."""
    if not isinstance(purpose, DemandPurpose):
        raise InputError(f"request_demand purpose must be a DemandPurpose, got {purpose!r}")
    if not isinstance(window_retirement, WindowRetirement):
        raise InputError(f"request_demand window_retirement must be a WindowRetirement, got {window_retirement!r}")
    for name, value in values.items():
        if value is None and name in ("chunk_len", "checkpoint_interval"):
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise InputError(f"request_demand {name} must be an integer, got {value!r}")


def request_demand(
    plan: KVStoragePlan,
    purpose: DemandPurpose,
    *,
    input_len: int,
    output_len: int = 0,
    cached_len: int = 0,
    chunk_len: int | None = None,
    window_retirement: WindowRetirement = WindowRetirement.EAGER,
    checkpoint_interval: int | None = None,
    shares_prefixes: bool = False,
    min_chunk: int = 1,
    tracking_slot: bool | None = None,
) -> KVDemand:
    """Price one request for `purpose` (see DEMAND_RULES).

    `cached_len` tokens of its prefix are already held (the prefix tree); `chunk_len` is the tokens
    this pass writes (default: the rest of the input). `min_chunk` is the smallest prefill chunk the
    scheduler cuts (the checkpoint interval when it cuts on the grid): a lifetime peak includes that
    chunk's transient window tail, so a request that fits an empty pool can always be prefilled.
    `tracking_slot`: whether the pool takes a tracking state slot per request for its prefix tree's
    checkpoints (None: as the plan's state lifetime declares, `state_slots_per_request`).

    InputError for a length that is not an integer (a bool is not one) or is negative, a negative
    `checkpoint_interval` (None or 0: no grid), and a `purpose` or `window_retirement` that is not
    its enum."""
    if type(plan) is not KVStoragePlan:
        checked_plan(plan)
    if (type(input_len) is not int or type(output_len) is not int or type(cached_len) is not int
            or type(min_chunk) is not int or (chunk_len is not None and type(chunk_len) is not int)
            or (checkpoint_interval is not None and type(checkpoint_interval) is not int)
            or type(purpose) is not DemandPurpose or type(window_retirement) is not WindowRetirement):
        _check_arguments(purpose, window_retirement, input_len=input_len, output_len=output_len,
                         cached_len=cached_len, chunk_len=chunk_len, checkpoint_interval=checkpoint_interval,
                         min_chunk=min_chunk)
    if input_len < 0 or output_len < 0 or cached_len < 0 or cached_len > input_len:
        raise InputError(
            f"request lengths must satisfy 0 <= cached ({cached_len}) <= input ({input_len}), output {output_len} >= 0"
        )
    if (chunk_len is not None and chunk_len < 0) or min_chunk < 0 or \
            (checkpoint_interval is not None and checkpoint_interval < 0):
        name, value = next((n, v) for n, v in (("chunk_len", chunk_len), ("min_chunk", min_chunk),
                                                ("checkpoint_interval", checkpoint_interval)) if v is not None and v < 0)
        raise InputError(f"request_demand {name} must not be negative, got {value}"
                         + (" (None or 0: no checkpoint grid)" if name == "checkpoint_interval" else ""))
    rule = DEMAND_RULES[purpose]
    ps = plan.page_size
    total = input_len + output_len
    cached_pages = pages_for(cached_len, ps)
    if rule.full is FullCharge.LIFETIME:
        full = pages_for(total, ps) - cached_pages
    else:
        full = cached_pages
    if chunk_len is None:
        chunk_len = input_len - cached_len
    pages: list[int] = []
    slots = 0
    for pool in plan.sub_pools:
        if pool.kind is PoolKind.FULL:
            pages.append(full)
        elif pool.kind is PoolKind.WINDOW:
            retained = retained_window(pool.window, checkpoint_interval, shares_prefixes)
            if window_retirement is WindowRetirement.NEVER:
                bound = full
            elif rule.window is WindowCharge.PEAK:
                bound = span_pages(retained + max(min_chunk, 1), ps)
            elif rule.window is WindowCharge.PASS:
                bound = span_pages(retained + max(chunk_len, 1), ps)
            else:
                bound = span_pages(min(retained, cached_len), ps)
            pages.append(min(full, bound))
        else:
            slots = state_slots_per_request(pool, tracking_slot) if rule.state is StateCharge.FULL else 1
            pages.append(slots)
    return KVDemand(tuple(pages), full, slots)
