"""`size_plan`: solve one byte budget into boot targets for every sub-pool.

The budget is spent in a fixed order: fixed allocations (request table, scratch, request rows),
then state slots (a share of the chain, an explicit count, or by default as many as the requests
the rest of the budget serves at the context length), then the most full-attention tokens whose
window targets also fit. Targets only describe the boot layout: at run time any sub-pool can take
any free bytes of the arena."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from . import env
from .errors import BudgetError, InputError
from .memory.arena import ARENA_ALIGN, arena_layout
from .plan import KVStoragePlan, PoolKind, SubPool, TokenIds, checked_plan
from .units import format_bytes, is_integer

#: Per-request device state besides the KV pages (lengths, slot ids, reset flags), bytes per row.
ROW_STATE_BYTES = 64
#: Bytes of one `req_to_token` entry (int32 virtual token id).
REQUEST_TABLE_ENTRY_BYTES = 4
#: Floor of the move staging buffer: compaction copies go through it, so no move allocates.
MIN_SCRATCH_BYTES = 32 * 2**20


def state_slots_per_request(pool: SubPool, tracking: bool | None = None) -> int:
    """A running slot, plus a tracking slot when the prefix tree checkpoints the state, plus a
    speculative round's scratch slots when a fused draft's plan declares them. `tracking`: whether
    the pool keeps a tracking slot per request (None: when the plan's state lifetime declares a
    checkpoint interval, which is all a plan alone can tell)."""
    if tracking is None:
        tracking = getattr(pool.lifetime, "checkpoint_interval", None) is not None
    return (2 if tracking else 1) + getattr(pool.lifetime, "speculative_slots", 0)


def window_peak_pages(window: int, page_size: int) -> int:
    """Most pages a window's rows span at once: `window` retained tokens plus the token being
    written, misaligned against pages."""
    return -(-window // page_size) + 1


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(frozen=True)
class FixedAllocations:
    """Allocations outside the chain, spent before any sub-pool."""

    request_table: int
    scratch: int
    request_rows: int

    @property
    def total(self) -> int:
        return self.request_table + self.scratch + self.request_rows

    def terms(self) -> list[tuple[str, int]]:
        return [("request table", self.request_table), ("scratch", self.scratch),
                ("request rows", self.request_rows)]


def fixed_allocations(plan: KVStoragePlan, context_len: int, max_running_requests: int) -> FixedAllocations:
    rows = max_running_requests + 1  # row 0 is the padding row
    max_page = max(p.page_bytes for p in plan.sub_pools)
    moves = int(env.get("KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL"))
    scratch = max(max_page, min(moves * max_page, MIN_SCRATCH_BYTES))
    scratch = -(-scratch // ARENA_ALIGN) * ARENA_ALIGN
    return FixedAllocations(
        request_table=rows * context_len * REQUEST_TABLE_ENTRY_BYTES,
        scratch=scratch,
        request_rows=rows * ROW_STATE_BYTES,
    )


@dataclass(frozen=True)
class FloorTerm:
    """One term of the floor: `key` is its fixed snake_case name for JSON, `pool` the sub-pool it
    counts (if any), `checked` whether `check_bs1_floor` refuses a budget without it."""

    name: str
    bytes: int
    key: str = ""
    pool: str | None = None
    pages: int | None = None
    checked: bool = True


@dataclass(frozen=True)
class Bs1Floor:
    """The least budget that serves one request of the context length at batch size 1: fixed
    allocations, its window rows, its state slots, the gaps the chain keeps between sub-pools, the
    sink pages with their grid alignment, and its full-attention pages. The full-attention pages
    are not a sizing refusal (DECL-13): `total` (every term but them) is what `check_bs1_floor`
    enforces; a budget of `one_request` (every term) or more plans a concurrency of at least 1."""

    terms: tuple[FloorTerm, ...]

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms if t.checked)

    @property
    def one_request(self) -> int:
        return sum(t.bytes for t in self.terms)

    def explain(self, checked_only: bool = False) -> str:
        return " + ".join(f"{t.name} {format_bytes(t.bytes)}" for t in self.terms if t.checked or not checked_only)

    def to_dict(self) -> dict:
        return {"total_bytes": self.total, "one_request_bytes": self.one_request,
                "terms": [{"term": t.key, "sub_pool": t.pool, "pages": t.pages, "bytes": t.bytes,
                           "checked": t.checked} for t in self.terms]}


def chain_gap_bytes(plan: KVStoragePlan) -> int:
    """Bytes the sizing keeps free between neighbouring sub-pools (a page of the larger of each pair),
    so every band can align its grid next to its neighbour."""
    chain = plan.sub_pools
    return sum(max(chain[i - 1].page_bytes, chain[i].page_bytes) for i in range(1, len(chain)))


def sink_bound_bytes(plan: KVStoragePlan) -> int:
    """The most bytes the sink region can take in any arena, plus the arena's rounding to
    `ARENA_ALIGN`: the grow-up end and the floats place their sinks at fixed offsets, the grow-down
    end's grid origin depends on the arena's size, so its sink may need up to two of its pages."""
    cursor = 0
    for pool in plan.sub_pools:
        if not pool.is_attention or pool is plan.down_end:
            continue
        pb = pool.page_bytes
        cursor = (-(-cursor // pb) + 1) * pb
    return cursor + 2 * plan.down_end.page_bytes - 1 + ARENA_ALIGN - 1


def _bs1_floor_terms(plan: KVStoragePlan, context_len: int, max_running_requests: int) -> list[FloorTerm]:
    fixed = fixed_allocations(plan, context_len, max_running_requests)
    keys = {"request table": "request_table", "scratch": "scratch", "request rows": "request_rows"}
    terms = [FloorTerm(name, b, keys[name]) for name, b in fixed.terms()]
    ps = plan.page_size
    ctx_pages = pages_for(context_len, ps)
    for pool in plan.windows:
        pages = min(window_peak_pages(pool.window, ps), ctx_pages)
        terms.append(FloorTerm(f"{pool.name} rows ({pages} pages)", pages * pool.page_bytes, "window_rows",
                               pool.name, pages))
    state = plan.state
    if state is not None:
        slots = state_slots_per_request(state)
        terms.append(FloorTerm(f"state slots ({slots})", slots * state.page_bytes, "state_slots", state.name, slots))
    if len(plan.sub_pools) > 1:
        terms.append(FloorTerm("gaps between sub-pools", chain_gap_bytes(plan), "sub_pool_gaps"))
    attention = [p for p in plan.sub_pools if p.is_attention]
    terms.append(FloorTerm(f"sink pages ({len(attention)}) and alignment", sink_bound_bytes(plan), "sink_pages"))
    owner = plan.owner
    terms.append(FloorTerm(f"{owner.name} rows ({ctx_pages} pages, checked at admission)",
                           ctx_pages * owner.page_bytes, "full_attention_rows", owner.name, ctx_pages, checked=False))
    return terms


def _sizing_args(plan: KVStoragePlan, budget_bytes: int, context_len: int,
                 max_running_requests: int) -> tuple[int, int, int]:
    """The budget, context length and request count as plain ints, or an InputError naming the
    argument: a plan that is not a `KVStoragePlan`, a budget that is not an integer, a context
    length or request count that is not a positive integer (a bool or a float is none of these;
    a numpy integer is)."""
    checked_plan(plan)
    if not is_integer(budget_bytes):
        raise InputError(f"budget_bytes must be an integer number of bytes, got {budget_bytes!r}")
    if not is_integer(context_len) or context_len <= 0:
        raise InputError(f"context_len (the context length) must be a positive integer, got {context_len!r}")
    if not is_integer(max_running_requests) or max_running_requests <= 0:
        raise InputError(f"max_running_requests must be a positive integer, got {max_running_requests!r}")
    return int(budget_bytes), int(context_len), int(max_running_requests)


def check_bs1_floor(plan: KVStoragePlan, budget_bytes: int, context_len: int, max_running_requests: int) -> Bs1Floor:
    """Refuse a budget below the batch-size-1 floor's checked terms, naming every term and its bytes
    (`BudgetError`), and, as `size_plan` does, arguments that are not what they say (`InputError`)."""
    budget_bytes, context_len, max_running_requests = _sizing_args(plan, budget_bytes, context_len,
                                                                   max_running_requests)
    floor = Bs1Floor(tuple(_bs1_floor_terms(plan, context_len, max_running_requests)))
    if budget_bytes < floor.total:
        have, need = format_bytes(budget_bytes), format_bytes(floor.total)
        if have == need:  # a budget just below the floor rounds to it: give both exactly
            have, need = f"{budget_bytes:,} bytes", f"{floor.total:,} bytes"
        raise BudgetError(
            f"budget {have} is below the batch-size-1 floor of {need} ({floor.explain(checked_only=True)}); "
            f"one request of {context_len:,} tokens needs {format_bytes(floor.one_request)}"
        )
    return floor


@dataclass(frozen=True)
class PoolTarget:
    """A sub-pool's boot target, with the page and unit bytes of the sub-pool it was sized for (what
    `build_kv_storage` checks the plan it builds against)."""

    name: str
    kind: PoolKind
    pages: int
    units: int
    bytes: int
    page_bytes: int
    unit_bytes: int


@dataclass(frozen=True)
class PlanSizing:
    """What one budget buys: boot targets per sub-pool and the concurrency they serve."""

    budget_bytes: int
    context_len: int
    max_running_requests: int
    fixed: FixedAllocations
    arena_bytes: int
    sink_bytes: int
    state_slots: int
    state_slots_per_request: int
    targets: tuple[PoolTarget, ...]
    full_tokens: int
    concurrency: int
    limited_by: str
    floor: Bs1Floor
    #: the page size of the plan this sizing was made for
    page_size: int

    @property
    def used_bytes(self) -> int:
        return self.fixed.total + self.sink_bytes + sum(t.bytes for t in self.targets)

    def target(self, name: str) -> PoolTarget:
        return next(t for t in self.targets if t.name == name)

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "context_len": self.context_len,
            "max_running_requests": self.max_running_requests,
            "fixed": {"request_table": self.fixed.request_table, "scratch": self.fixed.scratch,
                      "request_rows": self.fixed.request_rows},
            "arena_bytes": self.arena_bytes,
            "sink_bytes": self.sink_bytes,
            "state_slots": self.state_slots,
            "state_slots_per_request": self.state_slots_per_request,
            "targets": [
                {"name": t.name, "kind": t.kind.value, "pages": t.pages, "units": t.units, "bytes": t.bytes}
                for t in self.targets
            ],
            "full_tokens": self.full_tokens,
            "concurrency": self.concurrency,
            "limited_by": self.limited_by,
            "unused_bytes": self.budget_bytes - self.used_bytes,
            "bs1_floor": self.floor.to_dict(),
        }


def _max_true(lo: int, hi: int, ok) -> int:
    """Largest x in [lo, hi] with ok(x), given ok monotone decreasing and ok(lo) true."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def size_plan(
    plan: KVStoragePlan,
    budget_bytes: int,
    *,
    context_len: int = 32768,
    max_running_requests: int = 256,
    state_slots: int | None = None,
    state_share: float | None = None,
) -> PlanSizing:
    """Solve `budget_bytes` into boot targets (see the module docstring for the order). Raises
    `InputError` for a budget, context length, request count or slot count that is not an integer
    (a bool or a float included; numpy integers are integers), a context length or request count
    below 1, a state share that is not a number in (0, 1), and `BudgetError` for a budget below the
    batch-size-1 floor (`check_bs1_floor`)."""
    budget_bytes, context_len, max_running_requests = _sizing_args(plan, budget_bytes, context_len,
                                                                   max_running_requests)
    if state_slots is not None and state_share is not None:
        raise InputError("give state slots as a count or as a share of the chain, not both")
    if state_share is not None and (isinstance(state_share, bool) or not isinstance(state_share, numbers.Real)
                                    or not math.isfinite(state_share) or not 0.0 < state_share < 1.0):
        raise InputError(f"state_share (the state's share of the chain) must be a number in (0, 1), "
                         f"got {state_share!r}")
    if state_slots is not None:
        if not is_integer(state_slots) or state_slots < 0:
            raise InputError(f"state_slots must be an integer >= 0, got {state_slots!r}")
        state_slots = int(state_slots)

    floor = check_bs1_floor(plan, budget_bytes, context_len, max_running_requests)
    fixed = fixed_allocations(plan, context_len, max_running_requests)
    layout = arena_layout(plan, budget_bytes - fixed.total)
    ps = plan.page_size
    ctx_pages = pages_for(context_len, ps)
    chain = plan.sub_pools
    slack = chain_gap_bytes(plan)
    avail = max(0, layout.chain_bytes - slack)
    owner = plan.owner
    windows = plan.windows
    peaks = {w.name: min(window_peak_pages(w.window, ps), ctx_pages) for w in windows}

    def window_pages(full_pages: int) -> dict[str, int]:
        """Each request of `context_len` tokens that `full_pages` hold retains at most its window's
        peak; no more requests run than there are request rows."""
        q, r = divmod(full_pages, ctx_pages)
        if q >= max_running_requests:
            return {w.name: max_running_requests * peaks[w.name] for w in windows}
        return {w.name: q * peaks[w.name] + min(r, peaks[w.name]) for w in windows}

    def token_bytes(full_pages: int) -> int:
        wp = window_pages(full_pages)
        return full_pages * owner.page_bytes + sum(wp[w.name] * w.page_bytes for w in windows)

    state = plan.state
    spr = state_slots_per_request(state) if state is not None else 0
    if state is None:
        slots = 0
    elif state_slots is not None:
        slots = state_slots
    elif state_share is not None:
        slots = int(state_share * avail) // state.page_bytes
    else:
        per_request = spr * state.page_bytes

        def serves(n: int) -> bool:
            return n * per_request + token_bytes(n * ctx_pages) <= avail

        n = _max_true(0, max_running_requests, serves)
        slots = max(n, 1) * spr
    state_bytes = slots * (state.page_bytes if state is not None else 0)
    if state_bytes > avail:
        raise BudgetError(
            f"{slots} state slots take {format_bytes(state_bytes)}, more than the chain's "
            f"{format_bytes(avail)} after fixed allocations"
        )
    full_pages = _max_true(0, (avail - state_bytes) // owner.page_bytes,
                           lambda p: state_bytes + token_bytes(p) <= avail)
    token_owner = isinstance(owner.geometry, TokenIds)
    if token_owner:  # ids cost no KV: boot with what every request row can use, not the leftover bytes
        full_pages = min(full_pages, max_running_requests * ctx_pages)
    wp = window_pages(full_pages)
    targets = []
    for pool in chain:
        if pool.kind is PoolKind.FULL:
            pages = full_pages
        elif pool.kind is PoolKind.WINDOW:
            pages = wp[pool.name]
        else:
            pages = slots
        targets.append(PoolTarget(pool.name, pool.kind, pages, pages * pool.units_per_page, pages * pool.page_bytes,
                                  pool.page_bytes, pool.unit_bytes))

    bounds = {} if token_owner else {"tokens": full_pages // ctx_pages}
    bounds["max running requests"] = max_running_requests
    if token_owner and windows:  # its free ids bound nothing, but the window rows they bind do
        bounds["tokens"] = full_pages // ctx_pages
    if state is not None:
        bounds["state slots"] = slots // spr
    limited_by = min(bounds, key=lambda k: bounds[k])
    return PlanSizing(
        budget_bytes=budget_bytes,
        context_len=context_len,
        max_running_requests=max_running_requests,
        fixed=fixed,
        arena_bytes=layout.arena_bytes,
        sink_bytes=layout.sink_bytes,
        state_slots=slots,
        state_slots_per_request=spr,
        targets=tuple(targets),
        full_tokens=full_pages * ps,
        concurrency=bounds[limited_by],
        limited_by=limited_by,
        floor=floor,
        page_size=plan.page_size,
    )


@dataclass(frozen=True)
class PipelineSizing:
    """Each pipeline stage's own sizing of its own layers, and the concurrency the pipeline serves:
    the least of the stages' (PP-3), since every stage holds every request's units."""

    stages: tuple[PlanSizing, ...]

    @property
    def concurrency(self) -> int:
        return min(s.concurrency for s in self.stages)

    @property
    def limiting_stage(self) -> int:
        return min(range(len(self.stages)), key=lambda i: (self.stages[i].concurrency, i))

    def to_dict(self) -> dict:
        return {"stages": [s.to_dict() for s in self.stages], "concurrency": self.concurrency,
                "limiting_stage": self.limiting_stage}


def size_stages(plans: list[KVStoragePlan], budget_bytes: int, **kwargs) -> PipelineSizing:
    """Size each stage's plan for the same per-device budget (`size_plan`'s keywords apply to every
    stage) and MIN-reduce the concurrency across the stages (PP-3). Raises `InputError` for no plans."""
    try:
        plans = list(plans)
    except TypeError:
        raise InputError(f"plans must be a list of stage plans (from plan_stages), got {plans!r}") from None
    if not plans:
        raise InputError("plans is empty: size_stages needs at least one stage's plan")
    return PipelineSizing(tuple(size_plan(p, budget_bytes, **kwargs) for p in plans))
