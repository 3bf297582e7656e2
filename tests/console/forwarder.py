"""A loopback TCP forwarder from this namespace into a lab namespace, recording what the server sends.

The console listens on 127.0.0.1 inside the lab's gateway namespace; the browser runs
here. Every accepted connection gets a socket made inside the namespace (call_in_netns),
and bytes are pumped both ways. Everything the server sent to the browser is kept
(bounded), so a test can say that no response ever held a value.
"""
from __future__ import annotations

import socket
import threading
from contextlib import suppress

from testbed.netns import call_in_netns

MAX_RECORDED = 64 << 20
MAX_CONNECTIONS = 256


class Forwarder:
    def __init__(self, netns: str, port: int):
        self.netns, self.target = netns, port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._recorded = bytearray()
        self._socks: list[socket.socket] = []
        self._count = 0
        self._closed = False
        threading.Thread(target=self._accept, name="console-forwarder", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def served(self) -> bytes:
        """Every byte the server has sent so far (to every connection)."""
        with self._lock:
            return bytes(self._recorded)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._count += 1
            if self._count > MAX_CONNECTIONS:
                client.close()
                continue
            try:
                upstream = call_in_netns(self.netns, socket.create_connection, ("127.0.0.1", self.target), 5,
                                         timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)   # streams sit idle between events
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        with suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if record:
                    with self._lock:
                        if len(self._recorded) < MAX_RECORDED:
                            self._recorded += data
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with suppress(OSError):
            self.listener.close()
        with self._lock:
            for s in self._socks:
                with suppress(OSError):
                    s.close()
