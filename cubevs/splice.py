"""Kernel splice of TCP socket pairs (cubevs/bpf/splice.c): payload moves socket to socket in the
kernel, never through userspace.  This module is the control plane of one process's splice maps.

A pair's life, in this order (the order is what keeps every byte in place):
  add(a, b)    cookies → links; both sockets join `targets`.  Nothing is redirected yet: each
               socket's receive path is the normal one, so bytes arriving stay in its queue.
  (caller)     writes what it already holds for either side and waits until it is in the kernel.
  arm(pair)    both join `spliced`: from now on each socket's bytes go out of its peer.  Bytes that
               were queued before are pushed through the verdict at once (SO_RCVLOWAT makes TCP
               call data_ready again; without it they wait for the next segment: a deadlock when
               the peer waits for them).
  counters()   bytes handed over per direction, bytes dropped.
  written(fd)  bytes the kernel has put into a socket's TCP stream (acked + in the send queue):
               a redirected byte counted by the verdict is only in the peer's stream once this
               has caught up, so a FIN (shutdown) is sent only then.
  set_budget   bytes a side may hand over before the verdict alerts userspace (ring buffer,
               dispatched to Pair.on_alert by watch_alerts): the kernel has no backpressure of
               its own for a redirect into a full peer, so the relay holds such a side.
  remove(pair) out of both maps (redirects still queued for a socket are dropped with it: remove
               only once flushed, or when resetting), links deleted.  Always before close().
Userspace keeps everything else: EOF and reset propagation, idle timeout, closing.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import termios
from dataclasses import dataclass
from pathlib import Path

from cubevs import build as _build
from cubevs import libbpf

SO_COOKIE = 57                 # <asm-generic/socket.h>
_TCP_INFO_LEN = 232            # struct tcp_info (uapi 6.x)
_TCPI_BYTES_ACKED = 120        # offsetof(struct tcp_info, tcpi_bytes_acked)


class SpliceError(OSError):
    pass


class _Link(ctypes.Structure):   # struct link in splice.c
    _fields_ = [("peer", ctypes.c_uint64), ("bytes", ctypes.c_uint64), ("dropped", ctypes.c_uint64)]


class _Budget(ctypes.Structure):   # struct budget in splice.c
    _fields_ = [("limit", ctypes.c_uint64), ("alerted", ctypes.c_uint64)]


NO_LIMIT = (1 << 64) - 1


@dataclass
class Pair:
    a_fd: int
    b_fd: int
    a_cookie: int
    b_cookie: int
    armed: bool = False
    removed: bool = False
    on_alert: object = None    # called (no arguments) when a side passes its budget or drops bytes


@dataclass(frozen=True)
class Counters:
    a_to_b: int       # bytes received on a and handed to b
    b_to_a: int
    dropped: int      # bytes the verdict could not hand over: the streams are broken


def socket_cookie(fd: int) -> int:
    s = socket.socket(fileno=os.dup(fd))
    try:
        return struct.unpack("=Q", s.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]
    finally:
        s.close()


def written(sock: socket.socket) -> int:
    """Bytes this TCP socket has put into its stream: acked by the peer + still in the send queue."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    if len(info) < _TCPI_BYTES_ACKED + 8:
        raise SpliceError(95, "tcp_info without tcpi_bytes_acked")
    acked = struct.unpack_from("=Q", info, _TCPI_BYTES_ACKED)[0]
    buf = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)   # SIOCOUTQ: unacked + unsent
    return acked + struct.unpack("=i", buf)[0]


