"""The long CPU sweep of the page-safety stress harness (`pytest -m sweep`, HARN-18)."""

from __future__ import annotations

import pytest

from kvchain.testing.harness import run_case, seed_case

CHUNK = 50


@pytest.mark.sweep
@pytest.mark.parametrize("first", range(0, 1000, CHUNK))
def test_sweep_seeds_pass_every_check(first):
    """HARN-1..12, HARN-18: a thousand seeds of 400 operations, every check after every operation."""
    for seed in range(first, first + CHUNK):
        result = run_case(seed_case(seed, 400))
        assert result.failure is None, f"seed {seed}: {result.failure.describe()}"


@pytest.mark.sweep
@pytest.mark.parametrize("first", range(0, 40, 10))
def test_sweep_long_sequences(first):
    """HARN-1..12: fewer seeds, ten times the operations: state that builds up over long runs."""
    for seed in range(10_000 + first, 10_000 + first + 10):
        result = run_case(seed_case(seed, 4000))
        assert result.failure is None, f"seed {seed}: {result.failure.describe()}"
