"""Helpers for driving a storage on a ModeledDevice by hand: open, record and process forwards."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.signals import NetworkTransfer
from kvchain.device import ModeledDevice
from kvchain.engine import Forward, StepSequence
from kvchain.testing.overlap import overlap_storage


def modeled_storage(seed: int = 0, **kwargs):
    device = ModeledDevice(seed=seed, durations={"forward": 10.0})
    storage = overlap_storage(device, **kwargs)
    return storage, device


def launch_forward(storage, rows=None, vtok=None, writes_known=True, label=None, shared_read_end=False):
    """Launch a forward that writes the given virtual tokens, through the step sequence's launch
    without its barrier (a test applies that itself); returns its launch record, which `process`
    takes in whatever order the test wants. With `shared_read_end` the forward declares the end of
    its shared reads (`record.shared_read_done`, a second kernel runs after it), which the barrier
    then waits instead of the whole forward stream (LIFE-4, LIFE-5)."""
    device = storage.device
    writes = None
    if writes_known:
        writes = storage.iteration_ids(np.asarray(vtok if vtok is not None else [], dtype=np.int64), rows)

    def reads(step: int) -> None:
        device.launch(device.forward_stream, None, label=label or f"forward:{step}")

    def rest(step: int) -> None:
        device.launch(device.forward_stream, None, label=f"{label or f'forward:{step}'}:write")

    forward = Forward(reads, rest if shared_read_end else None, ids=writes)
    return StepSequence(storage, war_barrier=False).launch(forward, None).record


def process(storage, record):
    storage.device.host_wait(record.event)
    storage.forward_processed(record)


def request(storage, length):
    row = storage.alloc_row()
    vtok = storage.alloc_extend(np.array([row]), np.array([length]))
    return row, vtok


def full_pages(storage, row):
    """The physical full-attention pages `row` holds now."""
    return storage.physical_pages("full", storage.table.pages_of(row))


def network_transfer(device, name="send", sends=True):
    """A PD transfer on the network stream, done at the event `{name} done`: a send reads its pages,
    a receive (`sends=False`) writes them."""
    return NetworkTransfer(name, sends=sends, done=device.record(device.stream("network"), f"{name} done"))
