"""Plain HTTP on the fast path (egress/fastpath/plain.py), in a real lab, both modes.

Requests are sent as raw bytes from the sandbox's side; what the upstream actually
received is read from the hostile upstream's request log (testbed/hostile.py), so a
smuggled second request or a leaked header would show there.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import uuid

import pytest

from testbed.hostile import spawn_upstream
from tests.faults.helpers import eventually, proc_rss_kib
from tests.gateway import rawclient
from tests.gateway.hostile_env import MODES, SINK, Response, hostile_env, parse_h1

_OFF = ("false", "0", "no")
pytestmark = [pytest.mark.netns, pytest.mark.skipif(
    os.environ.get("CUBEGATE_PROXY__FAST_PLAIN_HTTP", "").lower() in _OFF
    or os.environ.get("CUBEGATE_PROXY__FAST_PATH", "").lower() in _OFF,
    reason="the fast plain-HTTP path is switched off from the environment")]

TPORT = 18077
MIB = 1 << 20
CUT_HOST, CUT_IP = "cut.allowed.test", "198.18.0.47"     # a test-owned upstream that misbehaves


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    # inspected bodies (the tenant has secrets) up to 512 MiB: the 256 MiB upload is leak-checked as it streams
    with hostile_env(lab, tmp_path_factory.mktemp("fastplain"), tport=TPORT, prefix="cp",
                     settings_extra={"proxy": {"max_body_bytes": 512 * MIB}}) as e:
        yield e


def _marker() -> str:
    return "fp-" + uuid.uuid4().hex[:10]


def _head(sb, path: str, *, host: str = SINK, method: str = "GET", headers=(), target: str | None = None,
          auth: bool = True) -> bytes:
    """One request head as the sandbox sends it in its mode (no Connection header: keep-alive)."""
    explicit = sb.mode == "explicit"
    if target is None:
        target = f"http://{host}{path}" if explicit else path
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"] + [f"{k}: {v}" for k, v in headers]
    if explicit and auth:
        lines.append(sb.auth)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_PIPELINED: dict[int, bytes] = {}   # socket fileno -> bytes read past a response, when pipelined


def _read_response(sock: socket.socket, *, head_request: bool = False, timeout: float = 5.0,
                   pipelined: bool = False) -> Response:
    """Exactly one response (1xx skipped), framed by its own headers; leaves the socket at the next one.
    Bytes after it are an error, unless `pipelined` (more responses are due: they are kept for the next call)."""
    sock.settimeout(timeout)
    buf = _PIPELINED.pop(sock.fileno(), b"")

    def fill(n: int = 1) -> bool:
        nonlocal buf
        data = sock.recv(65536)
        if not data:
            return False
        buf += data
        return True

    wire = b""
    while True:
        while b"\r\n\r\n" not in buf:
            if not fill():
                return parse_h1(wire + buf)
        end = buf.index(b"\r\n\r\n") + 4
        head, buf = buf[:end], buf[end:]
        wire += head
        status = int(head.split(b" ", 2)[1])
        if 100 <= status < 200:
            continue
        break
    hdrs = {k.strip().lower(): v.strip() for k, _, v in
            (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
    body = b""
    if head_request or status in (204, 304):
        pass
    elif b"content-length" in hdrs:
        n = int(hdrs[b"content-length"])
        while len(buf) < n and fill():
            pass
        body, buf = buf[:n], buf[n:]
        wire += body
    elif hdrs.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not re.search(rb"(^|\r\n)0\r\n(.*\r\n)?\r\n", buf, re.S) and fill():
            pass
        wire += buf
        buf = b""
    else:
        while fill():
            pass
        wire += buf
        buf = b""
    if pipelined and buf:
        _PIPELINED[sock.fileno()] = buf
    else:
        assert not buf, f"bytes after the response: {buf[:100]!r}"
    r = parse_h1(wire)
    return r


def _closed(sock: socket.socket, timeout: float = 3.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _received(env, marker: str) -> list[dict]:
    return env.hostile.requests(marker)


def _connects(env, server: str) -> int:
    return len(env.hostile.events("connect", server=server))


# ------------------------------------------------------------------ smuggling
SMUGGLING = {
    # name: (extra head lines, body, expected status)
    "cl_and_te": (["Content-Length: 40", "Transfer-Encoding: chunked"], b"0\r\n\r\nGET /{m}-inner HTTP/1.1\r\n\r\n", 400),
    "duplicate_cl": (["Content-Length: 3", "Content-Length: 3"], b"abc", 400),
    "conflicting_cl": (["Content-Length: 3", "Content-Length: 30"], b"abc", 400),
    "cl_list": (["Content-Length: 3, 3"], b"abc", 400),
    "cl_plus": (["Content-Length: +3"], b"abc", 400),
    "te_gzip_chunked": (["Transfer-Encoding: gzip, chunked"], b"0\r\n\r\n", 400),
    "te_xchunked": (["Transfer-Encoding: xchunked"], b"0\r\n\r\n", 400),
    "te_chunked_identity": (["Transfer-Encoding: chunked, identity"], b"0\r\n\r\n", 400),
    "te_twice": (["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], b"0\r\n\r\n", 400),
    "te_space_before_colon": (["Transfer-Encoding : chunked"], b"0\r\n\r\n", 400),
    "obs_fold": (["X-A: a", " folded: yes"], b"", 400),
    "nul_in_value": (["X-A: a\x00b"], b"", 400),
    "duplicate_host": ([f"Host: {SINK}"], b"", 400),
    "connection_drops_cl": (["Content-Length: 46", "Connection: keep-alive, Content-Length"],
                            b"GET /{m}-inner HTTP/1.1\r\nHost: x\r\n\r\n", 400),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", sorted(SMUGGLING))
def test_smuggling_shapes_are_refused_and_never_reach_the_upstream(env, mode, shape):
    sb = env.sandbox(mode)
    m = _marker()
    extra, body, status = SMUGGLING[shape]
    lines = _head(sb, f"/{m}", method="POST").decode("latin-1").split("\r\n")[:-2]
    raw = ("\r\n".join(lines + extra) + "\r\n\r\n").encode("latin-1") + body.replace(b"{m}", m.encode())
    resp = sb.exchange("http", SINK, raw)
    assert resp.status == status, resp
    assert resp.reason, resp          # the gate's deny shape: X-Cubegate-Reason
    time.sleep(0.2)
    assert _received(env, m) == [], f"{shape}: the upstream received {_received(env, m)}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ["bare_lf", "bare_cr", "bad_chunk_size", "chunk_size_overflow", "chunk_lf_only"])
def test_broken_framing_is_refused(env, mode, shape):
    sb = env.sandbox(mode)
    m = _marker()
    head = _head(sb, f"/{m}", method="POST")
    if shape == "bare_lf":
        raw = head.replace(b"\r\nHost", b"\nHost", 1)
    elif shape == "bare_cr":
        raw = head.replace(b"\r\n\r\n", b"\r\nX-A: a\rb\r\n\r\n")
    else:
        body = {"bad_chunk_size": b"zz\r\nabc\r\n0\r\n\r\n", "chunk_size_overflow": b"fffffffffffffffffff\r\n",
                "chunk_lf_only": b"3\nabc\r\n0\r\n\r\n"}[shape]
        raw = head.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n") + body
    resp = sb.exchange("http", SINK, raw)
    assert resp.status in (0, 400), resp
    for r in _received(env, m):     # a chunked head may be forwarded; its broken body never completes
        assert not r["body_complete"], r


def test_userinfo_in_the_absolute_target_is_refused(env):
    sb = env.sandbox("explicit")
    m = _marker()
    resp = sb.exchange("http", SINK, _head(sb, f"/{m}", target=f"http://user:pw@{SINK}/{m}"))
    assert resp.status == 400 and resp.reason == "invalid_host", resp
    assert _received(env, m) == []


def test_host_must_name_the_target(env):
    sb = env.sandbox("explicit")
    m = _marker()
    resp = sb.exchange("http", SINK, _head(sb, f"/{m}", host="hostile.allowed.test", target=f"http://{SINK}/{m}"))
    assert resp.status == 421 and resp.reason == "authority_mismatch", resp
    t = env.sandbox("transparent")
    resp = t.exchange("http", SINK, _head(t, f"/{m}", host=f"{SINK}:8080"))
    assert resp.status == 421 and resp.reason == "authority_mismatch", resp
    assert _received(env, m) == []


@pytest.mark.parametrize("mode", MODES)
def test_oversized_head_is_431(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    raw = _head(sb, f"/{m}", headers=[("X-Big", "a" * 40000)])
    resp = sb.exchange("http", SINK, raw)
    assert resp.status == 431, resp
    assert _received(env, m) == []


@pytest.mark.parametrize("mode", MODES)
def test_the_upstream_sees_one_interpretation(env, mode):
    """Rebuilt from the parsed pieces: origin form, no proxy headers, chunked without extensions."""
    sb = env.sandbox(mode)
    m = _marker()
    head = _head(sb, f"/{m}?q=1", method="POST", headers=[("Transfer-Encoding", "chunked"), ("X-Keep", "yes")])
    raw = head + b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    with sb.plain(SINK) as s:
        s.sendall(raw)
        resp = _read_response(s)
    assert resp.status == 200, resp
    (got,) = _received(env, m)
    assert got["target"] == f"/{m}?q=1" and got["method"] == "POST"
    names = [k.lower() for k, _ in got["headers"]]
    assert "proxy-authorization" not in names and names.count("host") == 1 and "x-keep" in names
    assert got["body"] == b"hello world" and got["body_complete"]
    assert json.loads(resp.body)["body_len"] == 11


# ------------------------------------------------------------------ keep-alive
@pytest.mark.parametrize("mode", MODES)
def test_many_requests_on_one_connection_use_one_upstream_connection(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    server = f"{env.hostile.hosts[SINK]}:80"
    before = _connects(env, server)
    with sb.plain(SINK) as s:
        for i in range(50):
            s.sendall(_head(sb, f"/{m}-{i}"))
            resp = _read_response(s)
            assert resp.status == 200 and json.loads(resp.body)["target"] == f"/{m}-{i}", resp
    assert len(_received(env, m)) == 50
    assert _connects(env, server) - before == 1


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_requests_are_answered_in_order(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(SINK) as s:
        s.sendall(b"".join(_head(sb, f"/{m}-{i}") for i in range(5)))
        for i in range(5):
            resp = _read_response(s, pipelined=i < 4)
            assert resp.status == 200 and json.loads(resp.body)["target"] == f"/{m}-{i}", resp
    assert sorted(r["target"] for r in _received(env, m)) == [f"/{m}-{i}" for i in range(5)]


@pytest.mark.parametrize("mode", MODES)
def test_a_denied_request_mid_keep_alive_is_403_then_closed(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    denied = "denied.elsewhere.test"
    with sb.plain(SINK) as s:
        s.sendall(_head(sb, f"/{m}-1"))
        assert _read_response(s).status == 200
        s.sendall(_head(sb, f"/{m}-2", host=denied) + _head(sb, f"/{m}-3"))
        resp = _read_response(s)
        assert resp.status == 403 and resp.header("X-Cubegate-Reason") and resp.header("Connection") == "close", resp
        assert json.loads(resp.body)["error"] == "refused_by_cubegate"
        assert _closed(s), "the connection stays open after a refusal"
    assert [r["target"] for r in _received(env, m)] == [f"/{m}-1"]   # the pipelined third never went out
    env.gw.wait_record(lambda r: r["event"] == "request" and r.get("decision") == "deny"
                       and (r.get("path") or "").endswith(f"/{m}-2"))


def test_proxy_authorization_is_checked_on_every_request(env):
    sb = env.sandbox("explicit")
    m = _marker()
    with sb.plain(SINK) as s:
        s.sendall(_head(sb, f"/{m}-1"))
        assert _read_response(s).status == 200
        s.sendall(_head(sb, f"/{m}-2", auth=False))
        resp = _read_response(s)
        assert resp.status == 407 and resp.reason == "proxy_auth_missing", resp
    assert [r["target"] for r in _received(env, m)] == [f"/{m}-1"]


# ----------------------------------------------------------------- framing
@pytest.mark.parametrize("mode", MODES)
def test_head_204_304_have_no_body_and_keep_the_connection_in_step(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(SINK) as s:
        s.sendall(_head(sb, f"/bytes/{m}?n=1000", method="HEAD"))
        resp = _read_response(s, head_request=True)
        assert resp.status == 200 and resp.header("Content-Length") == "1000" and resp.body == b"", resp
        for code in (204, 304):
            s.sendall(_head(sb, f"/status/{m}?code={code}"))
            assert _read_response(s).status == code
        s.sendall(_head(sb, f"/{m}-after"))
        resp = _read_response(s)
        assert resp.status == 200 and json.loads(resp.body)["target"] == f"/{m}-after", resp


@pytest.mark.parametrize("mode", MODES)
def test_chunked_response_with_trailers_is_relayed(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(SINK) as s:
        s.sendall(_head(sb, f"/chunked-split/{m}?trailer=1"))
        resp = _read_response(s)
        assert resp.status == 200 and resp.header("Transfer-Encoding") == "chunked", resp
        assert resp.body == b"chunk key=\n", resp
        assert b"\r\n0\r\nX-Trailer-Leak: \r\n\r\n" in resp.wire, resp.wire[-80:]
        s.sendall(_head(sb, f"/{m}-after"))
        assert _read_response(s).status == 200


@pytest.mark.parametrize("mode", MODES)
def test_expect_100_continue(env, mode):
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(SINK) as s:
        s.sendall(_head(sb, f"/{m}", method="POST", headers=[("Content-Length", "5"), ("Expect", "100-continue")]))
        s.settimeout(5)
        first = rawclient.read_head(s)
        assert first.startswith(b"HTTP/1.1 100"), first
        s.sendall(b"hello")
        resp = _read_response(s)
        assert resp.status == 200 and json.loads(resp.body)["body_len"] == 5, resp
    (got,) = _received(env, m)
    assert got["body"] == b"hello" and "expect" not in [k.lower() for k, _ in got["headers"]]


_CUT_SERVER = r"""
import socket, sys, threading
def serve(c):
    with c:
        data = b""
        while b"\r\n\r\n" not in data:
            d = c.recv(65536)
            if not d:
                return
            data += d
        if b"/cut" in data:
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
        elif b"/bighead" in data:
            c.sendall(b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * 200000 + b"\r\n\r\n")
        elif b"/badchunk" in data:
            c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 80)); s.listen(16)
