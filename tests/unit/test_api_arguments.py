"""Every public function refuses a bad argument with a `KVChainError`: one valid call each, then
each argument in turn swapped for a value of the wrong type or range. These escaped as TypeError,
AttributeError, ValueError or OverflowError (a plan that was a dict, a seed of -1, a slack of inf,
a workload name that was a list, a device index past an int64)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import kvchain as K
from kvchain.engine.request import ScheduledRequest
from kvchain.errors import KVChainError

BAD = [None, -1, 0, 1.5, float("nan"), float("inf"), 10**30, "x", "", True, [], [1, -1], {},
       np.int64(-3), np.array([1, 2]), object(), b"x"]


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    spec = K.model_from_preset("qwen3-next-80b")
    plan = K.plan_kv_storage(spec.decls, page_size=64)
    sizing = K.size_plan(plan, 8 << 30, context_len=4096, max_running_requests=8)
    trace = tmp_path_factory.mktemp("api") / "t.jsonl"
    trace.write_text(json.dumps({"input_length": 100, "output_length": 10, "timestamp": 0.0}) + "\n")
    config = trace.parent / "config.json"
    config.write_text(json.dumps({"model_type": "llama"}))
    small = K.small_hybrid(K.MHA(2, 8), (16,))
    cfg = K.PoolConfig(budget_bytes=1 << 20, page_size=4, context_len=256, max_running=4)
    return {
        "size_plan": (K.size_plan, (plan, 8 << 30), dict(context_len=4096, max_running_requests=8)),
        "host_sizing": (K.host_sizing, (plan, 1 << 30, 1), dict(max_groups=None)),
        "plan_stages": (K.plan_stages, (spec.decls, 2), dict(page_size=64)),
        "request_demand": (K.request_demand, (plan, K.DemandPurpose.ADMIT), dict(input_len=100, output_len=10)),
        "mamba_prefill_chunk_grid": (K.mamba_prefill_chunk_grid, (0, 100, 200, 64), {}),
        "workload_from_name": (K.workload_from_name, ("chat", 3, 0), {}),
        "load_trace": (K.load_trace, (str(trace),), dict(ms_per_step=50.0, block_tokens=512, max_new_slack=1.0,
                                                       limit=None, seed=0)),
        "load_config_file": (K.load_config_file, (str(config),), {}),
        "model_from_preset": (K.model_from_preset, ("qwen3-next-80b",), {}),
        "small_hybrid": (K.small_hybrid, (K.MHA(8, 128), (1024,)), dict(blocks=2)),
        "build_kv_storage": (K.build_kv_storage, (plan, sizing, "meta"), {}),
        "compare": (K.compare, (small, cfg, K.workload_from_name("chat", 2, 0, max_len=64)),
                    dict(pools=("kvchain",), jobs=1)),
    }


NAMES = ["size_plan", "host_sizing", "plan_stages", "request_demand", "mamba_prefill_chunk_grid",
         "workload_from_name", "load_trace", "load_config_file", "model_from_preset", "small_hybrid", "build_kv_storage", "compare"]


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_argument_is_a_kvchain_error(name, calls):
    fn, args, kwargs = calls[name]
    fn(*args, **kwargs)  # the valid call this test varies
    escaped = []
    slots = [(True, i) for i in range(len(args))] + [(False, k) for k in kwargs]
    for positional, key in slots:
        for value in BAD:
            a, kw = list(args), dict(kwargs)
            if positional:
                a[key] = value
            else:
                kw[key] = value
            try:
                fn(*a, **kw)
            except KVChainError:
                pass
            except Exception as e:  # what this test looks for
                escaped.append(f"{key}={value!r}: {type(e).__name__}: {e}"[:160])
    assert not escaped, "\n".join(escaped)


@pytest.mark.parametrize("config", ["PoolConfig", "SchedulerConfig"])
def test_a_bad_config_field_is_a_kvchain_error_where_it_is_made_or_used(config):
    """A step-time model that was a float reached `.seconds` (an AttributeError); a host budget or a
    step limit that was a string reached a comparison (a TypeError)."""
    small = K.small_hybrid(K.MHA(2, 8), (16,))
    requests = K.workload_from_name("chat", 2, 0, max_len=64)
    pool = dict(budget_bytes=1 << 20, page_size=4, context_len=256, max_running=4)
    cls = getattr(K, config)

    def use(obj):
        if config == "PoolConfig":
            K.compare(small, obj, requests, pools=("kvchain", "vllm-hybrid", "sglang-static", "ideal"), jobs=1)
        else:
            K.compare(small, K.PoolConfig(**pool), requests, pools=("kvchain",), sched=obj, jobs=1)

    base = pool if config == "PoolConfig" else {}
    use(cls(**base))
    escaped = []
    for f in dataclasses.fields(cls):
        for value in BAD:
            try:
                use(cls(**{**base, f.name: value}))
            except KVChainError:
                pass
            except Exception as e:  # what this test looks for
                escaped.append(f"{f.name}={value!r}: {type(e).__name__}: {e}"[:160])
    assert not escaped, "\n".join(escaped)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("rid", -1, "rid must be an integer >= 0"),  # a SeedSequence ValueError
    ("arrival", 1.5, "arrival must be an integer"),  # was served, a step late
    ("arrival", None, "arrival must be an integer"),  # a TypeError in the sort
    ("prompt", [-1, 2], r"token ids must lie in 0\.\.2147483647"),  # was served
    ("prompt", [2**40], r"token ids must lie in"),  # an OverflowError
    ("prompt", [1.5, 2.5], "integer token ids"),  # was truncated to 1, 2 and served
    ("max_new", 10**12, "above the most a request may hold"),  # a MemoryError
    ("output_len", 6, "past max_new 5"),  # was served, one token past what it asked
    ("priority", None, "priority and follows must be integers"),  # accepted
    ("gap", -1, "gap must be an integer >= 0"),  # accepted
    ("output", [1], "1 output tokens for an output_len of 5"),  # read past its end
])
def test_a_scheduled_request_refuses_a_bad_field_where_it_is_made(field, value, needle):
    fields = dict(rid=0, arrival=0, prompt=np.arange(1, 20), max_new=5, output_len=5)
    with pytest.raises(K.InputError, match=needle):
        ScheduledRequest(**{**fields, field: value})
    ScheduledRequest(**fields)


def test_the_pool_classes_an_engine_builds_on_refuse_a_bad_argument():
    """A policy that was not one, a checkpoint interval that was a string, a step depth that was
    None or a flag that was an array reached the pool's arithmetic (AttributeError, TypeError,
    ValueError), some only once a step ran."""
    decls = K.small_hybrid(K.MHA(2, 8), (16,), state=K.State((K.StateTensor("conv", (6, 3)),)))
    plan = K.plan_kv_storage(decls, page_size=4)
    sizing = K.size_plan(plan, 1 << 21, context_len=256, max_running_requests=4)

    def serve(pool, **scheduler):
        s = K.Scheduler(pool, **scheduler)
        s.add(K.workload_from_name("chat", 3, 0, max_len=64))
        s.run(max_steps=2000)

    cases = {
        "KVChainPool": (lambda **kw: serve(K.KVChainPool(K.build_kv_storage(plan, sizing), **kw)),
                        dict(prefix_cache=True, strategy=K.CheckpointStrategy.EXTRA_BUFFER, checkpoint_interval=None,
                             policy=None)),
        "Scheduler": (lambda **kw: serve(K.KVChainPool(K.build_kv_storage(plan, sizing)), **kw),
                      dict(max_batched_tokens=512, max_running=4, max_wait_steps=None, priority=False)),
        "UnifiedRadixCache": (lambda **kw: K.UnifiedRadixCache(K.build_kv_storage(plan, sizing), **kw),
                              dict(strategy=K.CheckpointStrategy.EXTRA_BUFFER, checkpoint_interval=8)),
        "HostPools": (lambda **kw: K.HostPools(plan, **kw), dict(budget_bytes=1 << 20, pages_per_state=1, pin=None,
                                                             max_groups=None)),
        "StepSequence": (lambda **kw: K.StepSequence(K.build_kv_storage(plan, sizing), **kw),
                         dict(depth=1, war_barrier=True)),
    }
    escaped = []
    for name, (make, base) in cases.items():
        make(**base)
        for key in base:
            for value in BAD:
                try:
                    make(**{**base, key: value})
                except KVChainError:
                    pass
                except Exception as e:  # what this test looks for
                    escaped.append(f"{name} {key}={value!r}: {type(e).__name__}: {e}"[:160])
    assert not escaped, "\n".join(escaped)
