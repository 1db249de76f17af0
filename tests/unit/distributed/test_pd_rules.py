"""PD rules that need no second process: the decode node's preallocation check and the protocol's
timeouts against the host wait's deadline."""

from __future__ import annotations

import numpy as np

from kvchain import env
from kvchain.dist.pd import PROTOCOL_TIMEOUTS, DecodePreallocQueue
from support.chains import small_storage


def test_the_preallocation_check_charges_what_pending_work_holds_back():
    """ADM-13: a request whose lifetime demand fits the decode node's free room alone is refused
    once a request the node already took still has its output to grow into that room; it fits
    again once that request is done."""
    storage = small_storage(page_size=4, chain_kib=12, windows=(8,), context=256, rows=8)
    queue = DecodePreallocQueue(storage)
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([16]))
    chain = storage.allocator
    fits_alone = [n for n in range(8, 256, 4) if chain.admits(queue.demand(n, 16))]
    seq = fits_alone[-1]
    assert queue.prealloc_fits(seq, 16)
    queue.took("running", 16, 160)  # its 160 output tokens are still to come
    assert chain.admits(queue.demand(seq, 16)) and not queue.prealloc_fits(seq, 16)
    queue.grew("running", 16, 0)
    assert queue.prealloc_fits(seq, 16)
    queue.took("running", 16, 160)
    queue.done("running")
    assert queue.prealloc_fits(seq, 16)


def test_the_host_wait_outlasts_the_protocols_own_timeouts():
    """PD-5: the default deadline of a host wait for transfers is longer than the handshake, a
    transfer's wait and a fence together, so the protocol's own timeouts fire first."""
    default = float(env.VARIABLES["KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT"].default)
    assert default > sum(PROTOCOL_TIMEOUTS.values())


def test_a_peer_is_known_gone_only_when_its_process_is():
    """LIM-1, LIM-2: a dead peer's pages go once its process is known gone, and only then: a peer
    whose process runs, or one on another machine, is never taken for gone."""
    import multiprocessing as mp
    import os
    import socket

    from kvchain.dist.pd_link import PDLink

    def link(pid: int, host: str) -> PDLink:
        return PDLink(0, {"pid": pid, "host": host}, socket.socket(), timeout_s=1.0)

    assert not link(os.getpid(), socket.gethostname()).peer_gone(wait_s=0.05)
    assert not link(1, "another-machine").peer_gone(wait_s=0.05)
    child = mp.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join()
    assert link(child.pid, socket.gethostname()).peer_gone(wait_s=0.05)
