"""Sizing refuses meaningless arguments as one `InputError` naming the argument: a budget, context
length, request count or slot count that is not an integer (a bool or a float included), a state
share that is not a number, no plan; a budget just below the floor names both byte counts exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvchain.errors import BudgetError, InputError, KVChainError
from kvchain.sizing import check_bs1_floor, size_plan, size_stages
from support.chains import boundary_plan

PLAN = boundary_plan()
BUDGET = 64 * 2**20
KW = dict(context_len=1024, max_running_requests=4)


@pytest.mark.parametrize(("name", "value"), [
    ("budget_bytes", BUDGET + 0.5),
    ("budget_bytes", float(BUDGET)),
    ("budget_bytes", True),
    ("budget_bytes", "64MiB"),
    ("budget_bytes", None),
    ("context_len", True),
    ("context_len", 1024.0),
    ("context_len", "1024"),
    ("max_running_requests", True),
    ("max_running_requests", 4.0),
    ("state_slots", 2.5),
    ("state_slots", True),
    ("state_slots", "2"),
    ("state_share", "0.5"),
    ("state_share", [0.5]),
    ("state_share", True),
    ("state_share", float("nan")),
])
def test_size_plan_refuses_an_argument_of_the_wrong_type(name, value):
    args = dict(budget_bytes=BUDGET, **KW)
    args[name] = value
    budget = args.pop("budget_bytes")
    with pytest.raises(InputError, match=name) as e:
        size_plan(PLAN, budget, **args)
    assert isinstance(e.value, KVChainError) and repr(value) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("args", "name"), [
    ((BUDGET, 0, 4), "context_len"),
    ((BUDGET, -5, 4), "context_len"),
    ((BUDGET, True, 4), "context_len"),
    ((BUDGET, 1024.5, 4), "context_len"),
    ((BUDGET, 1024, 0), "max_running_requests"),
    ((BUDGET, 1024, -1), "max_running_requests"),
    ((BUDGET, 1024, False), "max_running_requests"),
    (("1", 1024, 4), "budget_bytes"),
    ((1.5, 1024, 4), "budget_bytes"),
    ((True, 1024, 4), "budget_bytes"),
])
def test_check_bs1_floor_refuses_what_size_plan_refuses(args, name):
    with pytest.raises(InputError, match=name):
        check_bs1_floor(PLAN, *args)


@pytest.mark.parametrize("plan", [None, "plan", [PLAN]])
def test_sizing_needs_a_plan(plan):
    with pytest.raises(InputError, match="plan"):
        size_plan(plan, BUDGET, **KW)
    with pytest.raises(InputError, match="plan"):
        check_bs1_floor(plan, BUDGET, 1024, 4)


def test_numpy_integers_size_as_their_ints():
    sized = size_plan(PLAN, np.int64(BUDGET), context_len=np.int64(1024), max_running_requests=np.int32(4),
                      state_slots=np.int64(4))
    assert sized == size_plan(PLAN, BUDGET, **KW, state_slots=4)
    assert all(type(v) is int for v in (sized.budget_bytes, sized.context_len, sized.max_running_requests,
                                        sized.state_slots))
    json.dumps(sized.to_dict())
    share = size_plan(PLAN, BUDGET, **KW, state_share=np.float64(0.25))
    assert share == size_plan(PLAN, BUDGET, **KW, state_share=0.25)
    assert check_bs1_floor(PLAN, np.int64(BUDGET), np.int64(1024), np.int64(4)) == check_bs1_floor(PLAN, BUDGET, 1024, 4)


def test_a_budget_one_byte_below_the_floor_names_both_byte_counts():
    floor = check_bs1_floor(PLAN, BUDGET, 1024, 4).total
    with pytest.raises(BudgetError) as e:
        size_plan(PLAN, floor - 1, **KW)
    message = str(e.value)
    assert f"budget {floor - 1:,} bytes is below the batch-size-1 floor of {floor:,} bytes" in message
    check_bs1_floor(PLAN, floor, 1024, 4)  # the floor itself is enough


def test_a_budget_far_below_the_floor_keeps_binary_units():
    with pytest.raises(BudgetError, match=r"budget 1\.00 KiB is below the batch-size-1 floor of 646\.83 KiB"):
        check_bs1_floor(PLAN, 1024, 1024, 4)


def test_size_stages_of_no_plans_is_an_input_error():
    with pytest.raises(InputError, match="plans"):
        size_stages([], BUDGET, **KW)
    assert size_stages([PLAN], BUDGET, **KW).concurrency == size_plan(PLAN, BUDGET, **KW).concurrency
