"""The PD data plane: a small transfer interface over one process's registered arena bytes.

A process registers its arena once (`TransferEngine.register`), hands its `descriptor` to a peer
over the control plane, and the peer `connect`s. The initiator (the prefill side) `write`s a page
batch, a list of (offset, length) byte segments of its arena onto the same number of bytes of the
peer's; the target (the decode side) `expect`s that batch under the same tag. Both sides `poll`
their handle. `abort` asks the engine to stop: a handle reports `ABORTED` only when the engine
itself confirms it no longer touches the bytes, so a caller may release pages on that answer (LIM-1,
LIM-2) and on no timer.

Two engines: `NixlEngine` (NIXL over UCX: one-sided writes straight into the peer's registered
arena, a notification when they land) and `GlooEngine` (torch.distributed point-to-point: the send
packs its segments into a staging buffer, the receive lands in one and is scattered into the arena
by `poll`, so the arena is touched only inside the owning process's own calls)."""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import struct
import sys
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import KVChainError

Segments = list[tuple[int, int]]
#: how a staged receive lands: `place(arena, staged, dst)` puts the staged bytes, in `dst`'s order,
#: into the arena's `dst` segments (the default copies them on the host; a decode node runs its state
#: slots' copies on their consumers' stream, PD-16)
Place = Callable[[torch.Tensor, torch.Tensor, Segments], None]
log = logging.getLogger("kvchain.pd")


class TransferError(KVChainError):
    """A transfer cannot be posted: an unknown peer, unregistered memory, mismatched batches."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # the engine reported an error: it no longer touches the bytes
    ABORTED = "aborted"  # the engine confirmed a cancel: it no longer touches the bytes

    @property
    def quiescent(self) -> bool:
        """The engine is proven done with the bytes (done, failed or aborted)."""
        return self is not TransferState.PENDING


@dataclass(eq=False)
class Transfer:
    """One posted page batch: `sends` on the initiator, a receive on the target."""

    tag: str
    peer: str
    sends: bool
    nbytes: int
    state: TransferState = TransferState.PENDING
    impl: Any = field(default=None, repr=False)


def nbytes(segments: Segments) -> int:
    return sum(n for _o, n in segments)


def coalesce(segments: Segments) -> Segments:
    """Adjacent segments merged, in order (consecutive pages of one band become one segment)."""
    out: Segments = []
    for off, n in segments:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((int(off), int(n)))
    return out


def page_segments(grids: Sequence, pages: Mapping[int, np.ndarray]) -> Segments:
    """A page batch as arena byte segments: per band index (in the order given), each physical
    page's bytes in its band's grid (`layout.grids[i]`: origin, page_bytes)."""
    out: Segments = []
    for index, ids in pages.items():
        g = grids[index]
        out += [(int(g.origin + int(p) * g.page_bytes), int(g.page_bytes)) for p in np.asarray(ids)]
    return out


def pair_segments(src: Segments, dst: Segments) -> tuple[Segments, Segments]:
    """Two batches of the same byte count cut at the union of their boundaries, so segment i of
    one is exactly as long as segment i of the other (the shape a one-sided write needs)."""
    if nbytes(src) != nbytes(dst):
        raise TransferError(f"a write of {nbytes(src)} bytes onto {nbytes(dst)}")
    a, b = list(src), list(dst)
    out_a: Segments = []
    out_b: Segments = []
    i = j = 0
    ao = bo = 0
    while i < len(a) and j < len(b):
        n = min(a[i][1] - ao, b[j][1] - bo)
        out_a.append((a[i][0] + ao, n))
        out_b.append((b[j][0] + bo, n))
        ao += n
        bo += n
        if ao == a[i][1]:
            i, ao = i + 1, 0
        if bo == b[j][1]:
            j, bo = j + 1, 0
    return out_a, out_b


class TransferEngine(ABC):
    """What PD needs of a data plane."""

    kind: str

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: torch.Tensor | None = None

    def register(self, data: torch.Tensor) -> None:
        """Register the process's arena bytes (a contiguous uint8 tensor) for transfers."""
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise TransferError("a transfer engine registers one contiguous uint8 tensor (the arena)")
        self.data = data
        self._register(data)

    def _register(self, data: torch.Tensor) -> None:
        return None

    def _check(self, segments: Segments) -> None:
        if self.data is None:
            raise TransferError(f"{self.name}: no memory registered")
        size = self.data.numel()
        bad = [(o, n) for o, n in segments if o < 0 or n < 0 or o + n > size]
        if bad:
            raise TransferError(f"{self.name}: segments {bad[:4]} outside the {size} registered bytes")

    @abstractmethod
    def descriptor(self) -> bytes:
        """What a peer needs to `connect` to this engine."""

    @abstractmethod
    def connect(self, peer: str, descriptor: bytes) -> None:
        """Make `peer` (known by that name from now on) reachable."""

    @abstractmethod
    def write(self, peer: str, src: Segments, dst: Segments, tag: str) -> Transfer:
        """Post a write of local `src` bytes onto the peer's `dst` bytes (same total)."""

    @abstractmethod
    def expect(self, peer: str, dst: Segments, tag: str, place: Place | None = None) -> Transfer:
        """Post the receive of the peer's write `tag` onto local `dst`. `place` lands staged bytes
        (an engine that writes the arena in place, NIXL, stages nothing and never calls it)."""

    @abstractmethod
    def poll(self, t: Transfer) -> TransferState:
        """The handle's state now (and its completion work, if any)."""

    @abstractmethod
    def abort(self, t: Transfer) -> TransferState:
        """Ask the engine to stop `t`. The state after: quiescent only with the engine's proof."""

    def close(self) -> None:
        return None


