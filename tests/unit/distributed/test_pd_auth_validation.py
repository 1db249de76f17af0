"""A PD listener (and a connect) refuses a port that is not an integer in 0..65535 with an
`InputError` naming the port, before any socket is made, instead of socket's OverflowError or
TypeError."""

from __future__ import annotations

import socket

import pytest

from kvchain.dist import pd_auth
from kvchain.dist.pd_auth import PDListener, connect
from kvchain.errors import InputError, KVChainError

SECRET = b"the deployment's secret"
BAD_PORTS = [70000, 65536, -1, "8000", 80.0, True, None]


@pytest.fixture
def no_sockets(monkeypatch):
    """Any socket made fails the test: a refusal comes before the first one."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a socket was made")

    monkeypatch.setattr(pd_auth.socket, "create_server", forbidden)
    monkeypatch.setattr(pd_auth.socket, "create_connection", forbidden)


@pytest.mark.parametrize("port", BAD_PORTS)
def test_a_listener_refuses_a_port_that_is_no_port(no_sockets, port):
    with pytest.raises(InputError) as info:
        PDListener(SECRET, "127.0.0.1", port)
    assert isinstance(info.value, KVChainError)
    text = str(info.value)
    assert "\n" not in text and "port" in text and repr(port) in text


@pytest.mark.parametrize("port", BAD_PORTS)
def test_connect_refuses_a_port_that_is_no_port(no_sockets, port):
    with pytest.raises(InputError) as info:
        connect(SECRET, "127.0.0.1", port, {}, 1.0)
    assert "port" in str(info.value) and repr(port) in str(info.value)


def test_a_valid_port_still_listens():
    listener = PDListener(SECRET, "127.0.0.1", 0)
    try:
        port = listener.port
        assert 0 < port < 65536
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        listener.close()
