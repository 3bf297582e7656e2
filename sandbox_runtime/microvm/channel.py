"""Host end of the virtio-serial agent port: one persistent connection per VM.

The port is a stream, so requests are serialised; after any error the stream may be out
of sync (e.g. an exec timed out mid-frame), so the connection is dropped and the next
request reconnects (the guest agent sees EOF and reopens the port, which resyncs it).
A connection held open also keeps the guest agent blocked in read() instead of polling.

Resync: the guest only sees EOF (and reopens, dropping what is buffered) if the port is
still disconnected when its read finds no data; so a dropped connection is not replaced
for RECONNECT_GAP_S, and a replacement must answer a ping before it is used.
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import suppress
from typing import Callable, TypeVar

from sandbox_runtime.agent.client import AgentClient, AgentError, encode_frame, recv_frame
from sandbox_runtime.backend import SandboxError

T = TypeVar("T")
RECONNECT_GAP_S = 0.3
RESYNC_TRIES = 3


class AgentChannel:
    def __init__(self, sock_path: str):
        self.path = sock_path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._client = AgentClient(self._connect, serial=True)
        self._dropped_at: float | None = None     # None: never connected (nothing stale)

    def _open(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise AgentError(f"cannot reach the VM agent: {e.strerror or e}") from None
        return s

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self._dropped_at is None:
            self._sock = self._open()
            return self._sock
        last: Exception | None = None
        for _ in range(RESYNC_TRIES):
            wait = self._dropped_at + RECONNECT_GAP_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._sock = self._open()
            try:
                AgentClient(lambda: self._sock, serial=True).ping(timeout=3.0)
                return self._sock
            except (SandboxError, OSError) as e:
                last = e
                self._drop()
        raise AgentError(f"VM agent stream could not be resynchronised: {last}")

    def call(self, fn: Callable[[AgentClient], T]) -> T:
        with self._lock:
            try:
                return fn(self._client)
            except (SandboxError, OSError):
                self._drop()
                raise

    def exec(self, fn: Callable[[AgentClient], T]) -> T:
        """An exec, then a ping barrier. Agents before the serial-mode stdin-EOF fix could
        finish an exec before they read the client's stdin-EOF frame; that frame was then
        parsed as the next request and answered with a stray 'F'. Reading up to the
        barrier's 'p' swallows such a reply here instead of it failing the next, unrelated
        request. The agent now reads 'i' before 'X' (and ignores a stray 'i'), so this is
        defence in depth only: one extra round trip per exec."""
        with self._lock:
            try:
                res = fn(self._client)
                s = self._connect()
                s.settimeout(5.0)
                s.sendall(encode_frame(b"P"))
                for _ in range(4):
                    kind, payload = recv_frame(s)
                    if kind == b"p":
                        return res
                    if kind != b"F":
                        break
                raise AgentError("agent stream out of sync after exec")
            except (SandboxError, OSError):
                self._drop()
                raise

    def ping_until(self, deadline: float) -> str:
        """Ping until the agent answers (boot / restore) or the deadline passes."""
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                # one long ping: a retried one could leave a stale reply in the stream
                return self.call(lambda c: c.ping(timeout=max(0.2, deadline - time.monotonic())))
            except SandboxError as e:
                last = str(e)
                time.sleep(0.05)
        raise SandboxError(f"VM agent did not answer: {last}")

    def _drop(self) -> None:
        if self._sock is not None:
            with suppress(OSError):
                self._sock.close()
            self._sock = None
            self._dropped_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._drop()
