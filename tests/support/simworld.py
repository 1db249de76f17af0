"""Small worlds for scheduler tests: a hybrid plan on a tiny arena and random workloads."""

from __future__ import annotations

import numpy as np

from kvchain.build import build_kv_storage
from kvchain.cache.radix import CheckpointStrategy
from kvchain.decl import MHA, State, StateTensor
from kvchain.engine.pool import KVChainPool
from kvchain.engine.request import ScheduledRequest
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage
from kvchain.sizing import size_plan


def world(chain_kib=24, page_size=4, window=16, state=True, interval=16, rows=16, slots=None,
          prefix_cache=True, strategy=CheckpointStrategy.EXTRA_BUFFER, context=256):
    ssm = State((StateTensor("ssm", (8,), "float32"),)) if state else None
    decls = small_hybrid(MHA(1, 4), (window,) if window else (), window_geometry=MHA(2, 4), state=ssm,
                         checkpoint_interval=interval)
    plan = plan_kv_storage(decls, page_size=page_size)
    slots = slots if slots is not None else 3 * rows
    probe = size_plan(plan, 2**30, context_len=context, max_running_requests=rows,
                      state_slots=slots if state else None)
    sizing = size_plan(plan, probe.fixed.total + chain_kib * 1024, context_len=context, max_running_requests=rows,
                       state_slots=slots if state else None)
    storage = build_kv_storage(plan, sizing, "cpu")
    return KVChainPool(storage, prefix_cache=prefix_cache, strategy=strategy,
                       checkpoint_interval=interval if state else None)


def workload(seed, n=40, max_prompt=60, max_output=30, shared=0.5, prefix_len=32, spread=2):
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 10_000, prefix_len) for _ in range(3)]
    out = []
    for i in range(n):
        if rng.random() < shared:
            tail = rng.integers(1, 10_000, int(rng.integers(1, max_prompt)))
            prompt = np.concatenate([prefixes[int(rng.integers(3))], tail])
        else:
            prompt = rng.integers(1, 10_000, int(rng.integers(1, max_prompt + prefix_len)))
        max_new = int(rng.integers(1, max_output + 1))
        out.append(ScheduledRequest(i, int(rng.integers(0, max(1, n // spread))), prompt, max_new,
                              int(rng.integers(1, max_new + 1))))
    return out
