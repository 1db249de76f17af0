"""The engine under random configurations (`support/engine_fuzz.py`): every trial's outputs equal
the same requests served plainly, which `test_engine_matches_transformers` holds to transformers.

A slice of seeds runs in `make test`; `pytest -m sweep` runs 300 more. A failing seed replays
alone: `draw(seed)` is the whole trial."""

from __future__ import annotations

import pytest

from kvchain import faults
from kvchain.errors import BudgetError, InvariantError
from support.engine_fuzz import draw, problems, serve

#: the slice `make test` runs: each family drawn at least once, tight budgets and roomy ones
CI_SEEDS = range(12)
SWEEP_SEEDS = range(1000, 1300)


def _run(seed: int, monkeypatch) -> tuple[object, list[str]]:
    trial = draw(seed)
    for name, value in trial.env.items():
        monkeypatch.setenv(name, value)
    result = serve(trial)
    if isinstance(result, BudgetError):  # a budget below the floor is refused, and says by how much
        assert "floor" in str(result), str(result)
        return trial, []
    return trial, problems(trial, result)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_a_random_configuration_serves_what_the_plain_run_serves(seed, monkeypatch):
    trial, found = _run(seed, monkeypatch)
    assert not found, f"{trial}: {found}"


@pytest.mark.sweep
@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_sweep_random_configurations(seed, monkeypatch):
    trial, found = _run(seed, monkeypatch)
    assert not found, f"{trial}: {found}"


def test_the_campaign_sees_a_lost_page_copy(monkeypatch):
    """COMP-16: with every compaction and relocation copy declared but never landing, the CI slice
    serves wrong tokens (or a check fails) in some trial: the campaign reaches moves that matter."""
    caught = {}
    with faults.injected(faults.LOSE_MOVE_COPY):
        for seed in CI_SEEDS:
            try:
                _trial, found = _run(seed, monkeypatch)
            except InvariantError as exc:  # a check of the pool's that saw the loss
                found = [str(exc)]
            if found:
                caught[seed] = found[0]
                break  # one is the claim
    assert caught, "no trial of the slice noticed copies that never land"
