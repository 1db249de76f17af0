"""The PD control plane: torch.distributed (gloo) between a prefill node and a decode node, set up
behind the handshake of `pd_auth`.

The prefill node listens; the store the process group meets in is bound to the same interface and
its port goes only to a peer that passed the handshake. Every exchange is a collective of the two
nodes (`exchange`, `round`), bounded by the group's timeout; a peer that died makes it raise
`PeerLost` at once (its sockets close). Whether the peer's process is gone (its transfer engine
stopped with it) is `peer_gone`: proven on the same machine from its pid, never assumed."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from ..errors import KVChainError
from .pd_auth import PDListener, check_host, connect


class PeerLost(KVChainError):
    """A control-plane collective failed: the peer's connection is gone."""


def _process_gone(pid: int) -> bool:
    """The process `pid` of this machine no longer runs: no such process, or a zombie (its address
    space, and every byte a transfer engine of it could touch, is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    return state in ("Z", "X")


class PDLink:
    """One node's end of the control plane. Rank 0 is the prefill node, rank 1 the decode node."""

    def __init__(self, rank: int, peer: dict, conn: socket.socket, timeout_s: float, store=None) -> None:
        self.rank = rank
        self.store = store  # the group's store, under a prefix of its own: counters a node reads without a collective
        self.peer = peer  # the peer's handshake payload: pid, host, engine descriptor, layout
        self.conn = conn  # the handshake connection, kept open while the link lives
        self.timeout_s = timeout_s
        self._group = True  # this link's process group is the default one until `close`

    @classmethod
    def accept(cls, listener: PDListener, hello: dict, timeout_s: float, group_timeout_s: float = 30.0) -> PDLink:
        """The prefill side: wait for a peer that passes the handshake, then form the group."""
        store_sock = socket.create_server((listener.host, 0))
        session = os.urandom(8).hex()
        reply = {**hello, "store_port": int(store_sock.getsockname()[1]), "session": session}
        peer, conn = listener.accept(reply, timeout_s)
        timeout = datetime.timedelta(seconds=group_timeout_s)
        store = dist.TCPStore(listener.host, reply["store_port"], 2, True, timeout,
                              wait_for_workers=False, master_listen_fd=store_sock.detach())
        dist.init_process_group("gloo", store=dist.PrefixStore(session, store), rank=0, world_size=2, timeout=timeout)
        return cls(0, peer, conn, group_timeout_s, dist.PrefixStore(f"{session}/posted", store))

    @classmethod
    def connect(cls, secret: bytes, host: str, port: int, hello: dict, timeout_s: float,
                group_timeout_s: float = 30.0) -> PDLink:
        """The decode side: pass the listener's handshake, then join the group."""
        deadline = time.monotonic() + timeout_s
        while True:  # the listener may not listen yet
            try:
                peer, conn = connect(secret, check_host(host), port, hello, timeout_s)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        timeout = datetime.timedelta(seconds=group_timeout_s)
        store = dist.TCPStore(host, int(peer["store_port"]), 2, False, timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(peer["session"], store), rank=1, world_size=2,
                                timeout=timeout)
        return cls(1, peer, conn, group_timeout_s, dist.PrefixStore(f"{peer['session']}/posted", store))

    def exchange(self, msg: dict) -> dict:
        """Send `msg` to the peer and return the peer's message of the same round (JSON both ways)."""
        data = json.dumps(msg).encode()
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
            n = max(int(s) for s in sizes)
            mine = torch.zeros(n, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
            dist.all_gather(out, mine)
        except RuntimeError as e:
            raise PeerLost(f"the control plane to the peer failed: {e}") from None
        other = 1 - self.rank
        return json.loads(bytes(out[other][:int(sizes[other])].numpy()))

    def post(self, key: str) -> None:
        """Count one more `key` (a message this node is about to exchange), so the peer can learn it
        waits without entering a collective (`posted`)."""
        if self.store is not None:
            self._store(lambda: self.store.add(key, 1))

    def posted(self, key: str) -> int:
        """How many `key` the peer posted so far: one store round trip, never a collective."""
        return 0 if self.store is None else int(self._store(lambda: self.store.add(key, 0)))

    def _store(self, op):
        try:
            return op()
        except (RuntimeError, OSError) as e:  # the store lives in the prefill process
            raise PeerLost(f"the control plane's store failed: {e}") from None

    def round(self, *flags: bool) -> tuple[bool, ...]:
        """A MIN-reduce of one boolean per flag across both nodes: each is True only where every
        node said True, so both leave a wait, or raise, in the same round (PD-3, PD-4)."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as e:
            raise PeerLost(f"the control plane to the peer failed: {e}") from None
        return tuple(bool(x) for x in t.tolist())

    def peer_gone(self, wait_s: float = 5.0) -> bool:
        """Proof that the peer's process is gone: it ran on this machine and its pid no longer runs.
        A dying process closes its sockets before it is gone, so the proof is awaited for up to
        `wait_s`; without it, False. A peer on another machine is never proven gone here."""
        if self.peer.get("host") != socket.gethostname():
            return False
        deadline = time.monotonic() + wait_s
        while not _process_gone(int(self.peer["pid"])):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """End this link's group (once: a later link's group is never this one's to end)."""
        if self._group and dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # a group whose peer died may refuse to end cleanly
                dist.destroy_process_group()
        self._group = False
        self.conn.close()


def hello(engine_descriptor: bytes, layout: str, extra: dict | None = None) -> dict:
    """This node's handshake payload."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "engine": engine_descriptor.hex(),
            "layout": layout, **(extra or {})}


class RankGroup:
    """The ranks of one PD node that share its layout (tensor-parallel ranks, each with its own arena
    and transfer engine): a gloo group of their own beside the link's. A transfer wait MIN-reduces
    each rank's judgements here first, then across the link, so every rank of both nodes leaves the
    wait, or raises, in the same round (PD-3, PD-4). Rank 0 listens behind the same handshake as a
    PD listener (one interface, the deployment's secret); the others connect to it."""

    def __init__(self, group, rank: int, size: int, conns: list[socket.socket], store) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._conns, self._store = conns, store  # kept open while the group lives

    @classmethod
    def listen(cls, listener: PDListener, size: int, timeout_s: float, group_timeout_s: float = 30.0) -> RankGroup:
        """Rank 0: admit the other `size - 1` ranks through `listener`'s handshake, then form the group."""
        store_sock = socket.create_server((listener.host, 0))
        session = os.urandom(8).hex()
        reply = {"store_port": int(store_sock.getsockname()[1]), "session": session}
        conns = [listener.accept({**reply, "rank": r}, timeout_s)[1] for r in range(1, size)]
        timeout = datetime.timedelta(seconds=group_timeout_s)
        store = dist.TCPStore(listener.host, reply["store_port"], size, True, timeout, wait_for_workers=False,
                              master_listen_fd=store_sock.detach())
        group = dist.ProcessGroupGloo(dist.PrefixStore(session, store), 0, size, timeout)
        return cls(group, 0, size, conns, store)

    @classmethod
    def join(cls, secret: bytes, host: str, port: int, size: int, timeout_s: float,
             group_timeout_s: float = 30.0) -> RankGroup:
        """Any other rank: pass rank 0's handshake and join the group under the rank it was given."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                peer, conn = connect(secret, check_host(host), port, {"pid": os.getpid()}, timeout_s)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        timeout = datetime.timedelta(seconds=group_timeout_s)
        store = dist.TCPStore(host, int(peer["store_port"]), size, False, timeout)
        rank = int(peer["rank"])
        group = dist.ProcessGroupGloo(dist.PrefixStore(peer["session"], store), rank, size, timeout)
        return cls(group, rank, size, [conn], store)

    def min(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag True only where every rank of the group said True."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        try:
            self.group.allreduce([t], opts).wait()
        except RuntimeError as e:
            raise PeerLost(f"the node's rank group failed: {e}") from None
        return tuple(bool(x) for x in t.tolist())

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = []
