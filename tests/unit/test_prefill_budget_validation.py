"""An admission pass refuses requests it cannot decide on, before its tallies change: a length that
is not an integer, a negative output, a request with nothing to prefill (no input, or a cached prefix that reaches
or passes the input) is an `InputError` naming the argument; an input past the pool's context
length is aborted as unschedulable, not admitted into an `alloc_extend` that must fail. The chunk
grid refuses a negative interval and a start past the prompt's end instead of returning a chunk
past the limit or a negative one."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.demand import KVDemand
from kvchain.errors import InputError, KVChainError
from kvchain.prefill_budget import (
    ChainPrefillBudget,
    Decision,
    ProjectedPrefillBudget,
    mamba_prefill_chunk_grid,
)
from support.chains import boundary_storage


@pytest.fixture(scope="module")
def storage():
    return boundary_storage()


def _budgets(storage):
    zero = KVDemand.zero(len(storage.plan.sub_pools))
    return [ChainPrefillBudget(storage, zero, False, checkpoint_interval=64),
            ProjectedPrefillBudget(storage, zero, False, checkpoint_interval=64, chunk_only=True)]


def _tallies(budget, candidate=True):
    """What the pass has counted (and, `candidate`, the request a projected pass last priced)."""
    extra = (list(budget.lengths), list(budget.remaining), budget.held, budget.partial_slots) \
        if isinstance(budget, ProjectedPrefillBudget) else ()
    if candidate and extra:
        extra += (budget._candidate,)
    return budget.admitted, budget.admitted_count, extra


def _refused(budget, args, *words):
    before = _tallies(budget)
    with pytest.raises(InputError) as info:
        budget.consider(*args)
    assert isinstance(info.value, KVChainError)
    text = str(info.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text
    assert _tallies(budget) == before


@pytest.mark.parametrize("kind", [0, 1])
def test_an_input_past_the_context_length_is_aborted_not_admitted(storage, kind):
    budget = _budgets(storage)[kind]
    before = _tallies(budget, candidate=False)
    a = budget.consider(5000, 24, 0, 8192)
    assert a.decision is Decision.ABORT and a.demand is None
    assert "5000" in a.reason and "1024" in a.reason and "context" in a.reason
    assert _tallies(budget, candidate=False) == before
    assert budget.consider(1024, 0, 0, 8192).decision is Decision.ADMIT  # the context itself fits


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize(("args", "words"), [
    ((0, 0, 0, 512), ("input_len", "0")),
    ((-5, 0, 0, 512), ("input_len", "-5")),
    ((10, 0, 20, 512), ("cached_len", "20", "10")),
    ((10, 0, 10, 512), ("cached_len", "10")),
    ((10, 0, -1, 512), ("cached_len", "-1")),
])
def test_a_request_with_nothing_to_prefill_is_refused(storage, kind, args, words):
    _refused(_budgets(storage)[kind], args, *words)


@pytest.mark.parametrize("kind", [0, 1])
def test_a_negative_output_is_refused_by_both_passes(storage, kind):
    """The projected pass prices full attention from the outputs it is told, so a negative one
    would lower every later request's projected peak; it is refused as the plain pass refuses it."""
    _refused(_budgets(storage)[kind], (100, -5, 0, 512), "output_len", "-5")


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("position", [0, 1, 2, 3])
@pytest.mark.parametrize("bad", [10.5, 10.0, True, "10", None])
def test_lengths_must_be_integers(storage, kind, position, bad):
    args = [100, 0, 0, 512]
    args[position] = bad
    name = ("input_len", "output_len", "cached_len", "token_limit")[position]
    _refused(_budgets(storage)[kind], args, name, repr(bad))


@pytest.mark.parametrize("kind", [0, 1])
def test_valid_requests_decide_as_before(storage, kind):
    budget = _budgets(storage)[kind]
    a = budget.consider(np.int64(100), np.int64(8), np.int64(0), np.int64(64))
    assert a.decision is Decision.ADMIT and a.chunk_len == 64
    b = budget.consider(100, 0, 99, 512)
    assert b.decision is Decision.ADMIT and b.chunk_len == 1
    assert budget.consider(200, 0, 0, 10).decision is Decision.WAIT  # the limit misses the grid


def test_chunk_grid_refuses_a_negative_interval_and_a_start_past_the_end():
    with pytest.raises(InputError) as info:
        mamba_prefill_chunk_grid(0, 100, 1000, -64)
    assert "interval" in str(info.value) and "-64" in str(info.value)
    with pytest.raises(InputError) as info:
        mamba_prefill_chunk_grid(2000, 100, 1000, 64)
    assert "start" in str(info.value) and "2000" in str(info.value) and "1000" in str(info.value)
    with pytest.raises(InputError) as info:
        mamba_prefill_chunk_grid(-1, 100, 1000, 64)
    assert "start" in str(info.value)


def test_chunk_grid_is_unchanged_on_valid_arguments():
    assert mamba_prefill_chunk_grid(0, 100, 1000, 64) == 64
    assert mamba_prefill_chunk_grid(1000, 100, 1000, 64) == 0  # nothing left
    assert mamba_prefill_chunk_grid(0, 40, 100, 0) == 40  # 0: no grid
    assert mamba_prefill_chunk_grid(0, 40, 100, None) == 40
    assert mamba_prefill_chunk_grid(10, 0, 100, 16) == 0


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize(("args", "message"), [
    ((0, 0, 0, 512), "a request to admit needs input tokens: input_len 0"),
    ((1, 0, 1, 512), "a request to admit has input left to prefill: cached_len 1 must lie in 0..0 (input_len 1)"),
    ((10, 0, 10, 512), "a request to admit has input left to prefill: cached_len 10 must lie in 0..9 (input_len 10)"),
])
def test_the_refusal_says_which_rule_the_request_breaks(storage, kind, args, message):
    """No input is refused as such (not as a cached prefix out of an empty range); a cached prefix
    that reaches the input is given the range it must lie in, the input's last token excluded."""
    with pytest.raises(InputError) as info:
        _budgets(storage)[kind].consider(*args)
    assert str(info.value) == message


@pytest.mark.parametrize("interval", [None, 0, 64])
@pytest.mark.parametrize("start", [-1, 1001])
def test_chunk_grid_blames_the_start_when_the_interval_is_valid(interval, start):
    """An interval of None or 0 (no grid) is valid: a start outside the prompt is the fault named."""
    with pytest.raises(InputError) as info:
        mamba_prefill_chunk_grid(start, 100, 1000, interval)
    assert str(info.value) == f"a prefill chunk's start {start} lies outside the prompt (0..1000)"
