"""The library's own boundary: an `EngineConfig` or a request the engine cannot serve as asked is a
typed refusal up front, never a run that breaks an invariant half-way or silently serves something
else (each case was found by a fuzz of the API)."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.dist.pp_engine import generate_in_stages
from kvchain.dist.tp_pp_engine import generate_in_grid
from kvchain.engine.sampling import SamplingParams
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.errors import InputError, KVChainError
from support.engine import checkpoint_dir


@pytest.mark.parametrize(("field", "value"), [
    ("checkpoint_interval", -4),  # reached the chunk grid, which rounded a chunk past the prompt's end
    ("checkpoint_interval", 0),
    ("context_len", 0),  # was read as "not given"
    ("page_size", 0),
    ("budget_bytes", True),
    ("max_batched_tokens", -1),
    ("host_budget", 0),
    ("num_speculative_tokens", -1),
    ("overlap", "no"),  # flags, a device, a delay, a draft path and a dtype of the wrong type were kept
    ("prefix_cache", None),
    ("device", 3),
    ("forward_delay", float("nan")),
    ("draft_model_path", 3),
    ("dtype", []),  # a TypeError (unhashable)
])
def test_a_config_field_out_of_range_is_refused_where_it_is_made(field, value):
    with pytest.raises(InputError, match=field):
        EngineConfig(**{field: value})


def test_a_step_budget_past_what_any_step_carries_sizes_no_buffer_past_it():
    """`--max-batched-tokens 99999999999999999999` sized the forward's metadata buffers by it (a torch
    overflow traceback; 2**32 asked for 32 GiB): a step carries at most every row's whole context."""
    config = EngineConfig(budget_bytes=4 << 20, page_size=4, max_running=4, context_len=64,
                          max_batched_tokens=10**20)
    with Engine(str(checkpoint_dir("llama")), config) as engine:
        assert engine.pool.buffers.max_tokens <= engine.pool.storage.table.rows * 64
        served = engine.generate([GenerateRequest([1, 2, 3], 2)])
    assert len(served.outputs[0].token_ids) == 2


@pytest.mark.parametrize(("request_", "needle"), [
    (GenerateRequest([1, 2, 3], True), "max_new_tokens"),  # a bool is an int to Python
    (GenerateRequest([1.5, 2.0, 3.0], 2), "token ids must be integers"),  # was cast to 1 and served
    (GenerateRequest([True, False], 2), "token ids must be integers"),
    (GenerateRequest([10**23], 2), "token ids must lie in"),
    (GenerateRequest([], 2), "a prompt needs at least one token id"),  # said "must be integers"
    (GenerateRequest(None, 2), "prompt_token_ids must be a sequence of token ids, not NoneType"),  # a TypeError
    (GenerateRequest("hello", 2), "prompt_token_ids must be a sequence of token ids, not str"),
    (GenerateRequest([1, 2], 2, stop_token_ids=None), "stop_token_ids must be integers"),  # a TypeError
])
def test_a_request_the_model_cannot_take_is_refused(request_, needle):
    config = EngineConfig(budget_bytes=4 << 20, page_size=4)
    with Engine(str(checkpoint_dir("llama")), config) as engine, pytest.raises(InputError, match=needle):
        engine.generate([request_])


def test_requests_are_any_iterable_of_generate_requests_read_once():
    """A generator was read by the sampling check and then found empty: nothing was served, and
    nothing said so. None, a dict or a list of token lists raised a TypeError or an AttributeError."""
    config = EngineConfig(budget_bytes=4 << 20, page_size=4)
    with Engine(str(checkpoint_dir("llama")), config) as engine:
        served = engine.generate(GenerateRequest([1, 2, 3], 2) for _ in range(2))
        assert [len(o.token_ids) for o in served.outputs] == [2, 2]
        for bad, needle in ((None, "not NoneType"), ({"a": 1}, "not dict"), ([[1, 2, 3]], "request 0: a GenerateRequest")):
            with pytest.raises(InputError, match=needle):
                engine.generate(bad)


