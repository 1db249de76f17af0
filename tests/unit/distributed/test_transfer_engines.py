"""The PD data plane between two real processes on the loopback interface: page batches of a
registered arena land byte-exact in the peer's arena through NIXL (UCX over TCP) and through the
torch.distributed fallback, and a transfer's state is the engine's own."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from kvchain.dist.pp import StageLink, run_stage_processes
from kvchain.dist.transfer import (
    TransferError,
    TransferState,
    coalesce,
    make_engine,
    nixl_available,
    pair_segments,
)

UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
NIXL_MISSING = nixl_available()
ENGINES = ["gloo", pytest.param("nixl", marks=[pytest.mark.nixl,
                                              pytest.mark.skipif(NIXL_MISSING is not None,
                                                                 reason=str(NIXL_MISSING))])]


def _pages(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A batch of scattered 256-byte pages (source offsets) and where they go on the peer."""
    rng = np.random.default_rng(seed)
    src = sorted(rng.choice(256, 24, replace=False).tolist())
    dst = rng.permutation(np.arange(256))[:24].tolist()
    return [(p * 256, 256) for p in src], [(p * 256, 256) for p in dst]


def _exchange(stage: int, n: int, port: int, kind: str) -> dict:
    link = StageLink.join(stage, n, port, timeout_s=20.0)
    try:
        data = torch.zeros(256 * 256, dtype=torch.uint8)
        if stage == 0:
            data.copy_(torch.randint(0, 256, (data.numel(),), generator=torch.Generator().manual_seed(7),
                                     dtype=torch.uint8))
        engine = make_engine(kind, f"node{stage}")
        engine.register(data)
        descs = link.all_gather(engine.descriptor())
        peer = f"node{1 - stage}"
        engine.connect(peer, descs[1 - stage])
        src, dst = _pages(3)
        link.all_gather("connected")
        t = engine.write(peer, src, dst, "req-1") if stage == 0 else engine.expect(peer, dst, "req-1")
        import time
        deadline = time.monotonic() + 10
        while not engine.poll(t).quiescent and time.monotonic() < deadline:
            time.sleep(0.001)
        link.all_gather("done")
        state = t.state.value
        engine.close()
        return {"state": state, "bytes": data.numpy().tobytes()}
    finally:
        link.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_a_page_batch_lands_byte_exact_in_the_peer(kind):
    """Scattered pages of one arena land in a permuted set of the peer's pages, and nothing else of
    the peer's arena changes."""
    out = run_stage_processes(_exchange, 2, (kind,), timeout_s=40, env=UCX)
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    assert out[0][1]["state"] == out[1][1]["state"] == "done"
    sent = np.frombuffer(out[0][1]["bytes"], np.uint8)
    got = np.frombuffer(out[1][1]["bytes"], np.uint8)
    src, dst = _pages(3)
    want = np.zeros_like(got)
    for (so, n), (do, _n) in zip(src, dst):
        want[do:do + n] = sent[so:so + n]
    assert np.count_nonzero(got) > 0 and np.array_equal(got, want)
    assert not mp.active_children()


def test_segments_pair_at_every_boundary_and_merge_when_adjacent():
    src, dst = pair_segments([(0, 10), (100, 6)], [(50, 4), (60, 12)])
    assert src == [(0, 4), (4, 6), (100, 6)] and dst == [(50, 4), (60, 6), (66, 6)]
    assert coalesce([(0, 4), (4, 4), (16, 4), (20, 0)]) == [(0, 8), (16, 4)]
    with pytest.raises(TransferError):
        pair_segments([(0, 4)], [(0, 5)])


def test_an_engine_refuses_segments_outside_its_registered_bytes():
    engine = make_engine("gloo", "alone")
    with pytest.raises(TransferError, match="no memory registered"):
        engine.expect("peer", [(0, 4)], "t")
    engine.register(torch.zeros(64, dtype=torch.uint8))
    engine.connect("peer", b"\x01" + b"\x00" * 7)
    with pytest.raises(TransferError, match="outside the 64 registered bytes"):
        engine.expect("peer", [(60, 8)], "t")
    assert TransferState.ABORTED.quiescent and not TransferState.PENDING.quiescent


@pytest.mark.nixl
@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL is not usable here: {NIXL_MISSING}")
def test_nixl_logs_go_to_stderr_not_into_a_json_document(capfd):
    """nixl configures its logger onto stdout, where `generate --pd --json` prints its document;
    an agent's start-up lines land on stderr."""
    from kvchain.dist.transfer import NixlEngine

    capfd.readouterr()
    NixlEngine("logs")
    out, err = capfd.readouterr()
    assert "NIXL" not in out and "NIXL" in err, (out, err)
