"""The speculative and state-commit rules on the engine (LIFE-10, LIFE-11, LIFE-12).

A round's post-verify commit runs after its forward's shared-read end, when the write-after-read
barrier has already released the schedule stream: the round's request may have been retracted
and its row handed to a new request by then. The test drives that moment by hand: a round is
launched on a forward stream that starts each kernel late, its request is retracted, the row is
handed out again and the new request's state slot is marked; the commit must leave the mark."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_support import draft_dir, fused_budget

from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.request import ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.engine.serve import Engine, EngineConfig
from support.engine import INTERVAL, PAGE, checkpoint_dir

MARK = 7.25


def retract_during_a_round(late: bool) -> tuple[int, int, float]:
    """Serve one request until a round is in flight, retract it, hand its row to a new request and
    mark that request's state; returns (old row, new row, what the new slot holds afterwards)."""
    family = "qwen3_next"
    cfg = EngineConfig(budget_bytes=fused_budget(family, 4), page_size=PAGE, max_running=4, max_batched_tokens=48,
                       context_len=128, checkpoint_interval=INTERVAL, ignore_eos=True, overlap=True,
                       draft_model_path=str(draft_dir(family)), num_speculative_tokens=3, forward_delay=0.2)
    with Engine(load_checkpoint(checkpoint_dir(family)), cfg) as engine:
        pool = engine.pool
        pool.resolve_commit_slots_late = late
        storage = pool.storage
        req = ScheduledRequest(rid=0, arrival=0, prompt=np.arange(1, 21), max_new=12, output_len=12,
                               output=np.zeros(12, dtype=np.int64))
        scheduler = Scheduler(pool, max_batched_tokens=48, max_running=4)
        scheduler.add([req])
        while not pool.held_back():
            scheduler.step()
        row = req.row
        scheduler._preempt(req)  # the row goes back while the round runs
        # the retracted request's slots (they pend under the round) go to another holder first, as a
        # checkpoint would take them, so the new request's slot is one no wait orders after the round
        held = storage.alloc_state_slots(2)
        new_row = storage.alloc_row()
        storage.alloc_extend(np.array([new_row]), np.array([4]))
        slot = storage.physical_pages(storage.plan.state.name, storage.table.state_slot[[new_row]])
        store = storage.view(storage.plan.state.name).state(0, "ssm")
        index = torch.as_tensor(slot)
        store[index] = MARK  # the new request's state: a slot no in-flight work touches, written at once
        pool.drain()
        storage.device.synchronize()
        value = float(store[index].flatten()[0])
        storage.free_rows(np.array([new_row]))
        storage.free_state_slots(held)
        return row, new_row, value


def test_life10_12_the_commit_after_the_shared_reads_uses_the_slots_of_metadata_time():
    """LIFE-10, LIFE-11, LIFE-12: the commit takes its slots from `ForwardStateSlots`, resolved
    when the round's metadata was prepared, so the row's new owner keeps its state."""
    row, new_row, value = retract_during_a_round(late=False)
    assert new_row == row  # the row does name a new request when the commit runs
    assert value == MARK


@pytest.mark.xfail(strict=True, reason="LIFE-10/LIFE-12: a commit that looks the row's state slot up in "
                   "the request table after the shared-read end writes the retracted round's state into "
                   "the slot of the request that now holds the row")
def test_a_commit_that_rereads_the_request_table_corrupts_the_new_request():
    row, new_row, value = retract_during_a_round(late=True)
    assert new_row == row
    assert value == MARK
