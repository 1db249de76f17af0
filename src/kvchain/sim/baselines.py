"""The pools engines use today, next to kvchain, on the same byte budget, trace and scheduler loop.

Two kinds of baseline. The engines, each with its own memory layout and its own scheduling policy
(`engine/policies.py`), so a comparison measures what a user of that engine would see:

* `vllm-hybrid`: `uniform-page`'s layout with vLLM's policy: admit while the chunk's blocks fit
  with the watermark kept free, allocate on demand, preempt the newest running request by
  recompute when one cannot grow; prefix caching on whole blocks, state kept at block boundaries,
  cached blocks evicted by recency alone.
* `sglang-static`: `static-default`'s split with sglang's policy: new requests charged their prompt
  and output, running ones `new_token_ratio` (0.7 decaying to 0.1) x their remaining output;
  decodes retracted when a step cannot grow; cached pages evicted by recency alone.
* `ideal`: the physical limit: bytes exactly as needed (one-token pages, no padding, no fixed
  split) and perfect knowledge of each request's output length, reserved exactly.

And the layouts alone, with kvchain's own admission, so a comparison isolates the memory layout:

* `static-default`: fixed pools per kind that cannot borrow each other's bytes (emulated as a
  ceiling on each band's live pages): the state pool gets `state_ratio` state bytes per attention
  byte (0.9, the default memory ratio of the engines that split a recurrent-state pool this way),
  and each window pool `window_ratio` window tokens per full-attention token (0.8, their default).
* `static-best`: the same, its two ratios chosen by a sweep on the trace itself: an oracle no
  real deployment has.
* `uniform-page`: one shared pool of equal-byte pages, as hybrid allocators that page every layer
  kind alike do: layers are grouped into groups of the smallest kind's layer count (other kinds
  padded up to whole groups), an attention page is enlarged to a block of tokens big enough that
  its bytes reach one recurrent state's, state is padded to that page, and prefix caching (and
  state checkpoints) work in whole blocks.
* `kvchain`: the unified chain: every sub-pool takes any free bytes, pages of each band's own size,
  with its admission mode (`optimistic` by default, or `exact`); `kvchain-exact` is the same pool
  with `exact` admission, to run both modes side by side.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..build import build_kv_storage
from ..cache.checkpoints import default_checkpoint_interval
from ..cache.radix import CheckpointStrategy
from ..decl import KVLayerDecl
from ..engine.policies import ADMISSION_MODES, IdealPolicy, SglangPolicy, VllmPolicy, admission_policy
from ..engine.pool import KVChainPool
from ..errors import InputError
from ..layout.entry import PageEnvelope
from ..memory.arena import arena_layout
from ..plan import KVStoragePlan, PoolKind, plan_kv_storage
from ..sizing import PlanSizing, size_plan
from ..units import is_integer
from .waiting import EVICTION_ORDERS, WAITING_ORDERS

#: The defaults of the engines whose static split these baselines model.
DEFAULT_WINDOW_RATIO = 0.8
DEFAULT_STATE_RATIO = 0.9
#: Uniform pages round the enlarged attention block to this many tokens.
UNIFORM_BLOCK_ALIGN = 16
#: The ideal pool's page: one token, so nothing is rounded.
IDEAL_PAGE_TOKENS = 1


@dataclass(frozen=True)
class PoolConfig:
    """What every pool in a comparison shares."""

    budget_bytes: int
    page_size: int = 64
    context_len: int = 32768
    max_running: int = 256
    prefix_cache: bool = True
    checkpoint_interval: int | None = None
    #: how the prefix tree caches recurrent state: one for every pool, or None for each pool its
    #: engine's own (`engine_strategy`)
    strategy: CheckpointStrategy | None = None
    #: kvchain's admission mode, also used by the layout-only baselines (see `admission_policy`)
    admission: str = "optimistic"
    #: kvchain's waiting order, also used by the layout-only baselines (`sim/waiting.py`): first
    #: come first served by default, as the engines' pools and `ideal` always admit;
    #: `longest-prefix` raises hit rates but costs whole-run steps on some rows (docs/simulate.md)
    waiting_order: str = "fcfs"
    #: bytes of the host tier behind kvchain's prefix tree (`sim/host_tier.py`), 0 for none
    host_budget: int = 0
    #: how kvchain's prefix tree (and the layout-only baselines') picks what to evict
    #: (`sim/waiting.py`): `waiting-aware` (the default), what the first waiting requests will
    #: match kept until last, or `lru`, least recently used alone, as the engines' pools and
    #: `ideal` always evict (docs/simulate.md: the default serves 19 of 20 comparison rows in
    #: the same or fewer steps than `lru`, with more hits)
    eviction: str = "waiting-aware"

    def __post_init__(self) -> None:
        """An admission mode, waiting order or eviction order the CLI would not offer is refused here,
        not read as the default later: InputError listing the allowed values (the CLI's choices)."""
        for name, allowed in (("admission", ADMISSION_MODES), ("waiting_order", WAITING_ORDERS),
                              ("eviction", EVICTION_ORDERS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise InputError(f"PoolConfig {name} must be one of {', '.join(allowed)}; got {value!r}")
        if not isinstance(self.prefix_cache, bool):
            raise InputError(f"PoolConfig prefix_cache must be a bool, got {self.prefix_cache!r}")
        if self.checkpoint_interval is not None and (not is_integer(self.checkpoint_interval)
                                                     or self.checkpoint_interval < 1):
            raise InputError(f"PoolConfig checkpoint_interval must be None or a positive integer, "
                             f"got {self.checkpoint_interval!r}")
        if not is_integer(self.host_budget) or self.host_budget < 0:
            raise InputError(f"PoolConfig host_budget must be a number of bytes >= 0, got {self.host_budget!r}")


#: How each pool's prefix tree caches recurrent state when `PoolConfig.strategy` is None. kvchain
#: (and the layouts under its admission, and the ideal bound) copies the state into a fresh slot at
#: each grid point a chunk ends on (`extra_buffer_lazy`): no request holds a second, tracking slot,
#: which on a state-heavy model at a binding budget costs more steps than its hits save
#: (docs/simulate.md). vLLM keeps the state of each block boundary its prefill passes in a block of
#: its own that the prefix cache then holds: the same, on its block grid. sglang's default keeps
#: only the state at a sequence's end (`no_buffer`).
ENGINE_STRATEGIES = {"sglang-static": CheckpointStrategy.NO_BUFFER}
DEFAULT_STRATEGY = CheckpointStrategy.EXTRA_BUFFER_LAZY


def engine_strategy(cfg: PoolConfig, pool: str) -> CheckpointStrategy:
    """The strategy `pool` runs under `cfg`: the one given, or its engine's own."""
    if cfg.strategy is not None:
        return cfg.strategy
    return ENGINE_STRATEGIES.get(pool, DEFAULT_STRATEGY)


def _sizing(plan: KVStoragePlan, cfg: PoolConfig) -> PlanSizing:
    return size_plan(plan, cfg.budget_bytes, context_len=cfg.context_len, max_running_requests=cfg.max_running)


def _checkpoint(plan: KVStoragePlan, cfg: PoolConfig) -> int | None:
    if plan.state is None:
        return None
    return cfg.checkpoint_interval or default_checkpoint_interval(plan)


def kvchain_pool(decls: Sequence[KVLayerDecl], cfg: PoolConfig) -> KVChainPool:
    plan = plan_kv_storage(decls, page_size=cfg.page_size)
    storage = build_kv_storage(plan, _sizing(plan, cfg), "meta")
    pool = KVChainPool(storage, prefix_cache=cfg.prefix_cache, strategy=engine_strategy(cfg, "kvchain"),
                       checkpoint_interval=_checkpoint(plan, cfg), policy=admission_policy(cfg.admission))
    pool.name = "kvchain"
    pool.waiting_order = cfg.waiting_order
    pool.eviction = cfg.eviction
    if cfg.host_budget:
        from .host_tier import with_host_tier

        pool = with_host_tier(pool, cfg.host_budget)
    return pool


def ideal_pool(decls: Sequence[KVLayerDecl], cfg: PoolConfig) -> KVChainPool:
    """The physical limit: the chain with one-token pages (no page rounding, so a checkpoint or
    a cached sequence end can land on any token), no padding, no fixed split, and the real output
    length of every request reserved exactly (it never retracts and reserves nothing unused)."""
    plan = plan_kv_storage(decls, page_size=IDEAL_PAGE_TOKENS)
    storage = build_kv_storage(plan, _sizing(plan, cfg), "meta")
    interval = cfg.checkpoint_interval or (default_checkpoint_interval(plan) if plan.state is not None else None)
    pool = KVChainPool(storage, prefix_cache=cfg.prefix_cache, strategy=engine_strategy(cfg, "ideal"),
                       checkpoint_interval=interval, policy=IdealPolicy())
    pool.name = "ideal"
    return pool


# -- static pools ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticSplit:
    window_ratio: float = DEFAULT_WINDOW_RATIO  # window tokens per full-attention token
    state_ratio: float = DEFAULT_STATE_RATIO  # state bytes per attention byte


def static_caps(plan: KVStoragePlan, chain_bytes: int, split: StaticSplit) -> tuple[int, ...]:
    """Pages per band a static split of `chain_bytes` gives each kind's fixed pool."""
    state = plan.state
    state_bytes = int(chain_bytes * split.state_ratio / (1 + split.state_ratio)) if state is not None else 0
    attention_bytes = chain_bytes - state_bytes
    per_full_token = plan.owner.unit_bytes + sum(split.window_ratio * w.unit_bytes for w in plan.windows)
    full_tokens = attention_bytes / per_full_token
    caps = []
    for pool in plan.sub_pools:
        if pool.kind is PoolKind.FULL:
            caps.append(int(full_tokens) // pool.page_size)
        elif pool.kind is PoolKind.WINDOW:
            caps.append(int(full_tokens * split.window_ratio) // pool.page_size)
        else:
            caps.append(state_bytes // pool.page_bytes)
    return tuple(caps)


def static_pool(decls: Sequence[KVLayerDecl], cfg: PoolConfig, split: StaticSplit = StaticSplit(),
                name: str = "static-default") -> KVChainPool:
    plan = plan_kv_storage(decls, page_size=cfg.page_size)
    sizing = _sizing(plan, cfg)
    storage = build_kv_storage(plan, sizing, "meta")
    chain_bytes = arena_layout(plan, sizing.arena_bytes).chain_bytes
    storage.allocator.caps = static_caps(plan, chain_bytes, split)
    pool = KVChainPool(storage, prefix_cache=cfg.prefix_cache, strategy=engine_strategy(cfg, name),
                       checkpoint_interval=_checkpoint(plan, cfg), policy=admission_policy(cfg.admission))
    pool.name = name
    pool.split = split
    pool.waiting_order = cfg.waiting_order
    pool.eviction = cfg.eviction
    return pool


def sglang_static_pool(decls: Sequence[KVLayerDecl], cfg: PoolConfig) -> KVChainPool:
    """`static-default`'s fixed split with sglang's scheduling policy (`SglangPolicy`)."""
    pool = static_pool(decls, cfg, name="sglang-static")
    pool.policy = SglangPolicy()
    pool.waiting_order = "fcfs"
    pool.eviction = "lru"
    _recency_only(pool)
    return pool


def _recency_only(pool: KVChainPool) -> None:
    """The engines' prefix caches evict cached blocks by recency alone, a block past the last cached
    state as any other (`UnifiedRadixCache.unmatchable_first` off)."""
    if pool.tree is not None:
        pool.tree.unmatchable_first = False


def static_grid(plan: KVStoragePlan) -> list[StaticSplit]:
    """The splits `static-best` tries: window ratios when the model has windows, state ratios when
    it has state."""
    windows = [0.1, 0.25, 0.5, 0.8, 1.0] if plan.windows else [DEFAULT_WINDOW_RATIO]
    states = [0.05, 0.15, 0.4, 0.9, 2.0] if plan.state is not None else [DEFAULT_STATE_RATIO]
    return [StaticSplit(w, s) for w in windows for s in states]


def static_best_split(decls: Sequence[KVLayerDecl], cfg: PoolConfig, evaluate: Callable[[KVChainPool], float]
                      ) -> tuple[StaticSplit, dict[StaticSplit, float]]:
    """The split with the best `evaluate` score (throughput on the trace itself)."""
    plan = plan_kv_storage(decls, page_size=cfg.page_size)
    scores = {split: evaluate(static_pool(decls, cfg, split, name="static-best")) for split in static_grid(plan)}
    best = max(scores, key=lambda s: scores[s])
    return best, scores


# -- uniform pages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class UniformLayout:
    group_size: int
    block_tokens: int
    page_bytes: int
    groups: dict[str, int]  # sub-pool name -> layer groups (padded)
    padding_layers: dict[str, int]

    def waste(self, plan: KVStoragePlan) -> float:
        """Share of a full page set's bytes that are padding (layers and bytes)."""
        used = total = 0
        for pool in plan.sub_pools:
            if pool.name not in self.groups:  # a token-id owner: no layers, no KV
                continue
            per = pool.geometry.unit_bytes() * (self.block_tokens if pool.is_attention else 1)
            used += per * len(pool.layer_ids)
            total += self.page_bytes * self.groups[pool.name]
        return 1 - used / total


def uniform_layout(plan: KVStoragePlan, page_size: int) -> UniformLayout:
    """Group layers into groups of the smallest kind's layer count; size one page to hold a block of
    a group's attention tokens or one group's recurrent state, whichever is larger. A token-id owner
    (no layers) keeps its own pages."""
    layered = [p for p in plan.sub_pools if p.layer_ids]
    group = min(len(p.layer_ids) for p in layered)
    groups = {p.name: math.ceil(len(p.layer_ids) / group) for p in layered}
    padding = {p.name: groups[p.name] * group - len(p.layer_ids) for p in layered}
    attention = [p for p in layered if p.is_attention]
    block = page_size
    if plan.state is not None:
        state_page = group * plan.state.geometry.unit_bytes()
        smallest = min(group * p.geometry.unit_bytes() for p in attention)
        block = max(page_size, -(-state_page // smallest))
        block = -(-block // UNIFORM_BLOCK_ALIGN) * UNIFORM_BLOCK_ALIGN
    page = max(group * p.geometry.unit_bytes() * block for p in attention)
    if plan.state is not None:
        page = max(page, group * plan.state.geometry.unit_bytes())
    page = -(-page // 16) * 16
    return UniformLayout(group, block, page, groups, padding)


def uniform_plan(decls: Sequence[KVLayerDecl], page_size: int) -> tuple[KVStoragePlan, UniformLayout]:
    """The chain plan of the uniform design: pages of `block_tokens` tokens, every page envelope the
    same bytes per layer group, padded layers included."""
    base = plan_kv_storage(decls, page_size=page_size)
    layout = uniform_layout(base, page_size)
    plan = plan_kv_storage(decls, page_size=layout.block_tokens)
    pools = []
    for pool in plan.sub_pools:
        if pool.name not in layout.groups:  # a token-id owner keeps its envelope
            pools.append(pool)
            continue
        env = pool.envelope
        padded = PageEnvelope(env.components, layout.page_bytes * layout.groups[pool.name], env.payload_bytes)
        pools.append(dataclasses.replace(pool, envelope=padded))
    return dataclasses.replace(plan, sub_pools=tuple(pools)), layout


def uniform_pool(decls: Sequence[KVLayerDecl], cfg: PoolConfig, name: str = "uniform-page") -> KVChainPool:
    plan, layout = uniform_plan(decls, cfg.page_size)
    storage = build_kv_storage(plan, _sizing(plan, cfg), "meta")
    interval = layout.block_tokens if plan.state is not None else None
    pool = KVChainPool(storage, prefix_cache=cfg.prefix_cache, strategy=engine_strategy(cfg, name),
                       checkpoint_interval=interval, policy=admission_policy(cfg.admission))
    pool.name = name
    pool.uniform = layout
    pool.waiting_order = cfg.waiting_order
    pool.eviction = cfg.eviction
    return pool


def vllm_hybrid_pool(decls: Sequence[KVLayerDecl], cfg: PoolConfig) -> KVChainPool:
    """`uniform-page`'s layout (equal-byte pages, padded layer groups, block-sized attention pages
    for recurrent state, prefix caching and state entries on block boundaries) with vLLM's
    scheduling policy (`VllmPolicy`)."""
    pool = uniform_pool(decls, cfg, name="vllm-hybrid")
    pool.policy = VllmPolicy()
    pool.waiting_order = "fcfs"
    pool.eviction = "lru"
    _recency_only(pool)
    return pool


#: engines with their own policies, then the layout-only baselines
POOLS = ("kvchain", "vllm-hybrid", "sglang-static", "ideal", "static-default", "static-best", "uniform-page",
         "kvchain-exact")
#: what `kvchain simulate` compares by default
DEFAULT_POOLS = ("kvchain", "vllm-hybrid", "sglang-static", "ideal")
