"""A seeded decode-heavy request stream both allocators in a benchmark replay identically."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt: int
    output: int


def decode_heavy(n: int, seed: int, context_len: int) -> list[BenchRequest]:
    """Chat-like lengths: lognormal prompts around 1k tokens, outputs around 300."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(900), 0.6, n), 16, context_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(300), 0.7, n), 8, context_len // 2).astype(int)
    return [BenchRequest(int(p), int(o)) for p, o in zip(prompts, outputs)]
