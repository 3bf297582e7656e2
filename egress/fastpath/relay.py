"""Bytes between two sockets with no protocol layers: asyncio Protocols with flow control.

Each side's protocol writes what it receives to the other side's transport. When a
transport's write buffer passes its high-water mark, asyncio calls pause_writing on
that transport's protocol, which stops reading from the side feeding it: a peer that
does not read holds at most HIGH_WATER bytes of ours, never more (backpressure).
EOF from one side is passed on as a half-close; the relay ends when both sides are
done or one is lost, or after `idle_timeout` seconds without a byte either way.
"""
from __future__ import annotations

import asyncio

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class Relay:
    """Owns the two sides; `done` is set once both transports are closed."""

    def __init__(self, client_transport, on_bytes_out, on_bytes_in, idle_timeout: float | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.client = _Side(self, client_transport, on_bytes_out)
        self.upstream: _Side | None = None
        self._on_in = on_bytes_in
        self.idle_timeout = idle_timeout
        self.last = self.loop.time()   # when a byte last moved, either way
        self._idle_handle = None
        self.idle_expired = False

    def upstream_protocol(self) -> "_Side":
        self.upstream = _Side(self, None, self._on_in)
        return self.upstream

    def start(self, first: bytes) -> None:
        """Both sides connected: send what the client already sent, then let bytes flow."""
        c, u = self.client, self.upstream
        c.peer, u.peer = u, c
        c.transport.set_protocol(c)
        c.transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        u.transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        if first:
            u.transport.write(first)
        if u.early:
            c.transport.write(bytes(u.early))
            u.early.clear()
            u.transport.resume_reading()
        if u.eof_pending:
            u.eof_received()
        if u.lost:
            c.transport.close()
        if c.eof_pending:
            c.eof_received()
        c.transport.resume_reading()
        if self.idle_timeout:
            self._idle_handle = self.loop.call_later(self.idle_timeout, self._idle_check)

    def _idle_check(self) -> None:
        if self.done.done():
            return
        due = self.last + self.idle_timeout
        if due > self.loop.time():   # a byte moved meanwhile: look again when it would be due
            self._idle_handle = self.loop.call_at(due, self._idle_check)
            return
        self.idle_expired = True
        self.abort()

    def abort(self) -> None:
        for side in (self.client, self.upstream):
            if side is not None and side.transport is not None and not side.transport.is_closing():
                side.transport.abort()

    def close(self) -> None:
        """Drain: flush what is queued, then close both sides."""
        for side in (self.client, self.upstream):
            if side is not None and side.transport is not None and not side.transport.is_closing():
                side.transport.close()

    def side_lost(self) -> None:
        c, u = self.client, self.upstream
        if (c.lost and (u is None or u.lost)) and not self.done.done():
            if self._idle_handle is not None:
                self._idle_handle.cancel()
            self.done.set_result(None)


class _Side(asyncio.Protocol):
    def __init__(self, relay: Relay, transport, on_bytes) -> None:
        self.relay = relay
        self.transport = transport
        self.on_bytes = on_bytes
        self.peer: _Side | None = None
        self.eof = False
        self.eof_pending = False   # the client half-closed before the relay started
        self.lost = False
        self.early = bytearray()   # upstream bytes that came before the relay started

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.on_bytes(len(data))
        self.relay.last = self.relay.loop.time()
        peer = self.peer
        if peer is None:
            self.early += data
            if len(self.early) > HIGH_WATER:
                self.transport.pause_reading()
        elif not peer.transport.is_closing():
            peer.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is None:
            self.eof_pending = True
            return True
        if not peer.transport.is_closing():
            if peer.eof:                      # both halves closed: done
                peer.transport.close()
                self.transport.close()
                return False
            if peer.transport.can_write_eof():
                peer.transport.write_eof()
        return True                           # keep our write half: the peer may still answer

    def pause_writing(self) -> None:          # our transport's buffer is full: stop the feeder
        if self.peer is not None and not self.peer.transport.is_closing():
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and not self.peer.transport.is_closing():
            self.peer.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.relay.last = self.relay.loop.time()
        peer = self.peer
        if peer is not None and not peer.transport.is_closing():
            if exc is None:
                peer.transport.close()        # flush what we sent it, then close
            else:
                peer.transport.abort()        # a reset is passed on as a reset
        self.relay.side_lost()
