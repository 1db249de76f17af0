"""`build_kv_storage` refuses, before allocating, a sizing made for another plan (same sub-pool names,
other page bytes or page size), arguments of the wrong type, a device torch cannot allocate on, and
a sizing whose allocator id arrays would not fit; each as one `KVChainError` naming what was passed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvchain.build as build_module
from kvchain.build import MAX_BAND_PAGES, build_kv_storage
from kvchain.decl import MHA, State, StateTensor
from kvchain.device.immediate import ImmediateDevice
from kvchain.errors import BudgetError, InputError, KVChainError
from kvchain.models.small import small_hybrid
from kvchain.plan import plan_kv_storage
from kvchain.sizing import size_plan

STATE = State([StateTensor("conv", (4, 64), "bfloat16"), StateTensor("ssm", (8, 64), "float32")])
KW = dict(context_len=1024, max_running_requests=4)
BUDGET = 64 * 2**20


FULL = MHA(2, 64)


def _plan(full=FULL, page_size=16, state=STATE):
    return plan_kv_storage(small_hybrid(full, (128,), state=state), page_size=page_size)


PLAN = _plan()
SIZING = size_plan(PLAN, BUDGET, **KW)


@pytest.mark.parametrize(("other", "needle"), [
    (_plan(full=MHA(8, 64)), "'window128'"),
    (_plan(page_size=32), "page size 16"),
    (_plan(state=State([StateTensor("conv", (4, 64), "bfloat16"), StateTensor("ssm", (8, 128), "float32")])),
     "'state'"),
    (_plan(full=MHA(2, 64, dtype="float32")), "units of 512"),
])
def test_a_sizing_made_for_another_plan_with_the_same_sub_pools_is_refused(other, needle):
    assert [p.name for p in other.sub_pools] == [p.name for p in PLAN.sub_pools]
    with pytest.raises(InputError, match="sizing") as e:
        build_kv_storage(other, SIZING, "meta")
    assert needle in str(e.value) and "\n" not in str(e.value)
    build_kv_storage(other, size_plan(other, BUDGET, **KW), "meta")  # its own sizing builds


def test_a_sizing_of_an_equal_plan_builds():
    storage = build_kv_storage(_plan(), SIZING, "meta")
    assert storage.sizing is SIZING


@pytest.mark.parametrize("sizing", [None, "sizing", SIZING.to_dict()])
def test_a_sizing_that_is_not_a_plan_sizing_is_refused(sizing):
    with pytest.raises(InputError, match="sizing"):
        build_kv_storage(PLAN, sizing, "meta")


@pytest.mark.parametrize("plan", [None, PLAN.to_dict()])
def test_a_plan_that_is_not_a_plan_is_refused(plan):
    with pytest.raises(InputError, match="plan"):
        build_kv_storage(plan, SIZING, "meta")


@pytest.mark.parametrize("backend", ["x", "cuda", ImmediateDevice])
def test_a_backend_that_is_not_a_device_is_refused(backend):
    with pytest.raises(InputError, match="backend"):
        build_kv_storage(PLAN, SIZING, "meta", backend=backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_a_device_torch_cannot_allocate_on_is_an_input_error(device):
    with pytest.raises(InputError, match="device") as e:
        build_kv_storage(PLAN, SIZING, device)
    assert repr(device) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("device", ["nonsense", 3.5])
def test_a_device_torch_does_not_name_is_still_an_input_error(device):
    with pytest.raises(InputError, match="device"):
        build_kv_storage(PLAN, SIZING, device)


def test_a_sizing_whose_id_arrays_would_not_fit_is_refused_before_allocating(monkeypatch):
    huge = size_plan(PLAN, 2**50, **KW)

    def no_arena(*args, **kwargs):
        raise AssertionError("allocated before refusing")

    monkeypatch.setattr(build_module, "KVArena", no_arena)
    with pytest.raises(BudgetError, match=f"at most {MAX_BAND_PAGES:,}") as e:
        build_kv_storage(PLAN, huge, "meta")
    assert "'state'" in str(e.value) and "\n" not in str(e.value) and isinstance(e.value, KVChainError)


def test_the_largest_budget_the_message_names_is_the_limit(monkeypatch):
    monkeypatch.setattr(build_module, "KVArena", None)  # refused before the arena, or a TypeError here
    state = PLAN.state
    pages = MAX_BAND_PAGES + 1
    huge = size_plan(PLAN, pages * state.page_bytes + SIZING.fixed.total + 2**20, **KW)
    with pytest.raises(BudgetError) as e:
        build_kv_storage(PLAN, huge, "meta")
    most = int(str(e.value).split("a budget of at most ")[1].split(" ")[0].replace(",", ""))
    assert size_plan(PLAN, most, **KW).arena_bytes // state.page_bytes <= MAX_BAND_PAGES
    assert size_plan(PLAN, most + 1, **KW).arena_bytes // state.page_bytes > MAX_BAND_PAGES


def test_an_allocator_the_host_cannot_hold_is_a_budget_error(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 410. GiB for an array with shape (439804650897,)")

    monkeypatch.setattr(build_module, "ChainAllocator", out_of_memory)
    with pytest.raises(BudgetError, match="host memory"):
        build_kv_storage(PLAN, SIZING, "meta")


def test_numpy_sized_plans_build_as_before():
    sized = size_plan(PLAN, np.int64(BUDGET), context_len=np.int64(1024), max_running_requests=np.int64(4))
    assert build_kv_storage(PLAN, sized, "meta").sizing.to_dict() == SIZING.to_dict()