def kick(sock: socket.socket) -> None:
    """Make TCP call data_ready now (tcp_set_rcvlowat → tcp_data_ready): queued bytes go through
    the verdict instead of waiting for the next segment."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


class Splicer:
    """One process's splice program and maps.  Not thread-safe (one event loop owns it)."""

    written = staticmethod(written)   # the relay (which may not import cubevs) reaches them here
    kick = staticmethod(kick)

    def __init__(self, obj_path: str | os.PathLike | None = None):
        path = Path(obj_path) if obj_path else _build.build(name="splice")
        self._obj = libbpf.LoadedObject(path)
        try:
            u64 = ctypes.c_uint64
            self._targets = libbpf.Map(os.dup(self._obj.map_fd("targets")), u64, u64)
            self._spliced = libbpf.Map(os.dup(self._obj.map_fd("spliced")), u64, u64)
            self._links = libbpf.Map(os.dup(self._obj.map_fd("links")), u64, _Link)
            self._budgets = libbpf.Map(os.dup(self._obj.map_fd("budgets")), u64, _Budget)
            self._alerts_fd = os.dup(self._obj.map_fd("alerts"))
            self._alerts = libbpf.RingBuffer(self._alerts_fd)
            libbpf.prog_attach(self._obj.prog_fd("splice_verdict"), self._spliced.fd,
                               libbpf.BPF_SK_SKB_STREAM_VERDICT)
        except BaseException:
            self.close()
            raise
        self.pairs = 0
        self._by_cookie: dict[int, Pair] = {}
        self._alert_loop = None

    # ------------------------------------------------------------------ pairs
    def add(self, a_fd: int, b_fd: int) -> Pair:
        """Link a and b and make each a redirect target; raises SpliceError (nothing left behind)
        when either cannot join (not an established TCP socket, map full, ...)."""
        pair = Pair(a_fd, b_fd, socket_cookie(a_fd), socket_cookie(b_fd))
        done = []   # (map, cookie) added so far: a failure takes back exactly these
        steps = ((self._links, pair.a_cookie, _Link(peer=pair.b_cookie)),
                 (self._links, pair.b_cookie, _Link(peer=pair.a_cookie)),
                 (self._budgets, pair.a_cookie, _Budget(limit=NO_LIMIT)),
                 (self._budgets, pair.b_cookie, _Budget(limit=NO_LIMIT)),
                 (self._targets, pair.a_cookie, ctypes.c_uint64(a_fd)),
                 (self._targets, pair.b_cookie, ctypes.c_uint64(b_fd)))
        try:
            for m, cookie, value in steps:
                m.update(ctypes.c_uint64(cookie), value, libbpf.BPF_NOEXIST)
                done.append((m, cookie))
        except OSError as e:
            for m, cookie in reversed(done):
                m.delete(ctypes.c_uint64(cookie))
            raise SpliceError(e.errno or 22, f"splice add: {e.strerror or e}") from None
        self.pairs += 1
        self._by_cookie[pair.a_cookie] = self._by_cookie[pair.b_cookie] = pair
        return pair

    # ------------------------------------------------------------ flow control
    def set_budget(self, pair: Pair, side: str, limit: int) -> None:
        """Side "a"/"b" may hand over until its counter passes `limit`; then one alert."""
        cookie = pair.a_cookie if side == "a" else pair.b_cookie
        self._budgets.update(ctypes.c_uint64(cookie), _Budget(limit=min(limit, NO_LIMIT)))

    def watch_alerts(self, loop) -> None:
        """Call each pair's on_alert from `loop` when its socket passes its budget (idempotent).
        The alert ring buffer's fd is readable when records are waiting."""
        if self._alert_loop is None:
            loop.add_reader(self._alerts_fd, self.dispatch_alerts)
            self._alert_loop = loop

    def dispatch_alerts(self, max_records: int = 4096) -> int:
        records = self._alerts.drain(max_records)
        due = {id(p): p for p in (self._by_cookie.get(struct.unpack("=Q", r[:8])[0]) for r in records)
               if p is not None and not p.removed and p.on_alert is not None}
        for p in due.values():
            p.on_alert()
        return len(records)

    def arm(self, pair: Pair, a_sock: socket.socket, b_sock: socket.socket) -> None:
        """From now on the kernel relays.  On SpliceError the caller must reset both sockets:
        one side may already have handed bytes over."""
        try:
            self._spliced.update(ctypes.c_uint64(pair.a_cookie), ctypes.c_uint64(pair.a_fd), libbpf.BPF_NOEXIST)
            pair.armed = True
            self._spliced.update(ctypes.c_uint64(pair.b_cookie), ctypes.c_uint64(pair.b_fd), libbpf.BPF_NOEXIST)
            kick(a_sock)
            kick(b_sock)
        except OSError as e:
            raise SpliceError(e.errno or 22, f"splice arm: {e.strerror or e}") from None

    def hold(self, pair: Pair, side: str) -> None:
        """Stop relaying what side "a" or "b" receives: its bytes stay in its receive queue, so TCP
        flow control holds its sender back.  The kernel itself does not: a redirect into a peer
        whose send buffer is full is queued on the peer's psock without bound (the relay holds a
        side whose bytes are not yet in the peer's stream beyond a limit)."""
        self._spliced.delete(ctypes.c_uint64(pair.a_cookie if side == "a" else pair.b_cookie))

    def release(self, pair: Pair, side: str, sock: socket.socket) -> None:
        """Relay side "a"/"b" again; what queued meanwhile goes first."""
        cookie, fd = (pair.a_cookie, pair.a_fd) if side == "a" else (pair.b_cookie, pair.b_fd)
        try:
            self._spliced.update(ctypes.c_uint64(cookie), ctypes.c_uint64(fd), libbpf.BPF_ANY)
            kick(sock)
        except OSError as e:
            raise SpliceError(e.errno or 22, f"splice release: {e.strerror or e}") from None

    def disarm(self, pair: Pair) -> None:
        """Stop relaying (bytes arriving from now on stay in the sockets' receive queues)."""
        self._spliced.delete(ctypes.c_uint64(pair.a_cookie))
        self._spliced.delete(ctypes.c_uint64(pair.b_cookie))
        pair.armed = False

    def counters(self, pair: Pair) -> Counters:
        a = self._links.lookup(ctypes.c_uint64(pair.a_cookie))
        b = self._links.lookup(ctypes.c_uint64(pair.b_cookie))
        if a is None or b is None:
            raise SpliceError(2, "splice pair has no links")
        return Counters(a.bytes, b.bytes, a.dropped + b.dropped)

    def remove(self, pair: Pair) -> None:
        """Out of every map (idempotent).  Call before the sockets are closed."""
        if pair.removed:
            return
        self.disarm(pair)
        self._drop(pair)
        pair.removed = True
        self.pairs -= 1

    def _drop(self, pair: Pair) -> None:
        for cookie in (pair.a_cookie, pair.b_cookie):
            self._targets.delete(ctypes.c_uint64(cookie))
            self._links.delete(ctypes.c_uint64(cookie))
            self._budgets.delete(ctypes.c_uint64(cookie))
            if self._by_cookie.get(cookie) is pair:
                del self._by_cookie[cookie]

    def close(self) -> None:
        if getattr(self, "_alert_loop", None) is not None:
            self._alert_loop.remove_reader(self._alerts_fd)
            self._alert_loop = None
        if getattr(self, "_alerts", None) is not None:
            self._alerts.close()
            self._alerts = None
        if getattr(self, "_alerts_fd", None) is not None:
            os.close(self._alerts_fd)
            self._alerts_fd = None
        for m in ("_targets", "_spliced", "_links", "_budgets"):
            mp = getattr(self, m, None)
            if mp is not None:
                mp.close()
        if getattr(self, "_obj", None) is not None:
            self._obj.close()
            self._obj = None
