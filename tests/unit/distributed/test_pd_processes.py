"""A prefill process hands a hybrid request to a decode process over loopback: full-attention pages,
the window rows decode keeps and the state slot land byte-exact in the decode node's own arena,
through NIXL (UCX over TCP) and the torch.distributed fallback; and what failures release."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import numpy as np
import pytest

from kvchain.dist.pd import DecodeNode, PrefillNode, layout_digest, request_pages
from kvchain.dist.pd_auth import PDListener
from kvchain.dist.pd_link import PDLink, hello
from kvchain.dist.pp import run_stage_processes
from kvchain.dist.transfer import make_engine, nixl_available
from support.chains import small_storage

SECRET = b"a deployment's shared secret"
ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}
NIXL_MISSING = nixl_available()
NIXL = pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(NIXL_MISSING is not None,
                                                                         reason=str(NIXL_MISSING))])
ENGINES = ["gloo", NIXL]
SEQ = 37


def make_storage(chain_kib: int, backend=None):
    return small_storage(page_size=4, chain_kib=chain_kib, windows=(8,), context=128, rows=8, backend=backend)


def _band(storage, name):
    return storage.arena.page_bytes_view(storage.plan.by_name(name).index)


def fill(storage, row: int, seed: int) -> None:
    """Random bytes in every page the row would send."""
    rng = np.random.default_rng(seed)
    for name, ids in request_pages(storage, row).items():
        view = _band(storage, name)
        for p in ids:
            view[int(p)] = __import__("torch").from_numpy(rng.integers(0, 256, view.shape[1], dtype=np.uint8))


def digests(storage, row: int) -> dict[str, str]:
    """Per sub-pool, a digest of the row's pages' bytes in order."""
    out = {}
    for name, ids in request_pages(storage, row).items():
        view = _band(storage, name)
        out[name] = hashlib.sha256(b"".join(view[int(p)].numpy().tobytes() for p in ids)).hexdigest()
    return out


def prefill_node(port: int, kind: str, chain_kib: int = 24, **kw):
    storage = make_storage(chain_kib)
    engine = make_engine(kind, "prefill")
    engine.register(storage.arena.data)
    listener = PDListener(SECRET, port=port)
    link = PDLink.accept(listener, hello(engine.descriptor(), layout_digest(storage)), timeout_s=20,
                         group_timeout_s=20)
    listener.close()
    return PrefillNode(storage, link, engine, **kw)


def decode_node(port: int, kind: str, chain_kib: int = 32, backend=None, **kw):
    storage = make_storage(chain_kib, backend)
    engine = make_engine(kind, "decode")
    engine.register(storage.arena.data)
    link = PDLink.connect(SECRET, "127.0.0.1", port, hello(engine.descriptor(), layout_digest(storage)),
                          timeout_s=20, group_timeout_s=20)
    return DecodeNode(storage, link, engine, **kw)


def prefilled(storage, seq: int = SEQ, seed: int = 1) -> int:
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([seq]))
    storage.advance(np.array([row]))
    fill(storage, row, seed)
    return row


def _hand_off(stage: int, n: int, port: int, kind: str) -> dict:
    if stage == 0:
        node = prefill_node(port, kind)
        storage = node.storage
        filler = prefilled(storage, 9, seed=5)  # the request's pages do not start at the band's base
        row = prefilled(storage)
        sent = digests(storage, row)
        counts = {storage.plan.by_name(k).kind.value: len(v) for k, v in request_pages(storage, row).items()}
        assert node.hand_off("r1", row, {"output_len": 4})
        storage.free_rows(np.array([filler]))
        storage.check_idle()
        node.close()
        return {"sent": sent, "counts": counts}
    node = decode_node(port, kind)
    got = node.receive()
    out = {"got": digests(node.storage, got.row), "seq": node.storage.seq_len(got.row), "extra": got.extra}
    node.finish(got)
    out["idle"] = node.check_idle()
    node.close()
    return out


@pytest.mark.parametrize("kind", ENGINES)
def test_every_sub_pool_of_a_hybrid_request_lands_byte_exact(kind):
    """Full-attention pages, the window rows decode keeps (fewer than the request's pages) and the
    state slot reach the decode node's arena byte for byte; both nodes idle clean."""
    out = run_stage_processes(_hand_off, 2, (kind,), timeout_s=60, env=ENV)
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    pre, dec = out[0][1], out[1][1]
    counts = pre["counts"]
    assert counts["full"] == 10 and 0 < counts["window"] < 10 and counts["state"] == 1, counts
    assert dec["got"] == pre["sent"] and dec["seq"] == SEQ and dec["extra"] == {"output_len": 4}
    assert dec["idle"] is True
    assert not mp.active_children()


def _deferred_hand_off(stage: int, n: int, port: int, kind: str) -> dict:
    if stage == 0:
        return _hand_off(stage, n, port, kind)
    import os

    from kvchain.device import ThreadDevice
    from kvchain.dist.pd import PendingPublication

    os.environ["KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH"] = "1"
    node = decode_node(port, kind, backend=ThreadDevice(), overlap=True)
    pending = node.receive()  # this iteration: the take; the prefill node waits its answer
    got = node.publish_pending()  # the next: the ids go out, the transfer is waited
    node.storage.device.synchronize()  # the state slot's copy ran on the forward stream (PD-16)
    out = {"pending": isinstance(pending, PendingPublication), "deferred": node.deferred_publication,
           "n": len(got), "got": digests(node.storage, got[0].row), "seq": node.storage.seq_len(got[0].row),
           "extra": got[0].extra}
    node.finish(got[0])
    out["idle"] = node.check_idle()
    node.close()
    node.storage.device.close()
    return out


@pytest.mark.parametrize("kind", ENGINES)
def test_a_deferred_publication_lands_every_sub_pool_byte_exact(kind):
    """PD-13 across processes: the decode node (ThreadDevice, overlap) takes the offer's pages in one
    iteration and publishes their ids in the next; the request lands byte for byte."""
    out = run_stage_processes(_deferred_hand_off, 2, (kind,), timeout_s=60, env=ENV)
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    pre, dec = out[0][1], out[1][1]
    assert dec["pending"] and dec["deferred"] and dec["n"] == 1
    assert dec["got"] == pre["sent"] and dec["seq"] == SEQ and dec["extra"] == {"output_len": 4}
    assert dec["idle"] is True
    assert not mp.active_children()


# -- a timed-out transfer: both nodes raise in the same round, nothing is released early ------------


class _StuckWrites:
    """The prefill engine, slow: a write is held back (nothing posted, pending forever) until
    `late` posts it for real, after the decode node's deadline passed."""

    def __init__(self, engine) -> None:
        self.engine, self.held = engine, None
        self.real_write, self.real_poll, self.real_abort = engine.write, engine.poll, engine.abort
        engine.write, engine.poll, engine.abort = self.write, self.poll, self.abort

    def write(self, peer, src, dst, tag):
        from kvchain.dist.transfer import Transfer, nbytes

        self.held = Transfer(tag, peer, True, nbytes(src), impl="held")
        self.args = (peer, src, dst, tag)
        return self.held

    def poll(self, t):
        return t.state if t is self.held else self.real_poll(t)

    def abort(self, t):
        return t.state if t is self.held else self.real_abort(t)

    def late(self):
        """Post the held write now and wait for it to land."""
        import time

        t = self.real_write(*self.args)
        deadline = time.monotonic() + 10
        while not self.real_poll(t).quiescent and time.monotonic() < deadline:
            time.sleep(0.001)
        return t


def _timed_out(stage: int, n: int, port: int, kind: str) -> dict:
    from kvchain.errors import TransferTimeoutError

    if stage == 0:
        node = prefill_node(port, kind, timeout_s=1.0)
        row = prefilled(node.storage)
        stuck = _StuckWrites(node.engine)
        answer = node.offer("r1", row)
        try:
            node.send("r1", row, answer)
            raised = None
        except TransferTimeoutError as e:
            raised = str(e)
        deferred = sorted(node.deferred)
        node.link.exchange({"op": "wait"})  # until the decode node took its new request
        node.deferred["r1"].transfer = stuck.late()  # the engine was only slow: its write lands now
        released = node.fence()
        node.storage.check_idle()
        node.close()
        return {"raised": raised, "deferred": deferred, "released": released}
    node = decode_node(port, kind, timeout_s=0.5)  # its deadline passes first: both raise then
    try:
        node.receive()
        raised = None
    except TransferTimeoutError as e:
        raised = str(e)
    held = sorted(node.deferred)
    skipped = node.check_idle() is False  # CHK-16: its deferred row is in use on purpose
    probe = prefilled(node.storage, SEQ, seed=9)  # a new request takes what pages are free now
    before = digests(node.storage, probe)
    node.link.exchange({"op": "took a request"})
    released = node.fence()  # the prefill node's late write landed before it acknowledged
    after = digests(node.storage, probe)
    node.storage.free_rows(np.array([probe]))
    idle = node.check_idle()
    node.close()
    return {"raised": raised, "held": held, "skipped": skipped, "probe_intact": before == after,
            "released": released, "idle": idle}


@pytest.mark.parametrize("kind", ENGINES)
def test_a_timed_out_transfer_raises_on_both_nodes_and_releases_only_on_the_fence(kind):
    """PD-4, LIM-1, LIM-2, CHK-16: the prefill engine holds its write past the deadline; both nodes
    raise in the same round, naming the transfer; each keeps its pages (a deferred release) and the
    decode node skips its idle checks meanwhile; the write lands late, and a request the decode
    node took in the meantime keeps its bytes (with NIXL's one-sided write, a release at the
    timeout would hand it the pages the write lands on). Only the acknowledged fence releases;
    then both nodes are idle with nothing leaked."""
    out = run_stage_processes(_timed_out, 2, (kind,), timeout_s=60, env=ENV)
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    pre, dec = out[0][1], out[1][1]
    for r in (pre["raised"], dec["raised"]):
        assert r is not None and "still in flight: r1" in r
    assert pre["raised"].rsplit("round", 1)[1] == dec["raised"].rsplit("round", 1)[1]
    assert dec["probe_intact"]
    assert pre["deferred"] == dec["held"] == ["r1"] and dec["skipped"]
    assert pre["released"] == dec["released"] == ["r1"] and dec["idle"] is True
    assert not mp.active_children()


# -- a decode peer killed mid-transfer ----------------------------------------------------------------


def _decode_killed(stage: int, n: int, port: int, kind: str) -> dict:
    import os
    import signal

    from kvchain.dist.pd_link import PeerLost

    if stage == 0:
        node = prefill_node(port, kind)
        row = prefilled(node.storage)
        answer = node.offer("r1", row)
        try:
            node.send("r1", row, answer)
            raised = None
        except PeerLost as e:
            raised = str(e)
        deferred = sorted(node.deferred)
        released = node.peer_lost()
        node.storage.check_idle()
        node.engine.close()
        return {"raised": raised, "deferred": deferred, "released": released}
    node = decode_node(port, kind)
    exchange = node.link.exchange

    def exchange_then_die(msg):
        out = exchange(msg)
        if msg.get("op") == "accept":  # the ids are out: the prefill node's write comes next
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    node.link.exchange = exchange_then_die
    node.receive()
    return {}


@pytest.mark.parametrize("kind", ENGINES)
def test_a_decode_peer_killed_mid_transfer_releases_the_send_once_it_is_gone(kind):
    """LIM-2: the decode process dies once it published its ids; the prefill node's wait raises,
    its send stays deferred until the peer's process is known gone, then its pages go: nothing
    leaked."""
    out = run_stage_processes(_decode_killed, 2, (kind,), timeout_s=60, env=ENV)
    assert out[0][0] == "ok" and out[1][0] == "timeout", out
    pre = out[0][1]
    assert pre["raised"] is not None and pre["deferred"] == ["r1"] and pre["released"] == ["r1"]
    assert not mp.active_children()


# -- a prefill peer that restarts -----------------------------------------------------------------------


def _prefill_restarts(stage: int, n: int, port: int, kind: str, marker: str) -> dict:
    import os
    import signal
    import time
    from pathlib import Path

    from kvchain.dist.pd_link import PeerLost, _process_gone

    if stage == 0:  # the first prefill process: dies once it learned the destinations
        Path(marker).write_text(str(os.getpid()))
        node = prefill_node(port, kind)
        node.offer("r1", prefilled(node.storage))
        os.kill(os.getpid(), signal.SIGKILL)
    if stage == 2:  # the restarted prefill process: listens once the first is gone
        deadline = time.monotonic() + 30
        while not (Path(marker).exists() and _process_gone(int(Path(marker).read_text() or 0))):
            if time.monotonic() > deadline:
                raise TimeoutError("the first prefill process never went")
            time.sleep(0.05)
        # a port of its own, told to the decode node through a file: between the first process's
        # death and this bind, another process (another test's ephemeral socket) may take the old one
        from kvchain.dist.pp import free_port

        port = free_port()
        Path(marker + ".port").write_text(str(port))
        node = prefill_node(port, kind)
        row = prefilled(node.storage, seed=2)
        sent = digests(node.storage, row)
        assert node.hand_off("r2", row)
        node.storage.check_idle()
        node.close()
        return {"sent": sent}
    node = decode_node(port, kind)
    try:
        node.receive()
        raised = None
    except PeerLost as e:
        raised = str(e)
    held = sorted(node.deferred)
    released = node.peer_lost()
    deadline = time.monotonic() + 30
    while not Path(marker + ".port").exists() or not Path(marker + ".port").read_text():
        if time.monotonic() > deadline:
            raise TimeoutError("the restarted prefill process never published its port")
        time.sleep(0.05)
    port = int(Path(marker + ".port").read_text())
    link = PDLink.connect(SECRET, "127.0.0.1", port, hello(node.engine.descriptor(), layout_digest(node.storage)),
                          timeout_s=30, group_timeout_s=20)
    node.rejoin(link)
    got = node.receive()
    out = {"raised": raised, "held": held, "released": released, "got": digests(node.storage, got.row)}
    node.finish(got)
    out["idle"] = node.check_idle()
    node.close()
    return out


@pytest.mark.parametrize("kind", ENGINES)
def test_a_prefill_peer_that_restarts(kind, tmp_path):
    """LIM-1: the prefill process dies after the decode node published its ids; the receive stays
    deferred until that process is known gone, then its pages go; the restarted prefill process
    passes the handshake and its request lands byte-exact; the decode node is idle with nothing
    leaked."""
    out = run_stage_processes(_prefill_restarts, 3, (kind, str(tmp_path / "first.pid")), timeout_s=90, env=ENV)
    assert out[1][0] == "ok" and out[2][0] == "ok", out
    dec = out[1][1]
    assert dec["raised"] is not None and dec["held"] == ["r1"] and dec["released"] == ["r1"]
    assert dec["got"] == out[2][1]["sent"] and dec["idle"] is True
    assert not mp.active_children()


# -- ids that change between the take and the transfer -----------------------------------------------


def _pages_move(stage: int, n: int, port: int) -> dict:
    if stage == 0:
        node = prefill_node(port, "gloo")
        storage = node.storage
        filler = prefilled(storage, 17, seed=5)
        row = prefilled(storage)
        answer = node.offer("r1", row)
        offered = request_pages(storage, row)
        storage.free_rows(np.array([filler]))
        moves = storage.flush_opportunistic()
        moved = any(not np.array_equal(offered[k], v) for k, v in request_pages(storage, row).items())
        other = prefilled(storage, 17, seed=7)  # the pages the move vacated hold other bytes now
        sent = digests(storage, row)
        node.send("r1", row, answer)
        storage.free_rows(np.array([row, other]))
        storage.check_idle()
        node.close()
        return {"sent": sent, "moves": moves, "moved": moved}
    node = decode_node(port, "gloo")
    storage = node.storage
    filler = prefilled(storage, 17, seed=3)
    seen = {}

    def relief_moves_the_rows(row, hold):
        """Stands in for a relief that found no layout keeping the held rows in place."""
        seen["taken"] = request_pages(storage, row)
        seen["epoch"] = storage.move_epoch
        storage.published(hold)
        storage.free_rows(np.array([filler]))
        storage.flush_opportunistic()
        seen["moved"] = storage.move_epoch != seen["epoch"] and any(
            not np.array_equal(seen["taken"][k], v) for k, v in request_pages(storage, row).items())
        prefilled(storage, 17, seed=4)  # other bytes on the pages the move vacated

    node.before_publish = relief_moves_the_rows
    got = node.receive()
    out = {"got": digests(storage, got.row), "moved": seen["moved"]}
    node.close()
    return out


@pytest.fixture(scope="module")
def moved_pages():
    pressed = {"KVCHAIN_LAZY_COMPACTION_GAP_FRACTION": "1.0", "KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL": "64"}
    out = run_stage_processes(_pages_move, 2, timeout_s=60, env={**ENV, **pressed})
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    assert not mp.active_children()
    return out[0][1], out[1][1]


def test_a_held_send_reads_its_ids_again_just_before_it_goes(moved_pages):
    """PD-18: compaction moves the request's pages after the offer and another request takes the
    pages it left; the send reads the ids as they are when it goes, so the decode node gets the
    request's bytes, not the other request's."""
    pre, dec = moved_pages
    assert pre["moves"] > 0 and pre["moved"]
    assert dec["got"] == pre["sent"]


def test_the_readback_reads_the_ids_again_when_a_page_moved_since_the_take(moved_pages):
    """PD-17: the decode node's receive rows move after the take (`move_epoch` changes) and other
    bytes take the pages they left; the ids published are the moved ones, so the prefill node's
    write lands on the request's pages."""
    pre, dec = moved_pages
    assert dec["moved"] and dec["got"] == pre["sent"]


# -- a node of several ranks: the wait's judgements reduced across the ranks sharing a layout ---------


def _port_file(tmp: str, name: str, port: int | None = None) -> int:
    """Write a port for the other processes of the test, or wait for one to be written."""
    import time
    from pathlib import Path

    path = Path(tmp) / name
    if port is not None:
        path.with_suffix(".tmp").write_text(str(port))
        path.with_suffix(".tmp").rename(path)
        return port
    deadline = time.monotonic() + 20
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} port")
        time.sleep(0.02)
    return int(path.read_text())


