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


def make_storage(chain_kib: int):
    return small_storage(page_size=4, chain_kib=chain_kib, windows=(8,), context=128, rows=8)


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


def decode_node(port: int, kind: str, chain_kib: int = 32, **kw):
    storage = make_storage(chain_kib)
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
    """PD-1, PD-8: full-attention pages, the window rows decode keeps (fewer than the request's
    pages) and the state slot reach the decode node's arena byte for byte; both nodes idle clean."""
    out = run_stage_processes(_hand_off, 2, (kind,), timeout_s=60, env=ENV)
    assert {s: st for s, (st, _v) in out.items()} == {0: "ok", 1: "ok"}, out
    pre, dec = out[0][1], out[1][1]
    counts = pre["counts"]
    assert counts["full"] == 10 and 0 < counts["window"] < 10 and counts["state"] == 1, counts
    assert dec["got"] == pre["sent"] and dec["seq"] == SEQ and dec["extra"] == {"output_len": 4}
    assert dec["idle"] is True
    assert not mp.active_children()
