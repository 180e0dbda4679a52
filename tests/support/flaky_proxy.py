"""A TCP proxy on 127.0.0.1 in front of a test server, that a test switches to refuse or drop
connections: an object store (or any server) with an outage, seen from its clients.

    proxy = FlakyProxy(upstream_port)     # proxy.port: give clients this one
    proxy.mode = "drop"                   # every connection is reset after `drop_after` bytes
    proxy.mode = "refuse"                 # every new connection is reset at once
    proxy.mode = "pass"                   # forwards again
    proxy.close()

Switching away from "pass" also resets the connections that are open (a client's pooled
keep-alive connection breaks as it would when the server goes away). Threads only, no process.
"""

from __future__ import annotations

import socket
import struct
import threading

MODES = ("pass", "drop", "refuse")


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class FlakyProxy:
    def __init__(self, upstream_port: int, drop_after: int = 16 * 1024):
        self.upstream_port, self.drop_after = upstream_port, drop_after
        self._mode = "pass"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.resets = 0  # connections reset while not passing
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, name="flaky-proxy", daemon=True).start()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        assert mode in MODES, mode
        with self._lock:
            self._mode = mode
            cut = list(self._open) if mode != "pass" else []
            self._open.difference_update(cut)
        for s in cut:
            _reset(s)

    def close(self) -> None:
        self._closed = True
        self.mode = "refuse"
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._mode == "refuse":
                self.resets += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            except OSError:
                _reset(client)
                continue
            with self._lock:  # the mode again, under the lock the setter cuts under: a switch in between
                mode = self._mode  # would otherwise leave this connection passing through the outage
                if mode != "refuse":
                    self._open.update((client, upstream))
            if mode == "refuse":
                self.resets += 1
                _reset(client)
                _reset(upstream)
                continue
            limit = self.drop_after if mode == "drop" else None
            threading.Thread(target=self._pump, args=(client, upstream, limit), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) > limit:  # a request cut off mid-way
                    dst.sendall(data[:max(limit - sent, 0)])
                    self.resets += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with self._lock:
                self._open.discard(s)
            _reset(s)
