"""Who may connect to a PD node: the listener binds one interface, and only a peer that proves the
deployment's secret learns how to reach the node's pages. A stray connection and a wrong secret are
refused, logged, and change nothing of the node."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import socket

import numpy as np
import pytest

from kvchain.dist.pd import PrefillNode, layout_digest
from kvchain.dist.pd_auth import HELLO, NONCE, HandshakeRefused, PDListener, connect
from kvchain.dist.pd_link import PDLink, hello
from kvchain.dist.pp import run_stage_processes
from kvchain.dist.transfer import make_engine
from kvchain.errors import InputError, TransferTimeoutError
from support.chains import allocator_state, same_state, small_storage

SECRET = b"the deployment's secret"
ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def _storage(kib):
    return small_storage(page_size=4, chain_kib=kib, windows=(8,), context=128, rows=8)


def _node_state(storage):
    return allocator_state(storage), hashlib.sha256(storage.arena.data.numpy().tobytes()).hexdigest()


def _nodes(stage: int, n: int, port: int) -> dict:
    from kvchain.dist.pd import DecodeNode

    if stage == 0:
        storage = _storage(24)
        row = storage.alloc_row()
        storage.alloc_extend(np.array([row]), np.array([21]))
        storage.advance(np.array([row]))
        storage.arena.data[:].random_(0, 256)
        engine = make_engine("gloo", "prefill")
        engine.register(storage.arena.data)
        listener = PDListener(SECRET, port=port)
        before = _node_state(storage)
        link = PDLink.accept(listener, hello(engine.descriptor(), layout_digest(storage)), timeout_s=20)
        after = _node_state(storage)  # every refusal happened inside `accept`
        untouched = same_state(before[0], after[0]) and before[1] == after[1]
        node = PrefillNode(storage, link, engine)
        assert node.hand_off("r1", row)
        node.close()
        return {"refused": listener.refused, "untouched": untouched, "bound": listener.sock.getsockname()[0]}
    import time

    deadline = time.monotonic() + 20
    while True:
        try:
            stray = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    seen = b""
    stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
    try:
        while True:
            chunk = stray.recv(4096)
            if not chunk:
                break
            seen += chunk
    except ConnectionResetError:  # the listener closed on it with its request unread
        pass
    stray.close()
    try:
        connect(b"a guess", "127.0.0.1", port, {"pid": 0}, timeout_s=5)
        wrong = "accepted"
    except (HandshakeRefused, OSError) as e:
        wrong = f"refused: {e}"
    storage = _storage(32)
    engine = make_engine("gloo", "decode")
    engine.register(storage.arena.data)
    link = PDLink.connect(SECRET, "127.0.0.1", port, hello(engine.descriptor(), layout_digest(storage)), timeout_s=20)
    node = DecodeNode(storage, link, engine)
    got = node.receive()
    node.finish(got)
    node.close()
    return {"stray_saw": seen.hex(), "wrong": wrong, "received": got.rid}


@pytest.fixture(scope="module")
def connections():
    out = run_stage_processes(_nodes, 2, timeout_s=60, env=ENV)
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    assert not mp.active_children()
    return out[0][1], out[1][1]


def test_a_stray_connection_is_refused_logged_and_touches_no_page(connections):
    """A connection that speaks no PD handshake learns the listener's greeting and nothing else (no
    rendezvous, no engine descriptor); the refusal is logged; the node's pages and allocator are as
    they were, and the real peer that comes next is served."""
    pre, dec = connections
    assert bytes.fromhex(dec["stray_saw"])[:len(HELLO)] == HELLO and len(dec["stray_saw"]) // 2 == len(HELLO) + NONCE
    assert "no PD handshake" in pre["refused"][0]
    assert pre["untouched"] and dec["received"] == "r1"


def test_a_wrong_secret_is_refused_logged_and_touches_no_page(connections):
    pre, dec = connections
    assert dec["wrong"].startswith("refused") and len(pre["refused"]) == 2
    assert "wrong secret" in pre["refused"][1] and pre["untouched"]


def test_the_listener_binds_only_the_interface_it_is_given(caplog):
    """Loopback by default; every-interface addresses are refused; a connection through another
    interface of the machine finds nothing listening."""
    for every in ("0.0.0.0", "", "::"):
        with pytest.raises(InputError, match="one interface"):
            PDListener(SECRET, host=every)
    with pytest.raises(InputError, match="secret"):
        PDListener(b"")
    listener = PDListener(SECRET)
    try:
        assert listener.sock.getsockname()[0] == "127.0.0.1"
        others = {ip for *_x, (ip, *_p) in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
        others = [ip for ip in others if not ip.startswith("127.")]
        for ip in others:
            with pytest.raises(OSError):
                socket.create_connection((ip, listener.port), timeout=2).close()
        with caplog.at_level(logging.WARNING, logger="kvchain.pd"):
            stray = socket.create_connection(("127.0.0.1", listener.port))
            stray.close()
            with pytest.raises(TransferTimeoutError, match="1 refused"):
                listener.accept({"secret": "never sent"}, timeout_s=1.0)
        assert any("refused a PD connection" in r.message for r in caplog.records)
    finally:
        listener.close()