def test_numpy_integers_are_integers():
    """Counts and stop ids from numpy (a tokenizer's arrays) were refused as "not a positive integer,
    not np.int64(3)"; they serve as the Python ints they are."""
    config = EngineConfig(budget_bytes=4 << 20, page_size=4)
    plain = GenerateRequest([1, 2, 3], 3, stop_token_ids=(5, 6), logprobs=2)
    numpy = GenerateRequest(np.array([1, 2, 3]), np.int64(3), stop_token_ids=np.array([5, 6]), logprobs=np.int32(2))
    with Engine(str(checkpoint_dir("llama")), config) as engine:
        a, b = engine.generate([plain, numpy]).outputs
    assert a.token_ids == b.token_ids and len(b.token_ids) == 3
    assert [[t for t, _lp in x["top"]] for x in a.logprobs] == [[t for t, _lp in x["top"]] for x in b.logprobs]


@pytest.mark.parametrize("run", [
    lambda path, cfg: generate_in_grid(path, cfg, [GenerateRequest([1, 2], 2)], 2, 2, timeout_s=5),
    lambda path, cfg: generate_in_stages(path, cfg, [GenerateRequest([1, 2], 2)], 2, timeout_s=5),
], ids=["grid", "stages"])
def test_split_engines_refuse_a_host_tier_without_its_prefix_cache_before_any_process(run):
    """Ranks on stages and stages keep a host tier (`test_pp_host_tier.py`); one without the prefix
    cache it backs is refused in the parent, before any process starts, as one process refuses it."""
    path = str(checkpoint_dir("llama"))
    with pytest.raises(InputError, match="prefix caching on"):
        run(path, EngineConfig(budget_bytes=4 << 20, page_size=4, host_budget=1 << 20, prefix_cache=False))


def test_a_host_tier_the_engine_cannot_build_is_refused_before_the_checkpoint_loads(tmp_path):
    """The refusal comes first: the path named does not exist, and it is not what the error says."""
    with pytest.raises(InputError, match="prefix_cache"):
        Engine(str(tmp_path / "no-checkpoint"), EngineConfig(host_budget=1 << 20, prefix_cache=False))


def test_an_engine_whose_run_failed_mid_way_says_so_on_every_later_call(monkeypatch):
    """A forward that failed (a temperature of 10**30 once overflowed in it) left the pool with rows
    and forwards in flight; the next generate failed on a launch-order invariant or a None slot.
    Now the engine stops: every later call says why. A request refused before the run leaves it
    serving."""
    config = EngineConfig(budget_bytes=4 << 20, page_size=4)
    with Engine(str(checkpoint_dir("llama")), config) as engine:
        with pytest.raises(InputError):
            engine.generate([GenerateRequest([], 2)])
        assert len(engine.generate([GenerateRequest([1, 2, 3], 2)]).outputs[0].token_ids) == 2
        calls = {"n": 0}
        logits = engine.runner.logits

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("the device lost the forward")
            return logits(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "logits", failing)
        with pytest.raises(KVChainError, match="the device lost the forward"):
            engine.generate([GenerateRequest([1, 2, 3], 6) for _ in range(3)])
        monkeypatch.setattr(engine.runner, "logits", logits)
        for _ in range(2):
            with pytest.raises(KVChainError, match=r"stopped when an earlier generate failed mid-run .*lost the forward"):
                engine.generate([GenerateRequest([1, 2, 3], 2)])


def test_a_temperature_past_a_floats_range_is_refused_and_a_huge_finite_one_samples():
    """10**30 passed the finite check as an int and overflowed in the forward's division."""
    with pytest.raises(InputError, match="temperature must be a finite number"):
        SamplingParams(temperature=10**400)
    assert SamplingParams(temperature=10**30).temperature == 1e30
    config = EngineConfig(budget_bytes=4 << 20, page_size=4)
    with Engine(str(checkpoint_dir("llama")), config) as engine:
        out = engine.generate([GenerateRequest([1, 2, 3], 3, sampling=SamplingParams(temperature=10**30, seed=1))])
    assert len(out.outputs[0].token_ids) == 3
