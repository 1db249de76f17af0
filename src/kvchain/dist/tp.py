"""Tensor-parallel ranks over torch.distributed (gloo on the loopback interface): what one rank
says to the others, and the check that every rank decided the same.

`RankLink` is a rank's link to its group: the MIN-reduce of a value (each rank's budget, so ranks
that share one layout size for the least of them, as engines reduce the device memory they
profiled), an all-gather, every collective bounded by the group's timeout. After each iteration the
ranks all-gather a digest of their decision log (`digest`); a rank whose digest differs fails
`tp.rank_agreement`, which names the first differing decision (`check_rank_agreement`). The ranks
themselves (a shard of the heads each, its own arena and device) run in `sim/tp.py`."""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvariantError, PlanError
from .pp import loopback_env

#: the check a rank whose decisions differ from another rank's fails
RANK_AGREEMENT = "tp.rank_agreement"


class RankLayoutError(PlanError):
    """Ranks that must share one layout were sized to different ones."""


def check_same_layout(layouts: Sequence[dict]) -> None:
    """Refuse ranks whose layouts (`StageGeometry.to_dict()` of each rank's chain) differ: they could
    not run the same operations on the same ids."""
    for rank, layout in enumerate(layouts[1:], start=1):
        if layout != layouts[0]:
            raise RankLayoutError(f"rank {rank}'s layout differs from rank 0's (arena bytes "
                                  f"{layout['arena_bytes']} vs {layouts[0]['arena_bytes']}): ranks that share a "
                                  "layout must size for the same budget")


def digest(entries: Sequence) -> str:
    """A 32-hex-character digest of one iteration's decisions."""
    return hashlib.blake2b(repr(list(entries)).encode(), digest_size=16).hexdigest()


def first_difference(logs: Sequence[Sequence]) -> str | None:
    """The first decision where some rank's log differs from rank 0's, or None."""
    base = logs[0]
    for rank, log in enumerate(logs[1:], start=1):
        for i in range(max(len(base), len(log))):
            mine = log[i] if i < len(log) else "(none)"
            theirs = base[i] if i < len(base) else "(none)"
            if mine != theirs:
                return f"decision {i}: rank 0 {theirs!r}, rank {rank} {mine!r}"
    return None


class RankDivergenceError(InvariantError):
    """A tensor-parallel rank decided differently from another: the collective would deadlock or
    a request's pages would differ across the shards."""

    def __init__(self, message: str) -> None:
        super().__init__(RANK_AGREEMENT, message)


def check_rank_agreement(digests: Sequence[str], iteration: int, logs: Callable[[], Sequence[Sequence]]) -> None:
    """`tp.rank_agreement`: every rank's digest of this iteration is rank 0's; when one differs,
    `logs()` (every rank's log of the iteration) names the first differing decision."""
    if all(d == digests[0] for d in digests):
        return
    ranks = [r for r, d in enumerate(digests) if d != digests[0]]
    where = first_difference(logs()) or "the logs agree, their digests do not"
    raise RankDivergenceError(f"iteration {iteration}: rank {ranks[0]}'s decision digest {digests[ranks[0]]} "
                              f"differs from rank 0's {digests[0]}: {where}")


class RankLink:
    """One rank's link to the other ranks of its tensor-parallel group."""

    def __init__(self, rank: int, n_ranks: int) -> None:
        self.rank = rank
        self.n_ranks = n_ranks

    @classmethod
    def join(cls, rank: int, n_ranks: int, port: int, timeout_s: float = 30.0) -> RankLink:
        """Join the group of `n_ranks` ranks on 127.0.0.1:`port` over gloo; every collective is
        bounded by `timeout_s` (a silent rank makes the others raise, not hang)."""
        os.environ.update(loopback_env(port))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n_ranks,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, n_ranks)

    def min_reduce(self, value: int) -> int:
        """The least `value` of any rank."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.n_ranks
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