def _two_ranks_a_node(stage: int, n: int, port: int, tmp: str) -> dict:
    """Stages 0 and 2: the prefill node's two ranks; 1 and 3: the decode node's. Ranks 0 of both
    nodes hand off to each other, ranks 1 likewise; rank 1's prefill engine holds its write."""
    from kvchain.dist.pd_link import RankGroup
    from kvchain.errors import TransferTimeoutError

    role, rank = ("prefill", "decode")[stage % 2], stage // 2
    if rank == 0:
        listener = PDListener(SECRET)
        _port_file(tmp, f"{role}-ranks", listener.sock.getsockname()[1])
        ranks = RankGroup.listen(listener, 2, timeout_s=20, group_timeout_s=20)
        listener.close()
    else:
        ranks = RankGroup.join(SECRET, "127.0.0.1", _port_file(tmp, f"{role}-ranks"), 2, timeout_s=20,
                               group_timeout_s=20)
    storage = make_storage(24 if role == "prefill" else 32)
    engine = make_engine("gloo", role)
    engine.register(storage.arena.data)
    me = hello(engine.descriptor(), layout_digest(storage))
    if role == "prefill":
        listener = PDListener(SECRET)
        _port_file(tmp, f"link{rank}", listener.sock.getsockname()[1])
        link = PDLink.accept(listener, me, timeout_s=20, group_timeout_s=20)
        listener.close()
        node = PrefillNode(storage, link, engine, ranks=ranks, timeout_s=1.0)
        row = prefilled(storage, seed=rank)
        stuck = _StuckWrites(engine) if rank == 1 else None
        answer = node.offer(f"r{rank}", row)
        try:
            node.send(f"r{rank}", row, answer)
            raised = None
        except TransferTimeoutError as e:
            raised = str(e)
        if stuck is not None:
            node.deferred["r1"].transfer = stuck.late()
        released = node.settle() if rank == 0 else node.fence()
    else:
        link = PDLink.connect(SECRET, "127.0.0.1", _port_file(tmp, f"link{rank}"), me, timeout_s=20,
                              group_timeout_s=20)
        node = DecodeNode(storage, link, engine, ranks=ranks, timeout_s=0.5)
        try:
            node.receive()
            raised = None
        except TransferTimeoutError as e:
            raised = str(e)
        released = node.settle() if rank == 0 else node.fence()
    out = {"raised": raised, "rounds": node.last_rounds, "released": released}
    storage.check_idle()
    ranks.close()
    node.close()
    return out


def test_every_rank_of_both_nodes_raises_in_the_same_round(tmp_path):
    """PD-3, PD-4 across the ranks that share a layout: each node has two ranks, each with its own
    arena and engine; rank 1's transfer is stuck while rank 0's lands. Each rank's judgements are
    MIN-reduced across its node's ranks, then across the link: all four ranks raise in the same
    round, rank 0's pair too (its engine is done, so `settle` releases it at once; rank 1's pages
    go on the fence), and nothing leaks."""
    out = run_stage_processes(_two_ranks_a_node, 4, (str(tmp_path),), timeout_s=90, env=ENV)
    assert {s: st for s, (st, _v) in out.items()} == {s: "ok" for s in range(4)}, out
    raised = [out[s][1]["raised"] for s in range(4)]
    assert all(r is not None for r in raised), raised
    assert len({r.rsplit("round", 1)[1] for r in raised}) == 1, raised
    assert len({out[s][1]["rounds"] for s in range(4)}) == 1
    assert [out[s][1]["released"] for s in range(4)] == [["r0"], ["r0"], ["r1"], ["r1"]]
    assert not mp.active_children()
