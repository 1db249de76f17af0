"""`request_demand` refuses arguments it would otherwise price wrong or fail on with a bare error:
lengths that are not integers (or are bools) or are negative, a negative checkpoint interval
(which would shrink the retained window), a purpose or a window retirement that is not its enum
(a string would be read as EAGER or raise KeyError). Each is an `InputError` naming the argument;
valid arguments price as before."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.demand import DemandPurpose, KVDemand, WindowRetirement, request_demand
from kvchain.errors import InputError, KVChainError
from support.chains import boundary_plan


@pytest.fixture(scope="module")
def plan():
    return boundary_plan()


def _refused(plan, purpose=DemandPurpose.ADMIT, *words, **kwargs):
    kwargs.setdefault("input_len", 1000)
    with pytest.raises(InputError) as info:
        request_demand(plan, purpose, **kwargs)
    assert isinstance(info.value, KVChainError)
    text = str(info.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text


@pytest.mark.parametrize("name", ["input_len", "output_len", "cached_len", "chunk_len", "min_chunk"])
@pytest.mark.parametrize("bad", [10.5, 10.0, True, "10", np.float64(3)])
def test_lengths_must_be_integers_not_bools(plan, name, bad):
    _refused(plan, DemandPurpose.ADMIT, name, repr(bad), **{name: bad})


@pytest.mark.parametrize("name", ["chunk_len", "min_chunk"])
def test_lengths_must_not_be_negative(plan, name):
    _refused(plan, DemandPurpose.ADMIT, name, "-50", **{name: -50})


@pytest.mark.parametrize("bad", [-64, -1, 64.0, True, "64"])
def test_a_checkpoint_interval_must_be_a_whole_number_not_below_zero(plan, bad):
    _refused(plan, DemandPurpose.ADMIT, "checkpoint_interval", repr(bad), checkpoint_interval=bad,
             shares_prefixes=True)


def test_a_negative_interval_no_longer_under_prices_the_window(plan):
    """The audit's case: -64 took 64 rows off the retained window; 64 adds them, None adds none."""
    w = [p.name for p in plan.sub_pools].index("window128")
    kw = {"input_len": 1000, "chunk_len": 64, "shares_prefixes": True}
    with_grid = request_demand(plan, DemandPurpose.ADMIT, checkpoint_interval=64, **kw)
    without = request_demand(plan, DemandPurpose.ADMIT, **kw)
    assert (with_grid.pages[w], without.pages[w]) == (17, 13)  # span(128 + 64 + 64), span(128 + 64)
    _refused(plan, DemandPurpose.ADMIT, "checkpoint_interval", checkpoint_interval=-64, **kw)


@pytest.mark.parametrize("bad", ["never", "eager", None, 1])
def test_window_retirement_must_be_the_enum(plan, bad):
    _refused(plan, DemandPurpose.ADMIT, "window_retirement", repr(bad), window_retirement=bad)


@pytest.mark.parametrize("bad", ["admit", "ceiling", None, 0])
def test_purpose_must_be_the_enum(plan, bad):
    _refused(plan, bad, "purpose", repr(bad))


def test_valid_arguments_price_as_before(plan):
    """Numpy integers count as integers; an interval of None or 0 means no grid; a zero min_chunk
    is clamped to one token."""
    base = request_demand(plan, DemandPurpose.ADMIT, input_len=1000, output_len=200, cached_len=160, chunk_len=64)
    same = request_demand(plan, DemandPurpose.ADMIT, input_len=np.int64(1000), output_len=np.int32(200),
                          cached_len=np.int64(160), chunk_len=np.int64(64))
    assert same == base
    none = request_demand(plan, DemandPurpose.CEILING, input_len=1000, shares_prefixes=True)
    assert request_demand(plan, DemandPurpose.CEILING, input_len=1000, shares_prefixes=True,
                          checkpoint_interval=0) == none
    assert request_demand(plan, DemandPurpose.CEILING, input_len=1000, min_chunk=0) == \
        request_demand(plan, DemandPurpose.CEILING, input_len=1000, min_chunk=1)
    never = request_demand(plan, DemandPurpose.DECODE_PREALLOC, input_len=1000, output_len=200,
                           window_retirement=WindowRetirement.NEVER)
    assert never == KVDemand((1, 75, 75), 75, 1)
    assert request_demand(plan, DemandPurpose.ADMIT, input_len=0) == KVDemand((1, 0, 0), 0, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(chunk_len=-1), "request_demand chunk_len must not be negative, got -1"),
    (dict(min_chunk=-2), "request_demand min_chunk must not be negative, got -2"),
    (dict(checkpoint_interval=-64),
     "request_demand checkpoint_interval must not be negative, got -64 (None or 0: no checkpoint grid)"),
])
def test_a_negative_argument_is_refused_by_name_and_value_and_only_the_interval_says_how_to_turn_it_off(
        plan, kwargs, message):
    """The message names the argument and its value; only a negative interval adds that None or 0
    means no checkpoint grid (a length has no such setting)."""
    with pytest.raises(InputError) as info:
        request_demand(plan, DemandPurpose.ADMIT, input_len=1000, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(chunk_len=0, min_chunk=-1), "request_demand min_chunk must not be negative, got -1"),
    (dict(chunk_len=0, min_chunk=0, checkpoint_interval=-5),
     "request_demand checkpoint_interval must not be negative, got -5 (None or 0: no checkpoint grid)"),
])
def test_a_zero_before_the_negative_argument_is_not_blamed(plan, kwargs, message):
    """0 is a valid chunk_len and min_chunk: the argument named is the one below zero."""
    with pytest.raises(InputError) as info:
        request_demand(plan, DemandPurpose.ADMIT, input_len=1000, **kwargs)
    assert str(info.value) == message
