"""Network transfer waits across two ranks over torch.distributed (gloo): each rank judges its own
engine, the judgements are MIN-reduced, and both ranks leave (or raise) in the same round."""

from __future__ import annotations

import torch.distributed as dist
import torch.multiprocessing as mp

from kvchain.alloc.signals import NetworkTransfer, NetworkTransferWaiter
from kvchain.device import ModeledDevice
from kvchain.dist import all_ranks_done
from kvchain.errors import TransferTimeoutError


def _rank(rank: int, init: str, stuck_rank: int, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        device = ModeledDevice(seed=rank)
        if rank == stuck_rank:
            device.delay_next("send", 1000.0)
        device.launch(device.stream("network"), None, label="send")
        transfer = NetworkTransfer("send", sends=True, done=device.record(device.stream("network"), "send done"))
        waiter = NetworkTransferWaiter(device, all_ranks_done())
        try:
            waiter.wait([transfer], timeout=50.0)
            results[rank] = "released"
        except TransferTimeoutError as e:
            results[rank] = f"raised: {e}"
    finally:
        dist.destroy_process_group()


def _run(tmp_path, stuck_rank):
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(f"file://{tmp_path}/rendezvous", stuck_rank, results), nprocs=2, join=True)
    return dict(results)


def test_ranks_leave_together_when_every_engine_is_done(tmp_path):
    """PD-3."""
    assert _run(tmp_path, stuck_rank=-1) == {0: "released", 1: "released"}


def test_every_rank_raises_when_one_engine_is_stuck(tmp_path):
    """PD-3, PD-4: rank 1's transfer never finishes: both ranks raise, naming the transfer."""
    results = _run(tmp_path, stuck_rank=1)
    assert set(results) == {0, 1}
    assert all(r.startswith("raised") and "send" in r for r in results.values())
