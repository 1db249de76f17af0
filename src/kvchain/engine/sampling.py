"""Sampling a step's next tokens: greedy, or temperature, top-k and top-p with a seed per request.

The logits are warped as transformers' `generate` warps them (`TemperatureLogitsWarper`, then
`TopKLogitsWarper`, then `TopPLogitsWarper`, each keeping at least one token), and the token is
drawn from their softmax. Each draw is seeded by its request's seed and the output's index
(`draw_seed`), never by a generator that runs along with the engine: the token a request samples at
output j depends on its logits there and nothing else, so a request samples the same under any
batching, overlap, preemption and recompute, on one process, tensor-parallel ranks, pipeline
stages or a prefill and a decode node. A request without a seed is given one when it is submitted
(`with_seeds`), once, by the process that hands it to the others."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..units import is_finite_number, is_integer

#: seeds are non-negative integers below this (what `torch.Generator.manual_seed` takes)
SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: `temperature` 0 is greedy (the rest is then ignored); `top_k` 0
    and `top_p` 1.0 keep every token; `seed` None is drawn at submission."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not is_finite_number(t) or t < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0: greedy), not {t!r}")
        # a float: an integer past what torch converts (10**30) would overflow in the forward
        object.__setattr__(self, "temperature", float(t))
        if not is_integer(k) or k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0: off), not {k!r}")
        if not is_finite_number(p) or not 0 < p <= 1:
            raise InputError(f"top_p must lie in (0, 1] (1: off), not {p!r}")
        if seed is not None and (not is_integer(seed) or not 0 <= seed < SEED_LIMIT):
            raise InputError(f"seed must be an integer in [0, 2**63), not {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


GREEDY = SamplingParams()


def drawn(params: SamplingParams | None) -> bool:
    """Whether a request with sampling `params` (None: greedy) draws its tokens."""
    return params is not None and not params.greedy


def with_seeds(params: Sequence[SamplingParams | None]) -> list[SamplingParams]:
    """Each request's sampling, a sampled one without a seed given a fresh one (greedy stays)."""
    out = []
    for p in params:
        p = GREEDY if p is None else p
        if not p.greedy and p.seed is None:
            p = dataclasses.replace(p, seed=secrets.randbelow(SEED_LIMIT))
        out.append(p)
    return out


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of output `index` of a request seeded `seed`: a hash of both."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits `[V]` as transformers' warpers leave it: divided by the temperature, then
    every token below the k-th largest score set to -inf, then the least likely tokens whose
    probabilities sum to at most `1 - top_p` (at least one token is always kept)."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False  # the most likely token stays
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return scores


def sample_rows(logits: torch.Tensor, draws: Sequence[tuple[int, SamplingParams, int]]) -> torch.Tensor:
    """The tokens of `logits` `[n, V]`: greedy for every row, then each row of `draws` (row,
    sampling, output index) drawn from its warped softmax with its own seeded generator."""
    tokens = logits.argmax(-1)
    for row, params, index in draws:
        probs = warp(logits[row], params).softmax(-1)
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(draw_seed(params.seed, index))
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens
