"""`plan_kv_storage`: group declared parts into sub-pools and order them into a chain.

Parts that share a lifetime and an allocation unit share a sub-pool (one geometry each). Sub-pools
are ordered by lifetime rank (state, windows from the longest, full attention): the first takes the
grow-up end of the arena, the last the grow-down end, the rest float between them."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .decl import MHA, FullLifetime, Geometry, KVLayerDecl, Lifetime, StateLifetime, Unit, WindowLifetime
from .errors import InputError, PlanError
from .layout.entry import ENVELOPE_ALIGN, PageEnvelope, page_envelope
from .units import is_integer


class PoolKind(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


@dataclass(frozen=True)
class TokenIds:
    """The geometry of a token-id owner: virtual token ids and no KV bytes behind them.

    A model with no full-attention layer (only recurrent state: Mamba, Mamba2, Falcon-Mamba; or only
    windows: Mistral-7B-v0.1, Ministral, RecurrentGemma) still runs requests that hold virtual token
    ids (`req_to_token`, the prefix tree) and window bands that bind pages to them; this owner
    mints them.
    It has no layers, so a token costs no KV bytes; each page of ids takes the smallest page
    envelope (`ENVELOPE_ALIGN` bytes) so the owner's id space is byte-bounded like any band's."""

    unit = Unit.TOKEN
    dtype = "uint8"

    def unit_bytes(self) -> int:
        return 0

    def describe(self) -> str:
        return "token ids (no KV)"


#: Name of the token-id owner sub-pool of a chain with no full-attention layer.
TOKEN_OWNER = "tokens"
#: Most virtual pages a token-id owner's grid may hold when built: its small pages span the whole
#: arena, and the allocator keeps id arrays of that length.
MAX_TOKEN_OWNER_PAGES = 1 << 24


#: A window chain's token-id owner page is this fraction of its smallest window page: a request's
#: ids over a context 8x its window then cost about 3% of its window rows.
TOKEN_OWNER_WINDOW_SHARE = 256


class Placement(enum.Enum):
    """Where a band sits on the chain."""

    UP_END = "up-end"  # grows from the low end of the arena upward
    FLOAT = "float"  # between the ends; relocated only by a planned layout
    DOWN_END = "down-end"  # grows from the high end downward; the full-attention owner


@dataclass(frozen=True)
class SubPool:
    """One sub-pool: a lifetime, one geometry, the layers that store it, and its page envelope."""

    index: int
    name: str
    kind: PoolKind
    lifetime: Lifetime
    geometry: Geometry | TokenIds
    layer_ids: tuple[int, ...]
    draft_layer_ids: tuple[int, ...]
    placement: Placement
    envelope: PageEnvelope
    page_size: int

    @property
    def unit(self) -> Unit:
        return self.geometry.unit

    @property
    def unit_bytes(self) -> int:
        """Exact bytes one unit (token or slot) holds across all the sub-pool's layers."""
        return self.geometry.unit_bytes() * len(self.layer_ids)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page envelope (page_size tokens, or one state slot), alignment included."""
        return self.envelope.page_bytes

    @property
    def units_per_page(self) -> int:
        return 1 if self.kind is PoolKind.STATE else self.page_size

    @property
    def window(self) -> int | None:
        return self.lifetime.window if isinstance(self.lifetime, WindowLifetime) else None

    @property
    def is_attention(self) -> bool:
        return self.kind is not PoolKind.STATE

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "kind": self.kind.value,
            "placement": self.placement.value,
            "lifetime": self.lifetime.describe(),
            "geometry": self.geometry.describe(),
            "layers": len(self.layer_ids),
            "layer_ids": list(self.layer_ids),
            "draft_layer_ids": list(self.draft_layer_ids),
            "unit": self.unit.value,
            "unit_bytes": self.unit_bytes,
            "units_per_page": self.units_per_page,
            "page_bytes": self.page_bytes,
        }


@dataclass(frozen=True)
class KVStoragePlan:
    """Sub-pools in chain order, with the roles the chain gives them."""

    page_size: int
    sub_pools: tuple[SubPool, ...]
    tree_slots: tuple[int, ...] = field(default=())

    @property
    def owner(self) -> SubPool:
        """The full-attention sub-pool, which mints the virtual page ids every request holds."""
        return self.sub_pools[-1]

    @property
    def up_end(self) -> SubPool | None:
        return self.sub_pools[0] if len(self.sub_pools) > 1 else None

    @property
    def down_end(self) -> SubPool:
        return self.sub_pools[-1]

    @property
    def floats(self) -> tuple[SubPool, ...]:
        return self.sub_pools[1:-1]

    @property
    def windows(self) -> tuple[SubPool, ...]:
        return tuple(p for p in self.sub_pools if p.kind is PoolKind.WINDOW)

    @property
    def state(self) -> SubPool | None:
        return next((p for p in self.sub_pools if p.kind is PoolKind.STATE), None)

    def by_name(self, name: str) -> SubPool:
        for p in self.sub_pools:
            if p.name == name:
                return p
        raise InputError(f"no sub-pool {name!r} in this plan (sub-pools {[p.name for p in self.sub_pools]})")

    def to_dict(self) -> dict:
        return {
            "page_size": self.page_size,
            "chain": [p.to_dict() for p in self.sub_pools],
            "up_end": None if self.up_end is None else self.up_end.name,
            "floats": [p.name for p in self.floats],
            "down_end": self.down_end.name,
            "tree_slots": [self.sub_pools[i].name for i in self.tree_slots],
        }


def page_envelope_pair(plan: KVStoragePlan) -> tuple[SubPool, SubPool] | None:
    """The two end sub-pools when both hold MHA pages: they share one page-envelope host backing
    (of the larger envelope, HIC-11). A float always keeps a host pool of its own (HIC-12). Here,
    below both host layouts (`layout/host.py`) and the host pools (`memory/host.py`), so they pair alike."""
    up, down = plan.up_end, plan.down_end
    if up is None or up.placement is not Placement.UP_END or up.kind is PoolKind.STATE:
        return None
    if not (isinstance(up.geometry, MHA) and isinstance(down.geometry, MHA)):
        return None
    return up, down


def _kind(lifetime: Lifetime) -> PoolKind:
    if isinstance(lifetime, FullLifetime):
        return PoolKind.FULL
    if isinstance(lifetime, WindowLifetime):
        return PoolKind.WINDOW
    return PoolKind.STATE


def _sort_key(lifetime: Lifetime) -> tuple:
    if isinstance(lifetime, WindowLifetime):
        return (lifetime.rank, -lifetime.window, lifetime.chunked)
    return (lifetime.rank,)


def _name(lifetime: Lifetime, draft_only: bool) -> str:
    if isinstance(lifetime, FullLifetime):
        return "full"
    if isinstance(lifetime, StateLifetime):
        return "state"
    base = f"{'chunk' if lifetime.chunked else 'window'}{lifetime.window}"
    return f"draft_{base}" if draft_only else base


def checked_plan(plan: object) -> KVStoragePlan:
    """`plan`, or an InputError when it is not a `KVStoragePlan`: the first check of every public
    entry point that takes one (an int or a dict would fail later as an AttributeError)."""
    if not isinstance(plan, KVStoragePlan):
        raise InputError(f"plan must be a KVStoragePlan (from plan_kv_storage), got {plan!r}")
    return plan


def plan_kv_storage(
    decls: Sequence[KVLayerDecl],
    *,
    page_size: int = 64,
    draft: Sequence[KVLayerDecl] | None = None,
    draft_offset: int | None = None,
) -> KVStoragePlan:
    """Group parts into sub-pools and order them into a chain.

    `draft` declares a fused draft model's layers (numbered after the target's: from `draft_offset`,
    by default one past the last declared layer; a pipeline stage, which declares only its own
    layers, passes the whole model's). A draft window of a lifetime the target lacks becomes a band
    of its own; a draft with recurrent state needs the target's state band with a checkpoint policy.
    Raises `InputError` for a page size that is not a positive integer (a bool or a float included)
    and for declarations that are not `KVLayerDecl`s."""
    if not is_integer(page_size) or page_size <= 0:
        raise InputError(f"page size must be a positive integer, got {page_size!r}")
    page_size = int(page_size)
    decls = checked_decls(decls, "decls")
    if not decls:
        raise PlanError("no layers declared: a plan needs at least a full-attention layer")
    if draft is not None:
        draft = checked_decls(draft, "draft")
    if draft_offset is not None and not is_integer(draft_offset):
        raise InputError(f"draft_offset must be an integer, got {draft_offset!r}")

    groups: dict[tuple[Lifetime, Unit], dict] = {}

    def add(lifetime: Lifetime, geometry: Geometry, unit: Unit, layer_id: int, is_draft: bool) -> None:
        group = groups.setdefault(
            (lifetime, unit), {"geometry": geometry, "layers": [], "draft": [], "target": False}
        )
        if group["geometry"] != geometry:
            raise PlanError(
                f"two geometries in one sub-pool ({lifetime.describe()}): "
                f"{group['geometry'].describe()} and {geometry.describe()} (layer {layer_id}); "
                "a sub-pool stores one geometry"
            )
        group["layers"].append(layer_id)
        if is_draft:
            group["draft"].append(layer_id)
        else:
            group["target"] = True

    seen_ids: set[int] = set()
    for decl in decls:
        if decl.layer_id in seen_ids:
            raise PlanError(f"layer {decl.layer_id} is declared twice")
        seen_ids.add(decl.layer_id)
        for part in decl.parts:
            add(part.lifetime, part.geometry, part.unit, decl.layer_id, False)

    if draft:
        offset = max(seen_ids) + 1 if draft_offset is None else draft_offset
        if offset <= max(seen_ids):
            raise PlanError(f"a fused draft's layers start at {offset}, inside the target's (up to {max(seen_ids)})")
        target_state = next((lt for (lt, _u) in groups if isinstance(lt, StateLifetime)), None)
        for decl in draft:
            for part in decl.parts:
                lifetime = part.lifetime
                if isinstance(lifetime, StateLifetime):
                    if target_state is None or target_state.checkpoint_interval is None:
                        raise PlanError(
                            "a fused draft with recurrent layers needs the target's state band with a "
                            "checkpoint policy (StateLifetime(checkpoint_interval=...)); "
                            + ("the target has no state band" if target_state is None
                               else "the target's state band has no checkpoint interval")
                        )
                    lifetime = target_state
                add(lifetime, part.geometry, part.unit, offset + decl.layer_id, True)

    _add_token_owner(groups)
    if not any(isinstance(lt, FullLifetime) for (lt, _u) in groups):
        raise PlanError(
            "no full-attention sub-pool: the chain needs a full-attention owner to mint virtual page ids "
            "(declare at least one layer with a FullLifetime attention part)"
        )

    ordered = sorted(groups.items(), key=lambda item: _sort_key(item[0][0]))
    n = len(ordered)
    sub_pools: list[SubPool] = []
    for index, ((lifetime, _unit), group) in enumerate(ordered):
        if n == 1 or index == n - 1:
            placement = Placement.DOWN_END
        elif index == 0:
            placement = Placement.UP_END
        else:
            placement = Placement.FLOAT
        layer_ids = tuple(group["layers"])
        geometry = group["geometry"]
        if isinstance(geometry, TokenIds):
            name, envelope = TOKEN_OWNER, PageEnvelope((), _token_owner_page_bytes(ordered, page_size), 0)
        else:
            name = _name(lifetime, draft_only=not group["target"])
            envelope = page_envelope(geometry, layer_ids, page_size)
        sub_pools.append(
            SubPool(
                index=index,
                name=name,
                kind=_kind(lifetime),
                lifetime=lifetime,
                geometry=geometry,
                layer_ids=layer_ids,
                draft_layer_ids=tuple(group["draft"]),
                placement=placement,
                envelope=envelope,
                page_size=page_size,
            )
        )
    return KVStoragePlan(page_size, tuple(sub_pools), _tree_slots(sub_pools, groups))


def checked_decls(decls: object, what: str) -> list[KVLayerDecl]:
    """`decls` as a list, every entry a `KVLayerDecl` (an InputError naming `what` otherwise)."""
    try:
        out = list(decls)  # type: ignore[call-overload]
    except TypeError:
        raise InputError(f"{what} must be a sequence of KVLayerDecl, got {decls!r}") from None
    bad = next((i for i, d in enumerate(out) if not isinstance(d, KVLayerDecl)), None)
    if bad is not None:
        raise InputError(f"{what} must be a sequence of KVLayerDecl, got {type(out[bad]).__name__} "
                         f"{out[bad]!r} at index {bad} (number a model's layers with kv_layer_decls)")
    return out


def _add_token_owner(groups: dict) -> None:
    """Add a token-id owner where no layer has full attention (only state, only windows, or both):
    it mints the virtual ids requests hold and window bands bind their pages to (DECL-4, IDS-3)."""
    if any(isinstance(lt, FullLifetime) for (lt, _u) in groups):
        return
    groups[(FullLifetime(), Unit.TOKEN)] = {"geometry": TokenIds(), "layers": [], "draft": [], "target": True}


def _token_owner_page_bytes(ordered: list, page_size: int) -> int:
    """A token-id owner's page: the smallest envelope in a state-only chain; in a chain with windows,
    1/`TOKEN_OWNER_WINDOW_SHARE` of its smallest window page, so the owner's grid over the arena
    stays near the window bands' (its id arrays stay small) while a token's id costs a small share
    of what its window rows cost."""
    windows = [page_envelope(group["geometry"], tuple(group["layers"]), page_size).page_bytes
               for (lifetime, _unit), group in ordered if isinstance(lifetime, WindowLifetime)]
    if not windows:
        return ENVELOPE_ALIGN
    share = -(-min(windows) // TOKEN_OWNER_WINDOW_SHARE)
    return max(ENVELOPE_ALIGN, -(-share // ENVELOPE_ALIGN) * ENVELOPE_ALIGN)


def _tree_slots(sub_pools: list[SubPool], groups: dict) -> tuple[int, ...]:
    """Full attention, the target's primary window, the other windows longest first, then state.

    The primary window is the target's longest: a fused draft's longer window never displaces it."""
    full = [p.index for p in sub_pools if p.kind is PoolKind.FULL]
    windows = [p for p in sub_pools if p.kind is PoolKind.WINDOW]  # chain order: longest first
    target_windows = [p for p in windows if p.layer_ids != p.draft_layer_ids]
    primary = target_windows[:1] if target_windows else windows[:1]
    rest = [p.index for p in windows if p not in primary]
    state = [p.index for p in sub_pools if p.kind is PoolKind.STATE]
    return tuple(full + [p.index for p in primary] + rest + state)


# -- pipeline stages ------------------------------------------------------------------------------


class StagePartitionError(PlanError):
    """A layer partition across pipeline stages that the stages cannot run together: a stage without a
    full-attention owner, a layer kind or window length another stage lacks, a different page size."""


def stage_layer_ranges(n_layers: int, n_stages: int, partition: Sequence[int] | None = None) -> list[range]:
    """The model layers each pipeline stage hosts, contiguous, as engines split them: an even share
    each, the remainder one layer apiece to the stages before the last (whose stage also runs the
    head); or `partition`, explicit layer counts per stage. Raises `InputError` for counts that are
    not integers (a bool, a float or a string: never truncated) or a negative `n_layers`."""
    if not is_integer(n_stages) or n_stages <= 0:
        raise InputError(f"pipeline stages (n_stages) must be a positive integer, got {n_stages!r}")
    if not is_integer(n_layers) or n_layers < 0:
        raise InputError(f"n_layers must be a non-negative integer, got {n_layers!r}")
    n_stages, n_layers = int(n_stages), int(n_layers)
    if partition is not None:
        try:
            counts = list(partition)
        except TypeError:
            raise InputError(f"layer partition must be a sequence of integers, got {partition!r}") from None
        if not all(is_integer(c) for c in counts):
            raise InputError(f"layer partition must be integers, got {partition!r}")
        counts = [int(c) for c in counts]
        if len(counts) != n_stages and n_stages == 1:
            raise StagePartitionError(f"a layer partition of {len(counts)} stages needs as many pipeline stages "
                                      f"(--pp {len(counts)})")
        if len(counts) != n_stages or any(c <= 0 for c in counts) or sum(counts) != n_layers:
            raise StagePartitionError(f"layer partition {counts} must give each of {n_stages} stages at least "
                                      f"one layer, {n_layers} in all")
    else:
        if n_layers < n_stages:
            raise StagePartitionError(f"{n_layers} layers cannot be split across {n_stages} stages")
        counts = [n_layers // n_stages] * n_stages
        for i in range(2, n_layers % n_stages + 2):
            counts[-i] += 1
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def plan_stages(decls: Sequence[KVLayerDecl], n_stages: int, *, page_size: int = 64, n_layers: int | None = None,
                partition: Sequence[int] | None = None,
                plan_fn: Callable[[list[KVLayerDecl]], KVStoragePlan] | None = None) -> list[KVStoragePlan]:
    """One plan per pipeline stage, of the layers it hosts (`stage_layer_ranges` over `n_layers`,
    by default one past the last declared layer). Refuses a stage without a full-attention owner
    (PP-4) and stages whose sub-pools differ in kind, window length or lifetime (PP-5). `plan_fn`
    plans one stage's layers (default `plan_kv_storage` on `page_size`; speculative stages fuse
    the draft into each)."""
    if plan_fn is None:
        def plan_fn(local: list[KVLayerDecl]) -> KVStoragePlan:
            return plan_kv_storage(local, page_size=page_size)
    decls = checked_decls(decls, "decls")
    if n_layers is None:
        n_layers = max(d.layer_id for d in decls) + 1 if decls else 0
    plans = []
    for stage, layers in enumerate(stage_layer_ranges(n_layers, n_stages, partition)):
        local = [d for d in decls if d.layer_id in layers]
        kinds = {p.lifetime.describe() for d in local for p in d.parts}
        if not any(isinstance(p.lifetime, FullLifetime) for d in local for p in d.parts):
            raise StagePartitionError(
                f"stage {stage} (layers {layers.start}..{layers.stop - 1}) has no full-attention layer "
                f"({', '.join(sorted(kinds)) or 'no KV state'}): every stage needs a full-attention owner")
        plans.append(plan_fn(local))
    first = [(p.name, p.lifetime) for p in plans[0].sub_pools]
    for stage, plan in enumerate(plans[1:], 1):
        have = [(p.name, p.lifetime) for p in plan.sub_pools]
        if have != first:
            lacking = sorted({n for n, _ in first} ^ {n for n, _ in have}) or [n for (n, a), (_, b) in
                                                                             zip(first, have) if a != b]
            raise StagePartitionError(
                f"stage {stage} has sub-pools {[n for n, _ in have]}, stage 0 {[n for n, _ in first]} "
                f"(differing: {', '.join(lacking)}): every stage needs the same layer kinds and window lengths")
    return plans
