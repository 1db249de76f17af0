"""A Gemma-3-like model split into two pipeline stages whose layer partition gives them different
bytes per token, on tiny CPU arenas, and the mixed traffic the stage tests serve."""

from __future__ import annotations

from kvchain.decl import MHA, FullLifetime, KVPart, WindowLifetime, kv_layer_decls
from kvchain.plan import plan_stages
from kvchain.sim.pp import StageSpec, build_stage, install_stages
from kvchain.sizing import size_plan
from support.simworld import workload

PARTITION = (7, 5)


def gemma_like(blocks: int = 2, window: int = 16) -> tuple:
    """Gemma 3's interleave: five sliding-window layers, then one global layer."""
    w = KVPart(MHA(2, 4), WindowLifetime(window))
    f = KVPart(MHA(1, 8), FullLifetime())
    return tuple(kv_layer_decls([w, w, w, w, w, f] * blocks))


def spec(chain_kib: int = 16, partition=PARTITION, **kwargs) -> StageSpec:
    decls = gemma_like()
    plans = plan_stages(decls, 2, page_size=4, partition=partition)
    fixed = size_plan(plans[0], 2**30, context_len=256, max_running_requests=16).fixed.total
    return StageSpec(decls, 2, fixed + chain_kib * 1024, partition=partition, **kwargs)


def stage_pools(chain_kib: int = 16, install: bool = True, **kwargs):
    s = spec(chain_kib, **kwargs)
    pools = [build_stage(s, stage) for stage in range(2)]
    if install:
        install_stages(pools)
    return pools


def traffic(n: int = 80):
    return workload(1, n=n, max_prompt=60, max_output=40)