print("READY", flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


@pytest.fixture(scope="module")
def cut_upstream(env, lab):
    lab.add_host(CUT_HOST, CUT_IP)
    popen = spawn_upstream(lab, [sys.executable, "-c", _CUT_SERVER, CUT_IP], "cut")
    (policy,) = [p for p in env.gw.policy_dir.iterdir() if "hostile-lab" in p.read_text()]
    original = policy.read_text()
    policy.write_text(original.replace("sink.allowed.test]", f"sink.allowed.test, {CUT_HOST}]", 1))
    sb = env.sandbox("explicit")
    deadline = time.monotonic() + 10
    while sb.exchange("http", CUT_HOST, _head(sb, "/probe", host=CUT_HOST)[:-2]
                      + b"Connection: close\r\n\r\n").status == 403 and time.monotonic() < deadline:
        time.sleep(0.2)            # the policy file is polled
    yield
    policy.write_text(original)
    popen.kill()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path,status", [("/cut", 200), ("/bighead", 502), ("/badchunk", 200)])
def test_a_broken_upstream_response_is_never_completed(env, cut_upstream, mode, path, status):
    sb = env.sandbox(mode)
    with sb.plain(CUT_IP) as s:
        s.sendall(_head(sb, path, host=CUT_HOST))
        wire = rawclient.recv_all(s, 5)
    resp = parse_h1(wire)
    assert resp.status == status, resp
    if status == 200:   # relayed as it came, then cut: the sandbox can tell (short body, or no last chunk)
        assert len(wire) < 100000 and not wire.endswith(b"0\r\n\r\n"), wire[-50:]
    else:
        assert resp.reason == "upstream_invalid_response", resp
    env.gw.wait_record(lambda r: r.get("reason") == "upstream_invalid_response" and r.get("host") == CUT_HOST)


# ---------------------------------------------------------------- big bodies
def _gateway_rss(env) -> int:
    return proc_rss_kib(env.gw.proc.pid) * 1024


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_256_mib_streams_in_bounded_memory(env, direction):
    sb = env.sandbox("explicit")
    m = _marker()
    size = 256 * MIB
    peak = [0]
    stop = threading.Event()
    base = _gateway_rss(env)

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _gateway_rss(env))
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        with sb.plain(SINK) as s:
            s.settimeout(30)
            if direction == "upload":
                s.sendall(_head(sb, f"/{m}", method="POST", headers=[("Content-Length", str(size))]))
                block = b"u" * MIB
                for _ in range(256):
                    s.sendall(block)
                resp = _read_response(s, timeout=60)
                assert resp.status == 200, resp     # the upstream's log below has the whole body's length
            else:
                s.sendall(_head(sb, f"/bytes/{m}?n={size}"))
                head = rawclient.read_head(s)
                assert head.startswith(b"HTTP/1.1 200"), head
                got = len(head.partition(b"\r\n\r\n")[2])
                deadline = time.monotonic() + 90
                while got < size and time.monotonic() < deadline:
                    data = s.recv(1 << 20)
                    if not data:
                        break
                    got += len(data)
                assert got == size
    finally:
        stop.set()
        t.join(2)
    if direction == "upload":
        (r,) = _received(env, m)
        assert r["body_len"] == size and r["body_complete"]
    assert peak[0] - base < 64 * MIB, f"gateway RSS grew by {(peak[0] - base) / MIB:.0f} MiB"