def place_on_host(data: torch.Tensor, staged: torch.Tensor, dst: Segments) -> None:
    """Staged bytes into the arena's `dst` segments, on the host, now."""
    at = 0
    for o, n in dst:
        data[o:o + n].copy_(staged[at:at + n])
        at += n


# -- torch.distributed ------------------------------------------------------------------------------


def _tag_int(tag: str) -> int:
    return zlib.crc32(tag.encode()) & 0x7FFFFFFF


class _Waited:
    """A gloo point-to-point work waited on a thread of its own: gloo reports such a work complete
    only to a `wait`, and a host poll must not block."""

    def __init__(self, work) -> None:
        self.work = work
        self.error: str | None = None
        self.finished = threading.Event()
        threading.Thread(target=self._wait, daemon=True, name="gloo-transfer").start()

    def _wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as e:  # the peer went away, or the group's timeout passed
            self.error = str(e)
        self.finished.set()


class GlooEngine(TransferEngine):
    """Point-to-point over the default torch.distributed group; a peer's descriptor is its rank."""

    kind = "gloo"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ranks: dict[str, int] = {}

    def descriptor(self) -> bytes:
        """The rank, once the group exists (before it, the peer learns the rank from its link)."""
        return struct.pack("<q", dist.get_rank()) if dist.is_initialized() else b""

    def connect(self, peer: str, descriptor: bytes) -> None:
        (self.ranks[peer],) = struct.unpack("<q", descriptor)

    def _rank(self, peer: str) -> int:
        if peer not in self.ranks:
            raise TransferError(f"{self.name}: unknown peer {peer!r}")
        return self.ranks[peer]

    def write(self, peer: str, src: Segments, dst: Segments, tag: str) -> Transfer:
        self._check(src)
        if nbytes(src) != nbytes(dst):
            raise TransferError(f"a write of {nbytes(src)} bytes onto {nbytes(dst)}")
        data = self.data
        staged = torch.cat([data[o:o + n] for o, n in src]) if src else torch.zeros(0, dtype=torch.uint8)
        work = _Waited(dist.isend(staged, self._rank(peer), tag=_tag_int(tag)))
        return Transfer(tag, peer, True, staged.numel(), impl=(work, staged))

    def expect(self, peer: str, dst: Segments, tag: str, place: Place | None = None) -> Transfer:
        self._check(dst)
        buf = torch.empty(nbytes(dst), dtype=torch.uint8)
        work = _Waited(dist.irecv(buf, self._rank(peer), tag=_tag_int(tag)))
        return Transfer(tag, peer, False, buf.numel(), impl=[work, buf, list(dst), place or place_on_host])

    def poll(self, t: Transfer) -> TransferState:
        if t.state.quiescent:
            return t.state
        work = t.impl[0]
        if not work.finished.is_set():
            return t.state
        if work.error is not None:
            t.state = TransferState.FAILED
            return t.state
        if not t.sends:  # the bytes are here: only now does anything touch the arena
            t.impl[3](self.data, t.impl[1], t.impl[2])
        t.state = TransferState.DONE
        return t.state

    def abort(self, t: Transfer) -> TransferState:
        """A staged transfer touches the arena only inside `poll` (a receive's scatter) or `write`
        (a send's pack), both in this process: once this returns, nothing will."""
        if self.poll(t).quiescent:
            return t.state
        t.state = TransferState.ABORTED
        return t.state


# -- NIXL -------------------------------------------------------------------------------------------


def _nixl_logs_to_stderr() -> None:
    """nixl configures its logger to write to stdout, where a command's `--json` document goes: its
    lines go to stderr instead, as every other log line does."""
    for handler in logging.getLogger("nixl").handlers:
        # its console handler holds the stdout of when nixl was first imported (a file handler is
        # a user's choice, and stays)
        if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
            handler.setStream(sys.stderr)


def nixl_available() -> str | None:
    """None when NIXL imports, else why not."""
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # an import of a native library fails in more ways than ImportError
        return f"nixl does not import: {type(e).__name__}: {e}"
    return None


