"""`NetworkTransferWaiter` on one rank: a host wait releases the transfers it waited, and past the
deadline it raises naming the transfers still in flight (the two-rank round is in tests/unit/distributed)."""

from __future__ import annotations

import pytest

from kvchain import faults
from kvchain.alloc.signals import NetworkTransfer, NetworkTransferWaiter
from kvchain.device import ModeledDevice
from kvchain.errors import TransferTimeoutError


def _send(device: ModeledDevice, delay: float = 0.0) -> NetworkTransfer:
    if delay:
        device.delay_next("send", delay)
    device.launch(device.stream("network"), None, label="send")
    return NetworkTransfer("send", sends=True, done=device.record(device.stream("network"), "send done"))


def test_a_wait_releases_what_it_waited_and_skips_what_is_released():
    device = ModeledDevice(seed=0)
    transfer = _send(device)
    waiter = NetworkTransferWaiter(device)
    waits = device.counters.host_waits
    waiter.wait([transfer], timeout=50.0)
    assert transfer.released and device.query(transfer.done) and device.counters.host_waits > waits
    waits = device.counters.host_waits
    waiter.wait([transfer], timeout=50.0)  # already released: no host wait
    assert device.counters.host_waits == waits


def test_past_the_deadline_the_wait_raises_naming_the_transfer():
    device = ModeledDevice(seed=0)
    transfer = _send(device, delay=1000.0)
    with pytest.raises(TransferTimeoutError, match="send"):
        NetworkTransferWaiter(device).wait([transfer], timeout=50.0)
    assert not transfer.released


def test_the_release_network_early_fault_releases_without_waiting():
    """The fault point `release_network_early` (its mutant's fault): released, yet never waited."""
    device = ModeledDevice(seed=0)
    transfer = _send(device, delay=1000.0)
    with faults.injected(faults.RELEASE_NETWORK_EARLY):
        NetworkTransferWaiter(device).wait([transfer], timeout=50.0)
    assert transfer.released and not device.query(transfer.done)
