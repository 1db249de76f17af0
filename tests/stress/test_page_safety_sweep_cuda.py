"""The CUDA sweep of the page-safety stress harness (`pytest -m cuda`, HARN-14, HARN-18): real
streams and events, every launched item delayed by a seeded spin; payload, divergence and ledger
checks apply."""

from __future__ import annotations

import pytest
import torch

from kvchain.testing.harness import run_case, seed_case
from kvchain.testing.mutants import applied

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("first", range(0, 16, 4))
def test_cuda_seeds_pass(first):
    """HARN-14: the same operations on real CUDA streams with delayed kernels."""
    for seed in range(first, first + 4):
        result = run_case(seed_case(seed, 200), device="cuda")
        assert result.failure is None, f"seed {seed}: {result.failure.describe()}"


def test_cuda_catches_a_skipped_settle_wait():
    """HARN-14: on real streams a skipped settle wait corrupts payloads the checks see."""
    with applied("skip_settle_wait"):
        caught = [run_case(seed_case(seed, 400), device="cuda").failure for seed in range(16)]
    assert any(f is not None and "lost_write" in f.checks for f in caught)
