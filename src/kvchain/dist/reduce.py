"""MIN-reduces that keep tensor-parallel ranks in step.

A host wait for network transfers ends only when every rank that shares the layout judged its own
transfer engine done (PD-3): `all_ranks_done` is the reduce `NetworkTransferWaiter` takes, so every
rank leaves the wait, or raises past its deadline, in the same round (PD-4)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def all_ranks_done(group: dist.ProcessGroup | None = None) -> Callable[[bool], bool]:
    """A reduce of one boolean per rank to their conjunction (MIN), over `group`."""

    def reduce(local_done: bool) -> bool:
        flag = torch.tensor([1 if local_done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return reduce