def _plain_round(env, sb, m: str, n: int) -> None:
    """n requests: half on keep-alive connections of 25, half one per connection, some with a body."""
    i = 0
    while i < n:
        per_conn = 25 if (i // 25) % 2 == 0 else 1
        with sb.plain(SINK) as s:
            for _ in range(per_conn):
                body = b"x" * 200 if i % 3 == 0 else b""
                hdrs = [("Content-Length", str(len(body)))] if body else []
                s.sendall(_head(sb, f"/{m}-{i}", method="POST" if body else "GET", headers=hdrs) + body)
                resp = _read_response(s)
                assert resp.status == 200, resp
                i += 1


def test_many_requests_and_connections_keep_gateway_memory_flat(env):
    """Per-request and per-connection state of the plain path is released: after a warm-up,
    4x as many requests (~1,250 connections) leave the gateway's RSS where it was. Measured
    growth without a leak: +0.9 to +2.6 MiB (allocator noise); an injected 4 KiB per request
    adds ~10 MiB (measured): the bound is between."""
    sb = env.sandbox("explicit")
    m = _marker()
    _plain_round(env, sb, m + "w", 600)
    base = _gateway_rss(env)
    _plain_round(env, sb, m, 2400)
    grew = _gateway_rss(env) - base
    print(f"\ngateway RSS after 2400 plain requests: {grew / MIB:+.2f} MiB")
    assert grew < 6 * MIB, f"gateway RSS grew by {grew / MIB:.1f} MiB over 2400 plain requests"


# ------------------------------------------------------------------- fallback
def test_bound_host_and_upgrade_are_handed_to_mitmproxy(env):
    sb = env.sandbox("explicit")
    m = _marker()
    with sb.plain(SINK) as s:
        s.sendall(_head(sb, f"/{m}-1"))
        assert _read_response(s).status == 200
        # the next request is for a host with a binding: handed over at the request boundary
        s.sendall(_head(sb, f"/{m}-2", host="hostile.allowed.test"))
        resp = _read_response(s)
        assert resp.status == 200, resp
    (got,) = _received(env, f"{m}-2")
    auth = [v for k, v in got["headers"] if k.lower() == "authorization"]
    assert auth and auth[0].startswith("Bearer "), got   # injected by the intercepting path


def test_sealed_vault_fails_closed(env, lab):
    gw = env.gw
    token = gw.cli("vault", "token", "create", "--scope", "admin").strip().split()[-1]

    def admin(path, body):
        r = lab.curl("-s", "-o", "/dev/stdout", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {token}",
                     "-X", "POST", "-H", "Content-Type: application/json", "--data", json.dumps(body),
                     f"http://127.0.0.1:{gw.proxy_port + 2}{path}", cacert=False, lab_dns=False)
        return r.stdout.rpartition("\n")[2]

    sb = env.sandbox("explicit")
    m = _marker()
    assert admin("/v1/seal", {}) == "200"
    try:
        # the seal reaches the worker over its link: the first request may still find it unsealed
        resp = eventually(lambda: (lambda r: r if r.status == 503 else None)(
            sb.exchange("http", SINK, _head(sb, f"/{m}") [:-2] + b"Connection: close\r\n\r\n")), timeout=5)
        assert resp is not None and resp.reason == "vault_sealed", resp
    finally:
        assert admin("/v1/unseal", {"key_file": str(gw.state_dir / "vault.key")}) == "200"
    assert eventually(lambda: sb.exchange("http", SINK, _head(sb, f"/{m}-after")[:-2]
                                          + b"Connection: close\r\n\r\n").status == 200, timeout=5)


# ------------------------------------------------------- the parser, no network
from egress.fastpath import http1  # noqa: E402
from egress.fastpath.plain import parse_refusal  # noqa: E402


def _events(raw: bytes, chunks: int = 1) -> list:
    r = http1.RequestReader(32 * 1024)
    step = max(1, len(raw) // chunks)
    for i in range(0, len(raw), step):
        r.feed(raw[i:i + step])
    return list(r.events)


@pytest.mark.parametrize("chunks", [1, 7, 1000])
def test_reader_events_do_not_depend_on_how_bytes_arrive(chunks):
    raw = (b"POST /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3;x\r\nabc\r\n0\r\n\r\n"
           b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n")
    ev = _events(raw, chunks)
    heads = [v for k, v in ev if k == "head"]
    assert [h.target for h in heads] == [b"/a", b"/b"] and heads[0].chunked
    assert b"".join(v for k, v in ev if k == "body") == b"abc"
    assert [k for k, _ in ev if k != "body"] == ["head", "end", "head", "end"]


@pytest.mark.parametrize("raw,reason", [
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
     "content_length_and_transfer_encoding"),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", "duplicate_content_length"),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n", "bad_header_value"),     # obs-fold
    (b"GET / HTTP/1.1\r\nHost: h\nX: b\r\n\r\n", "bad_header_value"),           # bare LF
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 40000 + b"\r\n\r\n", "head_too_large"),
])
def test_reader_refuses_what_llhttp_refuses(raw, reason):
    ev = _events(raw)
    assert not [k for k, _ in ev if k == "head"], ev
    (why,) = [v for k, v in ev if k == "error"]
    assert parse_refusal(why).reason == reason, why


def test_reader_turns_trailers_into_a_refusal_and_keeps_replay_per_head():
    ev = _events(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nX-T: s\r\n\r\n")
    assert [k for k, _ in ev][-2:] == ["trailers", "error"]
    r = http1.RequestReader(32 * 1024)
    first, second = b"GET /1 HTTP/1.1\r\nHost: h\r\n\r\n", b"GET /2 HTTP/1.1\r\nHost: h\r\n\r\n"
    r.feed(first)
    r.feed(second)
    heads = [v for k, v in r.events if k == "head"]
    assert bytes(heads[0].replay) == first + second and bytes(heads[1].replay) == second
    r2 = http1.RequestReader(32 * 1024)
    r2.feed(first + second)           # pipelined in one read: the second's start is not known
    assert [v for k, v in r2.events if k == "head"][1].replay is None
