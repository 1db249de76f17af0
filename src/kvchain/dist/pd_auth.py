"""Who may connect to a PD node: one interface, one shared secret.

The prefill node listens on the interface it is given (127.0.0.1 unless told otherwise; never
every interface: "", "0.0.0.0" and "::" are refused). A peer proves it knows the deployment's
secret by an HMAC over both sides' fresh nonces, and the listener proves the same back, so neither
replays an old exchange. Only after both proofs does the listener hand out what reaches its pages:
the control plane's rendezvous (a torch.distributed store bound to the same interface) and its
transfer engine's descriptor. A connection that sends anything else, too little, or a wrong proof
is refused, logged and closed; it learns nothing and nothing of the node changes."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import operator
import os
import socket
import struct
import time

from ..errors import InputError, KVChainError, TransferTimeoutError

log = logging.getLogger("kvchain.pd")

HELLO = b"kvchain-pd/1\n"
NONCE = 16
MAC = 32
#: bytes a handshake message may carry (the peer's descriptor included)
MAX_PAYLOAD = 1 << 20
ALL_INTERFACES = ("", "0.0.0.0", "::")


class HandshakeRefused(KVChainError):
    """A peer failed the handshake (no handshake, or a wrong secret)."""


def check_host(host: str) -> str:
    """The one interface to bind; every-interface addresses are refused."""
    if host in ALL_INTERFACES:
        raise InputError(f"PD binds one interface, not {host!r} (every interface); give its address")
    return host


def check_port(port: int) -> int:
    """A TCP port: an integer in 0..65535 (0 for a listener: any free port); a bool is not one."""
    try:
        number = None if isinstance(port, bool) else operator.index(port)
    except TypeError:
        number = None
    if number is None or not 0 <= number <= 65535:
        raise InputError(f"a PD port is an integer in 0..65535, got {port!r}")
    return number


def _mac(secret: bytes, who: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, who + a + b, hashlib.sha256).digest()


def _read(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise HandshakeRefused(f"the connection closed after {len(out)} of {n} handshake bytes")
        out += chunk
    return out


def _send_payload(conn: socket.socket, payload: dict) -> None:
    data = json.dumps(payload).encode()
    conn.sendall(struct.pack("<I", len(data)) + data)


def _read_payload(conn: socket.socket) -> dict:
    (n,) = struct.unpack("<I", _read(conn, 4))
    if n > MAX_PAYLOAD:
        raise HandshakeRefused(f"a handshake payload of {n} bytes (at most {MAX_PAYLOAD})")
    try:
        obj = json.loads(_read(conn, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HandshakeRefused(f"a handshake payload that is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise HandshakeRefused("a handshake payload that is not an object")
    return obj


class PDListener:
    """The prefill node's listening socket. `refused` lists every refusal, as logged."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        if not secret:
            raise InputError("a PD listener needs the deployment's shared secret (non-empty)")
        self.secret = secret
        self.host = check_host(host)
        self.sock = socket.create_server((self.host, check_port(port)))
        self.refused: list[str] = []

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def accept(self, reply: dict, timeout_s: float) -> tuple[dict, socket.socket]:
        """The first peer that passes the handshake: its payload and the open connection, after
        `reply` went to it. Refused connections are logged and closed; past `timeout_s` with no
        peer it raises `TransferTimeoutError`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"no PD peer passed the handshake within {timeout_s:g} s "
                                           f"({len(self.refused)} refused)")
            self.sock.settimeout(left)
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(min(left, 5.0))
            try:
                return self._handshake(conn, reply), conn
            except (HandshakeRefused, OSError) as e:
                what = f"refused a PD connection from {addr[0]}:{addr[1]}: {e}"
                log.warning(what)
                self.refused.append(what)
                conn.close()

    def _handshake(self, conn: socket.socket, reply: dict) -> dict:
        mine = os.urandom(NONCE)
        conn.sendall(HELLO + mine)
        if _read(conn, len(HELLO)) != HELLO:
            raise HandshakeRefused("no PD handshake")
        theirs = _read(conn, NONCE)
        proof = _read(conn, MAC)
        if not hmac.compare_digest(proof, _mac(self.secret, b"peer", mine, theirs)):
            raise HandshakeRefused("wrong secret")
        conn.sendall(_mac(self.secret, b"listener", theirs, mine))
        payload = _read_payload(conn)
        _send_payload(conn, reply)
        return payload

    def close(self) -> None:
        self.sock.close()


def connect(secret: bytes, host: str, port: int, payload: dict, timeout_s: float) -> tuple[dict, socket.socket]:
    """Connect to a PD listener, prove the secret, check the listener's proof, exchange payloads."""
    conn = socket.create_connection((check_host(host), check_port(port)), timeout=timeout_s)
    try:
        head = _read(conn, len(HELLO) + NONCE)
        if head[:len(HELLO)] != HELLO:
            raise HandshakeRefused("the listener is not a PD node")
        theirs, mine = head[len(HELLO):], os.urandom(NONCE)
        conn.sendall(HELLO + mine + _mac(secret, b"peer", theirs, mine))
        proof = _read(conn, MAC)
        if not hmac.compare_digest(proof, _mac(secret, b"listener", mine, theirs)):
            raise HandshakeRefused("the listener does not know the secret")
        _send_payload(conn, payload)
        return _read_payload(conn), conn
    except BaseException:
        conn.close()
        raise
