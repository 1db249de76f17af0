"""A request admitted can always run its speculative round (ADM-3 with the rounds' scratch slots).

The same traffic through one budget twice: once over a plan that prices only each request's running
and tracking state slots (what the engine did before the rounds' k + 1 scratch slots were priced),
once over the engine's plan, which prices them at admission and holds them back for running requests
(`SpeculativePool._reserve`). The first admits more requests at once and then finds no scratch slots
for their rounds, so they decode plainly; the second admits fewer and never falls back."""

from __future__ import annotations

import pytest
from spec_support import draft_dir, fused_budget

import kvchain.engine.speculative_setup as setup
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig
from support.engine import INTERVAL, PAGE, checkpoint_dir, mismatches, workload

FAMILY = "qwen3_next"
N = 6


def serve(monkeypatch, *, price_scratch: bool):
    if not price_scratch:  # the plan as it was: no `speculative_slots` on the target's state lifetime
        plan = setup.plan_with_draft
        monkeypatch.setattr(setup, "plan_with_draft", lambda *a, **kw: plan(*a, **{**kw, "num_speculative_tokens": 0}))
    cfg = EngineConfig(budget_bytes=fused_budget(FAMILY, 3), page_size=PAGE, max_running=8, max_batched_tokens=48,
                       context_len=128, checkpoint_interval=INTERVAL, ignore_eos=True, overlap=True,
                       draft_model_path=str(draft_dir(FAMILY)), num_speculative_tokens=3)
    with Engine(load_checkpoint(checkpoint_dir(FAMILY)), cfg) as engine:
        result = engine.generate(workload(N))
        return result, engine.pool.spec, engine.storage.plan.state


@pytest.fixture(scope="module")
def runs():
    with pytest.MonkeyPatch.context() as mp:
        old = serve(mp, price_scratch=False)
    with pytest.MonkeyPatch.context() as mp:
        new = serve(mp, price_scratch=True)
    return old, new


def test_adm3_a_round_never_falls_back_once_its_scratch_slots_are_priced(runs):
    """ADM-3: priced at admission, the scratch slots are there for every round (no fallback); the
    same budget admits fewer requests at once than the unpriced plan, which falls back."""
    (old, old_spec, old_state), (new, new_spec, new_state) = runs
    assert old_state.lifetime.speculative_slots == 0 and new_state.lifetime.speculative_slots == 4
    assert old_spec.fallbacks > 0  # the unpriced plan admitted rounds it could not hold
    assert new_spec.fallbacks == 0
    assert new.stats.peak_running < old.stats.peak_running
    assert new_spec.rounds > old_spec.rounds  # every decode a round


def test_priced_rounds_stay_plain_greedy_output(runs):
    _old, (new, _spec, _state) = runs
    assert mismatches(new, FAMILY, N) == []
