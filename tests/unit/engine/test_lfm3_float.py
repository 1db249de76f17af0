"""LFM3 in the engine: the one family whose chain has a float band. Its short-conv layers keep
state, its sliding layers a window, its full layers the ids, so the plan is state, window, full and
the window band sits between the chain's two ends. Served under the tight budget, the allocator must
relocate that float (`ChainAllocator._relocate`) while the requests still match transformers."""

from __future__ import annotations

import numpy as np
import torch

from kvchain.engine.batch import ForwardBatch
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.shortconv import tap_rows
from kvchain.plan import Placement, PoolKind, plan_kv_storage
from support.engine import PAGE, checkpoint_dir, logit_error, mismatches, serve

N = 12


def _plan():
    return plan_kv_storage(load_checkpoint(checkpoint_dir("lfm3")).model_spec().decls, page_size=PAGE)


def test_lfm3_plans_a_float_window_band():
    plan = _plan()
    kinds = [p.kind for p in plan.sub_pools]
    assert kinds == [PoolKind.STATE, PoolKind.WINDOW, PoolKind.FULL]
    window = plan.sub_pools[1]
    assert window.placement is Placement.FLOAT
    assert window is not plan.sub_pools[0] and window is not plan.sub_pools[-1]  # neither chain end


def test_lfm3_float_band_is_relocated_under_a_tight_budget():
    result = serve("lfm3", N, poison=True)
    assert mismatches(result, "lfm3", N) == []
    assert logit_error(result, "lfm3", N) < 1e-4
    print(f"float relocations: {result.stats.float_relocations}")
    assert result.stats.float_relocations > 0
    assert result.stats.checkpoints > 0 and result.stats.cached_tokens > 0


def test_lfm3_window_rows_retire_without_the_prefix_cache():
    """With the prefix cache every state checkpoint hands its prefix (window rows included) to the
    tree; without it the rows retire their own window pages behind the decodes."""
    result = serve("lfm3", N, poison=True, prefix_cache=False)
    assert mismatches(result, "lfm3", N) == []
    assert result.stats.window_pages_retired > 0


def test_tap_rows_read_the_saved_window_then_the_new_inputs():
    # two requests: 3 new tokens, then 1 (a decode); kernel 3 keeps 2 inputs per request
    batch = ForwardBatch(q_starts=np.array([0, 3, 4]), prefix_lens=np.array([5, 9]), seq_lens=np.array([8, 10]),
                         page_size=PAGE, views={}, layer_pool={}, state_slots=torch.tensor([0, 1]))
    taps, tails = tap_rows(batch, 3)
    # rows 0-1: request 0's window, 2-3: request 1's, 4-6: request 0's new inputs, 7: request 1's
    assert taps.tolist() == [[0, 1, 4], [1, 4, 5], [4, 5, 6], [2, 3, 7]]
    assert tails.tolist() == [[5, 6], [3, 7]]
