"""The fast slice of the page-safety stress harness that runs with the normal suite (HARN-18)."""

from __future__ import annotations

import pytest

from kvchain.testing.harness import run_case, seed_case

CHUNK = 8


@pytest.mark.parametrize("first", range(0, 48, CHUNK))
def test_seeds_pass_every_check(first):
    """HARN-1..12, HARN-18: a few dozen seeds of 400 operations on two modeled ranks, every check
    after every operation: no lost write, no unordered overlap, no host read after a wait, no rank
    divergence, no FP32 state bytes in an attention read, no ledger record at quiescence."""
    for seed in range(first, first + CHUNK):
        result = run_case(seed_case(seed, 400))
        assert result.failure is None, f"seed {seed}: {result.failure.describe()}"


def test_seeds_pass_on_real_threads():
    """HARN-14's CPU counterpart: the same operations on worker threads (payload, divergence, ledger)."""
    for seed in range(2):
        result = run_case(seed_case(seed, 200), device="threads")
        assert result.failure is None, f"seed {seed}: {result.failure.describe()}"
