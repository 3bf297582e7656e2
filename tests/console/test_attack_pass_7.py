"""Attack pass 7 on the daemon's browser and admin APIs.

Pass 6 gave request bodies without valid credentials (the login form) a small budget of their
own (1 MiB, 64 KiB each). Anyone on the host could still fill it: 16 connections declaring a
64 KiB body and sending nothing held it for the body timeout (300 s), and meanwhile every
login to the console (and every other anonymous body to the vault or policy API) was 503.
Now an anonymous body has ANON_BODY_SECONDS to arrive, and a new one takes the place of the
oldest still being read: a login form, which arrives with its headers, always gets in."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

import httpkit
import httpkit.server
from tests.console.consolekit import ConsoleDaemon, first_line as _first_line
from tests.httpkit.conftest import served
from tests.httpkit.toyapp import TOKEN, make


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = ConsoleDaemon(tmp_path_factory.mktemp("console-attack7")).start()
    try:
        yield d
    finally:
        d.stop()


def _idle_bodies(port: int, path: str, n: int, length: int, headers: str = "") -> list[socket.socket]:
    """Connections that declare a body of `length` bytes, then send nothing."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
                  f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {length}\r\n\r\n".encode())
        out.append(s)
    time.sleep(0.3)                    # the server has read every head
    return out


def test_idle_anonymous_bodies_cannot_keep_an_operator_from_logging_in(daemon):
    n = httpkit.server.ANON_BUDGET // httpkit.server.ANON_MAX_BODY
    socks = _idle_bodies(daemon.port, "/login", n + 4, httpkit.server.ANON_MAX_BODY)
    try:
        # before: the first n held the whole anonymous budget; the login's own body was 503
        assert daemon.login() is not None
        # the oldest (as many as came after them: 4 heads and the login's form) were told why
        # they were dropped; the others are still being waited for. Oldest by the server's reading:
        # under load that need not be the order the heads were sent in.
        lines = [_first_line(s, 0.5) for s in socks]
        assert sorted(lines, reverse=True) == [b"HTTP/1.1 503 Service Unavailable"] * 5 + [b""] * (n - 1), lines
    finally:
        for s in socks:
            s.close()
    assert daemon.login() is not None


@pytest.fixture
def toy_with_admit():
    """The kit's toy API with a bearer-token admit, as every API of the daemon is served."""
    def start():
        return httpkit.serve(make({}, []), max_body=1 << 20,
                             admit=httpkit.bearer_admit(lambda t: "tester" if t == TOKEN else None))
    with served(start) as srv:
        yield srv


def test_an_anonymous_body_that_does_not_arrive_in_time_is_dropped(toy_with_admit, monkeypatch):
    monkeypatch.setattr(httpkit.server, "ANON_BODY_SECONDS", 0.5, raising=False)
    srv = toy_with_admit
    [slow] = _idle_bodies(srv.port, "/keys", 1, 100)
    try:
        t0 = time.monotonic()
        assert _first_line(slow, 5.0) == b"HTTP/1.1 408 Request Timeout"    # before: held 300 s
        assert time.monotonic() - t0 < 3.0
    finally:
        slow.close()
    # one that arrives in time still reaches its handler (which answers 401 and audits it)
    r = httpx.post(f"http://127.0.0.1:{srv.port}/keys", content=b"{}", timeout=5)
    assert r.status_code == 401, r.text
    # and a body with valid credentials is no anonymous body: it keeps the (long) body timeout
    [admitted] = _idle_bodies(srv.port, "/keys", 1, 100, f"Authorization: Bearer {TOKEN}\r\n")
    try:
        assert _first_line(admitted, 1.5) == b""
    finally:
        admitted.close()


# ------------------------------------------------------------------ connections held at once

def _open(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def _still_open(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        return s.recv(1) != b""
    except TimeoutError:
        return True
    except OSError:
        return False


@pytest.fixture
def capped_toy():
    def start():
        return httpkit.serve(make({}, []), max_body=1 << 20, max_connections=8,
                             admit=httpkit.bearer_admit(lambda t: "tester" if t == TOKEN else None))
    with served(start) as srv:
        yield srv


def test_idle_connections_cannot_take_every_descriptor_of_the_daemon(capped_toy):
    """FINDING: an httpkit server accepted connections without a bound and kept one that sent
    nothing for 300 s: anyone on the host could open connections until the daemon (every API
    of it, its sandbox DNS, its state files) had no descriptor left. Now a server holds at most
    max_connections; at the cap a new one takes the place of the one idle the longest, and a
    connection in the middle of a request is never given up."""
    srv = capped_toy
    # busy: an admitted request whose body is still coming
    busy = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    body = b'{"name": "abc", "value": "v"}'
    busy.sendall(f"POST /keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:5])
    time.sleep(0.2)
    idle = _open(srv.port, 30)
    try:
        time.sleep(0.3)
        open_now = sum(_still_open(s) for s in idle)
        assert open_now <= 7, open_now                    # before: all 30 (and as many as asked)
        assert _still_open(idle[-1])                      # the newest took the place of the oldest
        r = httpx.post(f"http://127.0.0.1:{srv.port}/keys", content=b"{}", timeout=5)
        assert r.status_code == 401, r.text               # a real request is served at once
        busy.sendall(body[5:])                            # the busy one was not given up
        busy.settimeout(5)
        assert busy.recv(4096).startswith(b"HTTP/1.1 201"), "the busy connection was closed"
    finally:
        busy.close()
        for s in idle:
            s.close()
