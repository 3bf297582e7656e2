"""cubevs.splice with real BPF and real TCP sockets on loopback.

Two connections, client ⇄ proxy_c and proxy_u ⇄ server; the proxy's two sockets are spliced
in the kernel.  What the tests hold: every byte passes both ways, in order, exactly once;
the counters are exact; bytes queued before arm() are not stuck; a half-close is seen by
userspace (peek) with every byte before it counted; a peer that does not read holds the
sender back (bounded); remove() gives the sockets back to userspace; a socket that cannot
join leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from cubevs.splice import Splicer, SpliceError, written


@pytest.fixture
def splicer():
    sp = Splicer()
    yield sp
    sp.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        a = socket.create_connection(lst.getsockname(), timeout=5)
        b, _ = lst.accept()
    b.settimeout(5)
    return a, b


class Lab:
    """client → proxy_c (spliced) proxy_u → server."""

    def __init__(self):
        self.client, self.proxy_c = _tcp_pair()
        self.proxy_u, self.server = _tcp_pair()

    def close(self):
        for s in (self.client, self.proxy_c, self.proxy_u, self.server):
            s.close()


@pytest.fixture
def lab():
    lab = Lab()
    yield lab
    lab.close()


def _splice(sp: Splicer, lab: Lab):
    pair = sp.add(lab.proxy_c.fileno(), lab.proxy_u.fileno())
    sp.arm(pair, lab.proxy_c, lab.proxy_u)
    return pair


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(1 << 20, n - len(out)))
        assert chunk, f"EOF after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def _eventually(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.005)
    assert pred()


def _peek(sock: socket.socket):
    timeout = sock.gettimeout()
    sock.settimeout(0)          # a socket with a timeout waits even with MSG_DONTWAIT
    try:
        return sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return None
    finally:
        sock.settimeout(timeout)


def test_bytes_pass_both_ways_exactly_and_counters_are_exact(splicer, lab):
    up = os.urandom(6 * 1024 * 1024 + 17)
    down = os.urandom(3 * 1024 * 1024 + 5)
    lab.client.sendall(b"queued-before-arm")       # in proxy_c's receive queue before the splice
    time.sleep(0.02)
    pair = _splice(splicer, lab)
    assert _recv_exactly(lab.server, 17) == b"queued-before-arm"   # not stuck until the next segment

    got = {}
    readers = [threading.Thread(target=lambda: got.__setitem__("up", _recv_exactly(lab.server, len(up)))),
               threading.Thread(target=lambda: got.__setitem__("down", _recv_exactly(lab.client, len(down))))]
    for t in readers:
        t.start()
    senders = [threading.Thread(target=lab.client.sendall, args=(up,)),
               threading.Thread(target=lab.server.sendall, args=(down,))]
    for t in senders:
        t.start()
    for t in senders + readers:
        t.join(30)
    assert hashlib.sha256(got["up"]).digest() == hashlib.sha256(up).digest()
    assert hashlib.sha256(got["down"]).digest() == hashlib.sha256(down).digest()
    n = splicer.counters(pair)
    assert (n.a_to_b, n.b_to_a, n.dropped) == (17 + len(up), len(down), 0)
    assert _peek(lab.proxy_c) is None and _peek(lab.proxy_u) is None   # nothing reached userspace
    splicer.remove(pair)


def test_half_close_is_seen_after_every_byte_and_the_other_way_still_flows(splicer, lab):
    base = written(lab.proxy_u)
    pair = _splice(splicer, lab)
    lab.client.sendall(b"request")
    lab.client.shutdown(socket.SHUT_WR)
    _eventually(lambda: _peek(lab.proxy_c) == b"")        # EOF, as the relay sees it
    assert splicer.counters(pair).a_to_b == 7               # every byte before the FIN is counted
    _eventually(lambda: written(lab.proxy_u) == base + 7)   # ... and in the peer's stream: FIN may follow
    lab.proxy_u.shutdown(socket.SHUT_WR)
    assert _recv_exactly(lab.server, 7) == b"request"
    assert lab.server.recv(1) == b""                        # the half-close passed on
    lab.server.sendall(b"response after the half-close")
    assert _recv_exactly(lab.client, 29) == b"response after the half-close"
    assert splicer.counters(pair).b_to_a == 29
    splicer.remove(pair)


BLOCK = os.urandom(256 * 1024)


def _send_until_blocked(sock: socket.socket, limit: int) -> int:
    """Whole blocks sent before a send waits 0.5 s (the block that timed out is not sent whole:
    callers read what they count and then check order with a tail)."""
    sock.settimeout(0.5)
    sent = 0
    try:
        while sent < limit:                                 # bounded in bytes and (timeout) time
            sock.sendall(BLOCK)
            sent += len(BLOCK)
    except TimeoutError:
        pass
    return sent


def test_the_kernel_alone_queues_past_a_full_peer(splicer, lab):
    """The premise of hold(): a redirect into a peer whose send buffer is full is queued on the
    peer's psock (not charged to the sender's receive buffer), so the sender is not held back by
    the kernel.  If a kernel changes that, this fails and the relay's throttle could go."""
    pair = _splice(splicer, lab)
    sent = _send_until_blocked(lab.client, 48 * 1024 * 1024)
    assert sent == 48 * 1024 * 1024                         # far past every socket buffer on the way
    assert _recv_exactly(lab.server, sent) == BLOCK * (sent // len(BLOCK))   # ... and none of it lost
    assert splicer.counters(pair) == type(splicer.counters(pair))(sent, 0, 0)
    splicer.remove(pair)


def test_hold_makes_the_sender_wait_and_release_resumes_in_order(splicer, lab):
    pair = _splice(splicer, lab)
    lab.client.sendall(b"a" * 1000)
    assert _recv_exactly(lab.server, 1000) == b"a" * 1000
    splicer.hold(pair, "a")
    sent = _send_until_blocked(lab.client, 48 * 1024 * 1024)
    assert sent < 16 * 1024 * 1024                          # TCP flow control: socket buffers, no more
    assert splicer.counters(pair).a_to_b == 1000            # nothing handed over while held
    splicer.release(pair, "a", lab.proxy_c)
    assert _recv_exactly(lab.server, sent) == BLOCK * (sent // len(BLOCK))   # in order, none lost
    splicer.remove(pair)


def test_remove_gives_the_sockets_back_to_userspace(splicer, lab):
    pair = _splice(splicer, lab)
    lab.client.sendall(b"spliced")
    assert _recv_exactly(lab.server, 7) == b"spliced"
    splicer.remove(pair)
    splicer.remove(pair)                                    # idempotent
    assert splicer.pairs == 0
    lab.client.sendall(b"userspace")
    lab.proxy_c.settimeout(5)
    assert _recv_exactly(lab.proxy_c, 9) == b"userspace"    # stays with the proxy now
    lab.server.setblocking(False)
    with pytest.raises(BlockingIOError):
        lab.server.recv(1)
    # the same sockets can be spliced again
    pair = _splice(splicer, lab)
    lab.client.sendall(b"again")
    lab.server.settimeout(5)
    assert _recv_exactly(lab.server, 5) == b"again"
    splicer.remove(pair)


def test_a_socket_that_cannot_join_leaves_nothing_behind(splicer, lab):
    unconnected = socket.socket()
    try:
        with pytest.raises(SpliceError):
            splicer.add(lab.proxy_c.fileno(), unconnected.fileno())
    finally:
        unconnected.close()
    assert splicer.pairs == 0
    pair = _splice(splicer, lab)                            # proxy_c was taken back out: it joins again
    lab.client.sendall(b"ok")
    assert _recv_exactly(lab.server, 2) == b"ok"
    splicer.remove(pair)


def test_bytes_the_verdict_drops_are_counted(splicer, lab):
    """A peer that left the maps (cannot happen in the relay, which removes both): the stream is
    broken, and the counter says so, so the relay resets instead of passing a torn stream on."""
    pair = _splice(splicer, lab)
    splicer._targets.delete(__import__("ctypes").c_uint64(pair.b_cookie))
    lab.client.sendall(b"lost")
    _eventually(lambda: splicer.counters(pair).dropped == 4)
    assert splicer.counters(pair).a_to_b == 0
    splicer.remove(pair)


def test_a_side_past_its_budget_alerts_once_per_budget(splicer, lab):
    """The relay's flow control: the verdict tells userspace at once (ring buffer) when a side
    has handed over more than its budget; one alert per budget, again after a new one."""
    import asyncio
    pair = _splice(splicer, lab)
    alerts = []
    pair.on_alert = lambda: alerts.append(splicer.counters(pair).a_to_b)
    splicer.set_budget(pair, "a", 10_000)
    lab.client.sendall(b"x" * 5_000)
    assert _recv_exactly(lab.server, 5_000)
    assert splicer.dispatch_alerts() == 0 and alerts == []          # within the budget
    for _ in range(4):
        lab.client.sendall(b"y" * 5_000)
        _recv_exactly(lab.server, 5_000)
    assert splicer.dispatch_alerts() == 1 and len(alerts) == 1 and alerts[0] > 10_000
    splicer.set_budget(pair, "a", splicer.counters(pair).a_to_b + 1_000)
    lab.client.sendall(b"z" * 2_000)
    _recv_exactly(lab.server, 2_000)
    loop = asyncio.new_event_loop()                                  # the relay's way: a reader on the fd
    try:
        splicer.watch_alerts(loop)
        loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        splicer.close()                                              # removes the reader first
        loop.close()
    assert len(alerts) == 2
