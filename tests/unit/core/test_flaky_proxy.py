"""tests/support/flaky_proxy.py, which the outage tests put in front of a server: while it refuses,
no byte reaches the server and none comes back, even on a connection accepted as the mode switches."""

from __future__ import annotations

import socket
import socketserver
import threading

import pytest

from tests.support import flaky_proxy
from tests.support.flaky_proxy import FlakyProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(1024):
                self.request.sendall(data)
        except ConnectionError:  # the proxy reset its side
            pass


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _echoed(port: int) -> bytes:
    """What comes back for b"ping" through 127.0.0.1:port (b"" when the connection is reset).
    A plain `connect`: the second test patches `socket.create_connection`, the proxy's upstream one."""
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))  # the reset may come while connect() waits
            s.sendall(b"ping")
            return s.recv(16)
        except ConnectionError:
            return b""


def test_pass_forwards_and_refuse_resets(echo):
    proxy = FlakyProxy(echo)
    try:
        assert _echoed(proxy.port) == b"ping"
        proxy.mode = "refuse"
        assert _echoed(proxy.port) == b""
        proxy.mode = "pass"
        assert _echoed(proxy.port) == b"ping"
    finally:
        proxy.close()


def test_a_connection_accepted_as_the_outage_starts_is_refused(echo, monkeypatch):
    """The switch to "refuse" lands while the proxy connects this client's connection upstream:
    the connection must be reset, not left passing through the outage."""
    proxy = FlakyProxy(echo)
    connect = socket.create_connection

    def connect_then_switch(*args, **kwargs):
        upstream = connect(*args, **kwargs)
        proxy.mode = "refuse"
        return upstream

    monkeypatch.setattr(flaky_proxy.socket, "create_connection", connect_then_switch)
    try:
        assert _echoed(proxy.port) == b""
        assert proxy.resets == 1
    finally:
        proxy.close()