class NixlEngine(TransferEngine):
    """NIXL agents over UCX. A descriptor is the agent's metadata plus its arena's base address."""

    kind = "nixl"

    def __init__(self, name: str, net_device: str = "lo") -> None:
        super().__init__(name)
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", net_device)  # UCX binds only this interface
        from nixl._api import nixl_agent, nixl_agent_config

        _nixl_logs_to_stderr()
        # an agent name no earlier process used: a restarted peer is a new agent, never a cached one
        self.agent = nixl_agent(f"{name}-{os.getpid()}-{os.urandom(4).hex()}", nixl_agent_config(backends=["UCX"]))
        self.remote: dict[str, tuple[str, int]] = {}  # peer -> (agent name, arena base address)
        self._reg = None

    def _mem(self) -> tuple[str, int]:
        data = self.data
        return ("VRAM", data.device.index or 0) if data.is_cuda else ("DRAM", 0)

    def _register(self, data: torch.Tensor) -> None:
        kind, dev = self._mem()
        self._reg = self.agent.register_memory([(data.data_ptr(), data.numel(), dev, "")], kind)

    def descriptor(self) -> bytes:
        if self.data is None:
            raise TransferError(f"{self.name}: register the arena before handing out a descriptor")
        return struct.pack("<Q", self.data.data_ptr()) + self.agent.get_agent_metadata()

    def connect(self, peer: str, descriptor: bytes) -> None:
        (base,) = struct.unpack("<Q", descriptor[:8])
        agent = self.agent.add_remote_agent(descriptor[8:])
        self.remote[peer] = (agent.decode() if isinstance(agent, bytes) else agent, base)

    def _peer(self, peer: str) -> tuple[str, int]:
        if peer not in self.remote:
            raise TransferError(f"{self.name}: unknown peer {peer!r}")
        return self.remote[peer]

    def write(self, peer: str, src: Segments, dst: Segments, tag: str) -> Transfer:
        self._check(src)
        agent_name, rbase = self._peer(peer)
        src, dst = pair_segments(src, dst)
        kind, dev = self._mem()
        base = self.data.data_ptr()
        local = self.agent.get_xfer_descs([(base + o, n, dev) for o, n in src], kind)
        remote = self.agent.get_xfer_descs([(rbase + o, n, dev) for o, n in dst], kind)
        t = Transfer(tag, peer, True, nbytes(src))
        try:
            t.impl = self.agent.initialize_xfer("WRITE", local, remote, agent_name, tag.encode())
            posted = self.agent.transfer(t.impl)
        except Exception as e:  # nixl raises its errors (a peer gone: NIXL_ERR_REMOTE_DISCONNECT)
            log.warning("nixl: the write of %s failed to post: %s", tag, e)
            posted = "ERR"
        if posted == "ERR":
            self._release(t)
            t.state = TransferState.FAILED
        return t

    def expect(self, peer: str, dst: Segments, tag: str, place: Place | None = None) -> Transfer:
        self._check(dst)
        self._peer(peer)
        return Transfer(tag, peer, False, nbytes(dst))

    def poll(self, t: Transfer) -> TransferState:
        if t.state.quiescent:
            return t.state
        if t.sends:
            try:
                s = self.agent.check_xfer_state(t.impl)
            except Exception as e:  # an error the engine raises is its error state
                log.warning("nixl: the write of %s failed: %s", t.tag, e)
                s = "ERR"
            if s == "PROC":
                return t.state
            self._release(t)
            t.state = TransferState.DONE if s == "DONE" else TransferState.FAILED
        else:
            try:
                if self.agent.check_remote_xfer_done(self._peer(t.peer)[0], t.tag.encode(), tag_is_prefix=False):
                    t.state = TransferState.DONE
            except Exception as e:  # no notification can be read: the peer's proof must come another way
                log.warning("nixl: the notifications of %s cannot be read: %s", t.peer, e)
        return t.state

    def _release(self, t: Transfer) -> bool:
        if t.impl is None:
            return True
        try:
            self.agent.release_xfer_handle(t.impl)  # cancels an active transfer, or refuses to
        except Exception:
            return False
        t.impl = None
        return True

    def abort(self, t: Transfer) -> TransferState:
        """An initiator's handle is released (NIXL cancels the transfer, or refuses while it cannot:
        then it stays pending). A target cannot stop the peer's writes: its proof comes from the
        peer (a fence it acknowledges) or the peer's death, never from here."""
        if self.poll(t).quiescent:
            return t.state
        if t.sends and self._release(t):
            t.state = TransferState.ABORTED
        return t.state

    def forget(self, peer: str) -> None:
        """Drop a peer (it is gone): its agent's connection and metadata."""
        agent_name, _ = self.remote.pop(peer, (None, 0))
        if agent_name is not None:
            with contextlib.suppress(Exception):  # an agent whose connection already failed
                self.agent.remove_remote_agent(agent_name)

    def close(self) -> None:
        for peer in list(self.remote):
            self.forget(peer)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None


def make_engine(kind: str, name: str) -> TransferEngine:
    """`nixl` or `gloo`."""
    if not isinstance(kind, str) or not isinstance(name, str):
        raise TransferError(f"a transfer engine's kind and name are strings, got {kind!r} and {name!r}")
    if kind == "nixl":
        reason = nixl_available()
        if reason is not None:
            raise TransferError(reason)
        return NixlEngine(name)
    if kind == "gloo":
        return GlooEngine(name)
    raise TransferError(f"transfer engine must be nixl or gloo, not {kind!r}")
