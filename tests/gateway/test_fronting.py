"""Issue #10 items 1 and 7 (gate): no key under another host's name, only steered
connections served, a denied Host on a transparent keep-alive connection is answered.

Against the hostile upstream (testbed/hostile.py), which logs every request it gets:
a refused request must not appear there at all."""
from __future__ import annotations

import socket
import time
import uuid

import pytest

from tests.gateway import rawclient
from tests.gateway.hostile_env import (H, KEY_A, KEY_B, MODES, OTHER, SINK, assert_never_leaked, audit_reason,
                                       hostile_env, parse_h1)

pytestmark = pytest.mark.netns

TPORT = 18071     # = testbed.hostile.EXTRA_PORTS: if the gateway dials it, the hostile upstream logs it


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    with hostile_env(lab, tmp_path_factory.mktemp("fronting"), tport=TPORT, prefix="cf") as e:
        yield e


def _marker(tag: str) -> str:
    return f"/front-{tag}-{uuid.uuid4().hex[:8]}"


def _assert_refused_unseen(env, resp, marker, status: int, reason: str) -> None:
    assert resp.status == status and resp.reason == reason, resp
    assert env.hostile.requests(marker) == [], "the upstream received a refused request"
    assert_never_leaked(resp.wire, KEY_A, KEY_B, what="refusal")
    rec = audit_reason(env.gw, reason, marker)
    assert KEY_A not in str(rec)


