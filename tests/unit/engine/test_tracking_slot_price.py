"""Admission prices the prefix tree's tracking state slot the pool takes with each request of a
model with recurrent state. The plan alone cannot tell (the engine declares the checkpoint grid on
the pool, not on the plan's state lifetime), so the pool tells its pricing; before, admission and
the memory clip priced one state slot where the pool took two, and a request that fitted the price
but not the take waited forever in an empty pool."""

from __future__ import annotations

import pytest

from kvchain.engine.scheduler import Scheduler
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from support.engine import checkpoint_dir

PROMPT = [196, 242, 105, 173, 202, 254, 71, 20, 138, 70, 16, 12]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_pass_prices_the_state_slots_the_pool_takes(prefix_cache):
    cfg = EngineConfig(budget_bytes=4 << 20, page_size=16, checkpoint_interval=64, prefix_cache=prefix_cache,
                       overlap=False, ignore_eos=True)
    with Engine(str(checkpoint_dir("nemotron_h")), cfg) as engine:
        pool = engine.pool
        assert pool.tracking is prefix_cache
        demand = pool.begin_pass([], frees_coming=False)._demand(len(PROMPT), 1, 0, len(PROMPT))
        assert demand.state_slots == (2 if prefix_cache else 1)
        assert pool._admit_demand(len(PROMPT), 0)[pool.plan.state.index] == demand.state_slots


def test_a_request_the_pool_cannot_take_is_rejected_not_left_waiting(monkeypatch):
    """The budget holds one state slot and a page, not the tracking slot too: the request is
    rejected at arrival with its numbers, where it used to wait forever in the empty pool."""
    monkeypatch.setattr(Scheduler.run, "__defaults__", (500, None))
    cfg = EngineConfig(budget_bytes=792_118, page_size=16, checkpoint_interval=64, max_running=16, overlap=False,
                       prefix_cache=True, ignore_eos=True, inline=True)
    with Engine(str(checkpoint_dir("nemotron_h")), cfg) as engine:
        out = engine.generate([GenerateRequest(PROMPT, 1)]).outputs[0]
    assert out.finish_reason == "rejected" and "state 2 pages" in out.reason
