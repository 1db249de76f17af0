"""The pools side by side: each baseline's capacity arithmetic worked by hand on a tiny model, the
caps it enforces, and a comparison that is the same every time for the same seed."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.decl import (
    MHA,
    FullLifetime,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from kvchain.errors import CapacityError
from kvchain.plan import plan_kv_storage
from kvchain.sim.baselines import (
    PoolConfig,
    StaticSplit,
    kvchain_pool,
    sglang_static_pool,
    static_caps,
    static_pool,
    uniform_layout,
    vllm_hybrid_pool,
)
from kvchain.sim.compare import SchedulerConfig, compare
from kvchain.sim.workloads import workload_from_name


def tiny_hybrid():
    """Full attention MHA 1x4 bf16 (16 B/token) with an SSM state of 64 float32 (256 B/slot) on
    layer 0, and one window-16 layer MHA 2x4 bf16 (32 B/token)."""
    return kv_layer_decls([
        [KVPart(MHA(1, 4), FullLifetime()),
         KVPart(State((StateTensor("ssm", (64,), "float32"),)), StateLifetime())],
        KVPart(MHA(2, 4), WindowLifetime(16)),
    ])


def test_static_caps_by_hand():
    """state gets 0.9/1.9 of the chain; the rest buys full tokens at 16 + 0.5 * 32 bytes each."""
    plan = plan_kv_storage(tiny_hybrid(), page_size=4)
    caps = dict(zip((p.kind.value for p in plan.sub_pools), static_caps(plan, 19_000, StaticSplit(0.5, 0.9))))
    # state: int(19000 * 0.9 / 1.9) = 9000 bytes -> 9000 // 256 = 35 slots
    # attention: 10000 bytes / 32 bytes per full token = 312.5 tokens -> 312 // 4 = 78 full pages
    # window: 0.5 * 312.5 = 156.25 tokens -> 156 // 4 = 39 pages
    assert caps == {"state": 35, "full": 78, "window": 39}


def test_static_caps_without_state_or_windows():
    """A full-attention-only model gives every byte to full attention: 10000 / 16 = 625 tokens."""
    plan = plan_kv_storage(kv_layer_decls([KVPart(MHA(1, 4), FullLifetime())]), page_size=4)
    assert static_caps(plan, 10_000, StaticSplit()) == (625 // 4,)


def test_uniform_layout_by_hand():
    """One layer per kind: groups of 1. One state (256 B) is 16 tokens of the smallest attention
    kind (16 B/token), aligned to 16; the page is the larger kind's 16-token block: 32 * 16 = 512 B."""
    layout = uniform_layout(plan_kv_storage(tiny_hybrid(), page_size=4), page_size=4)
    assert (layout.group_size, layout.block_tokens, layout.page_bytes) == (1, 16, 512)
    assert set(layout.padding_layers.values()) == {0}


def test_uniform_layout_pads_layer_groups():
    """Two full layers and three window layers: groups of 2, the window kind padded by one layer;
    no state, so a page is a page-size block: 2 layers * 32 B * 4 tokens = 256 B."""
    decls = kv_layer_decls([KVPart(MHA(1, 4), FullLifetime())] * 2 + [KVPart(MHA(2, 4), WindowLifetime(16))] * 3)
    layout = uniform_layout(plan_kv_storage(decls, page_size=4), page_size=4)
    assert (layout.group_size, layout.block_tokens, layout.page_bytes) == (2, 4, 256)
    names = {p.kind.value: p.name for p in plan_kv_storage(decls, page_size=4).sub_pools}
    assert layout.groups[names["window"]] == 2 and layout.padding_layers[names["window"]] == 1
    assert layout.padding_layers[names["full"]] == 0


def test_static_pool_enforces_its_caps():
    """A static pool refuses full-attention pages past its cap although the arena has bytes left;
    kvchain on the same budget takes them."""
    cfg = PoolConfig(budget_bytes=4 * 2**20, page_size=4, context_len=256, max_running=4)
    static = static_pool(tiny_hybrid(), cfg, StaticSplit(0.5, 0.9))
    unified = kvchain_pool(tiny_hybrid(), cfg)
    full = next(i for i, p in enumerate(static.plan.sub_pools) if p.kind.value == "full")
    cap = static.chain.caps[full]
    demand = [0] * len(static.plan.sub_pools)
    demand[full] = cap + 1
    assert not static.chain.units_fit(demand)
    with pytest.raises(CapacityError):
        static.chain.take(demand)
    assert unified.chain.caps is None and unified.chain.units_fit(demand)


COMPARED = ("kvchain", "vllm-hybrid", "sglang-static", "ideal", "static-best", "uniform-page")


def _small_comparison():
    from kvchain.models import model_from_preset

    reqs = workload_from_name("chat", 40, 7, prompt_median=300, output_median=60, max_len=2048)
    cfg = PoolConfig(budget_bytes=256 * 2**20, context_len=4096, max_running=32)
    sched = SchedulerConfig(max_batched_tokens=1024, max_running=32)
    return compare(model_from_preset("gpt-oss-20b").decls, cfg, reqs, COMPARED, sched=sched, jobs=1)


def test_the_same_seed_gives_the_same_comparison():
    """Two runs of one seeded comparison agree on every metric and every step of every pool."""
    a, b = _small_comparison(), _small_comparison()
    assert [r.to_dict() for r in a.results] == [r.to_dict() for r in b.results]
    assert a.histories == b.histories and a.static_best == b.static_best
    assert {r.pool for r in a.results} == set(COMPARED)
    assert all(r.finished == 40 and r.aborted == 0 for r in a.results)
    assert np.isclose(a.ratios()["kvchain"], 1.0)


def test_each_pool_caches_state_its_engines_way_unless_told():
    """No strategy given: kvchain, the ideal bound and vLLM copy checkpoints on their grid
    (`extra_buffer_lazy`; vLLM's grid is its block), sglang keeps sequence ends only; one given
    applies to every pool."""
    from kvchain.cache.radix import CheckpointStrategy
    from kvchain.sim.baselines import engine_strategy

    auto = PoolConfig(1 << 20, context_len=256, max_running=8)
    lazy, none = CheckpointStrategy.EXTRA_BUFFER_LAZY, CheckpointStrategy.NO_BUFFER
    assert {p: engine_strategy(auto, p) for p in ("kvchain", "ideal", "vllm-hybrid", "sglang-static")} == {
        "kvchain": lazy, "ideal": lazy, "vllm-hybrid": lazy, "sglang-static": none}
    told = PoolConfig(1 << 20, strategy=CheckpointStrategy.EXTRA_BUFFER)
    assert {engine_strategy(told, p) for p in ("kvchain", "vllm-hybrid", "sglang-static")} == {
        CheckpointStrategy.EXTRA_BUFFER}
    decls = tiny_hybrid()
    assert kvchain_pool(decls, auto).strategy is lazy
    vllm = vllm_hybrid_pool(decls, auto)
    assert vllm.strategy is lazy and vllm.checkpoint_interval == vllm.uniform.block_tokens
    assert sglang_static_pool(decls, auto).checkpoint_interval is None