H1_FRONTS = {
    # absolute-form target names the tunnel host, Host names another bound host
    "absolute_target_other_host": dict(target_fmt="https://" + H + "{path}", host_header=OTHER),
    "origin_form_other_host": dict(target_fmt="{path}", host_header=OTHER),
    "origin_form_unbound_host": dict(target_fmt="{path}", host_header=SINK),
    "host_other_port": dict(target_fmt="{path}", host_header=H + ":8443"),
    "absolute_target_other_port": dict(target_fmt="https://" + H + ":8443{path}", host_header=H + ":8443"),
    "absolute_other_host_host_ok": dict(target_fmt="https://" + OTHER + "{path}", host_header=H),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", sorted(H1_FRONTS))
def test_h1_fronting_in_intercepted_tunnel_is_421(env, mode, shape):
    sb = env.sandbox(mode)
    marker = _marker(shape)
    spec = H1_FRONTS[shape]
    raw = sb.request_bytes("https", H, marker, target=spec["target_fmt"].format(path=marker),
                           host_header=spec["host_header"])
    resp = sb.exchange("https", H, raw)
    _assert_refused_unseen(env, resp, marker, 421, "authority_mismatch")


@pytest.mark.parametrize("mode", MODES)
def test_two_host_headers_are_400_duplicate_host(env, mode):
    sb = env.sandbox(mode)
    marker = _marker("duphost")
    raw = sb.request_bytes("https", H, marker, headers=[("Host", OTHER)])
    assert raw.count(b"Host:") == 2
    resp = sb.exchange("https", H, raw)
    _assert_refused_unseen(env, resp, marker, 400, "duplicate_host")


H2_FRONTS = {
    "authority_other_host": [(":authority", OTHER)],
    "authority_other_port": [(":authority", H + ":8443")],
    "host_header_differs": [(":authority", H), ("host", OTHER)],
    "host_header_other_port": [(":authority", H), ("host", H + ":8443")],
}


def _h2_headers(marker: str, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
    pseudo = [(":method", "GET"), (":scheme", "https"), (":path", marker)]
    return pseudo[:2] + [h for h in extra if h[0] == ":authority"] + pseudo[2:] + \
        [h for h in extra if h[0] != ":authority"] + [("user-agent", "hostile-test")]


# A `host` header that disagrees with :authority never reaches the gate: the HTTP/2 stack
# (h2's header validation inside mitmproxy) ends the connection with a protocol error first.
H2_STACK_REFUSED = {"host_header_differs", "host_header_other_port"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", sorted(H2_FRONTS))
def test_h2_fronting_in_intercepted_tunnel_is_421(env, mode, shape):
    sb = env.sandbox(mode)
    marker = _marker("h2-" + shape)
    resp = sb.h2(H, _h2_headers(marker, H2_FRONTS[shape]))
    if shape in H2_STACK_REFUSED:
        assert resp.status == 0 and not resp.headers, resp   # no response at all: the stack sent GOAWAY
        assert env.hostile.requests(marker) == [], "the upstream received a refused request"
        assert_never_leaked(resp.wire, KEY_A, KEY_B, what="refusal")
        return
    _assert_refused_unseen(env, resp, marker, 421, "authority_mismatch")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("host_header,absolute", [(H, False), (H + ":443", False), (H, True), ("HOSTILE.Allowed.Test", False)])
def test_matching_host_is_served_and_upstream_gets_the_checked_host(env, mode, host_header, absolute):
    sb = env.sandbox(mode)
    marker = _marker("ok")
    target = f"https://{H}{marker}" if absolute else marker
    resp = sb.exchange("https", H, sb.request_bytes("https", H, marker, target=target, host_header=host_header))
    assert resp.status == 200, resp
    got = env.hostile.requests(marker)
    assert len(got) == 1, got
    # exactly one Host, naming the tunnel's host (port 443 or none): what the gateway checked
    assert len(got[0]["host"]) == 1, got[0]["host"]
    name, _, port = got[0]["host"][0].partition(":")
    assert name.lower() == H and port in ("", "443"), got[0]["host"]
    assert ("Authorization", f"Bearer {KEY_A}") in [tuple(h) for h in got[0]["headers"]]
    assert_never_leaked(resp.wire, KEY_A, what="echo of the injected request")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("authority", [H, H + ":443"])
def test_h2_matching_authority_is_served(env, mode, authority):
    sb = env.sandbox(mode)
    marker = _marker("h2ok")
    resp = sb.h2(H, _h2_headers(marker, [(":authority", authority)]))
    assert resp.status == 200, resp
    got = env.hostile.requests(marker)
    assert len(got) == 1, got
    seen = got[0]["authority"] or (got[0]["host"] or [None])[0]
    assert seen and seen.split(":")[0] == H and seen.partition(":")[2] in ("", "443"), got[0]
    assert_never_leaked(resp.wire, KEY_A, what="h2 echo")


# ------------------------------------------------------------------ item 7 (gate parts)
def _hostile_saw_since(env, t0: float, server: str) -> list[dict]:
    return [e for e in env.hostile.entries() if e["event"] == "connect" and e["server"] == server and e["t"] >= t0]


@pytest.mark.parametrize("tls", [False, True], ids=["http", "tls"])
def test_direct_connection_to_transparent_port_is_refused_not_dialled(env, tls):
    sb = env.sandbox("transparent")
    marker = _marker("direct")
    t0 = time.time() - 0.5
    s = sb.direct_gateway(TPORT)
    wire = b""
    try:
        if tls:
            import ssl
            ctx = ssl._create_unverified_context()
            try:
                with ctx.wrap_socket(s, server_hostname=SINK) as t:
                    t.sendall(f"GET {marker} HTTP/1.1\r\nHost: {SINK}\r\nConnection: close\r\n\r\n".encode())
                    wire = rawclient.recv_all(t, 5)
            except (ssl.SSLError, OSError):
                pass
        else:
            s.sendall(f"GET {marker} HTTP/1.1\r\nHost: {SINK}\r\nConnection: close\r\n\r\n".encode())
            wire = rawclient.recv_all(s, 5)
    finally:
        s.close()
    resp = parse_h1(wire)
    assert resp.status in (0, 403), resp           # a 403 page or a reset, never an answer from upstream
    if resp.status == 403:
        assert resp.reason == "not_steered", resp
    env.gw.wait_record(lambda r: r.get("reason") == "not_steered" and r.get("sandbox") == "sb-h1", timeout=10)
    assert env.hostile.requests(marker) == []
    assert _hostile_saw_since(env, t0, f"198.18.0.32:{TPORT}") == [], "the gateway dialled the upstream"


def _read_one_response(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """One Content-Length framed response from a keep-alive connection (bounded)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            resp = parse_h1(data)
            cl = resp.header("Content-Length")
            if cl is not None and len(data) >= end + 4 + int(cl):
                return data
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, OSError):
            break
        if not chunk:
            break
        data += chunk
    return data


def test_keepalive_denied_host_gets_403_then_close(env):
    sb = env.sandbox("transparent")
    marker = _marker("ka")
    s = sb.plain(SINK)
    try:
        s.sendall(f"GET {marker}-1 HTTP/1.1\r\nHost: {SINK}\r\n\r\n".encode())
        first = parse_h1(_read_one_response(s))
        assert first.status == 200, first
        s.sendall(f"GET {marker}-2 HTTP/1.1\r\nHost: denied.test\r\n\r\n".encode())
        second = parse_h1(_read_one_response(s))
        assert second.status == 403, second
        s.settimeout(3)
        try:
            rest = s.recv(65536)
        except socket.timeout:
            rest = None
        assert rest == b"", f"connection left open after the 403 ({rest!r})"
    finally:
        s.close()
    assert env.hostile.requests(marker + "-2") == []
