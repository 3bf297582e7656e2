"""Attack pass 7: what a request means to an upstream beyond its request line (earlier passes:
tests/gateway/test_attack_pass_1.py .. _6.py, tests/vault/test_attack_pass_5.py).

Each test asserts the secure behaviour against a real gateway (explicit + transparent listeners,
cubevs switch) and the hostile upstream (testbed/hostile.py). FINDING tests failed before their fix.

Here the policy refuses DELETE to hostile.allowed.test (intercepted: it has a binding) and to
sink.allowed.test (plain HTTP on the fast path: no binding), and okey is bound to
other.allowed.test for GET only.
"""
from __future__ import annotations

import json
import socket
import ssl
import struct
import subprocess
import sys
import time

import pytest

from testbed import netns
from testbed.serving import spawn_upstream
from tests.gateway import hostile_env as he
from tests.gateway import rawclient
from tests.gateway.switchlab import switch_lab
from tests.gateway.test_attack_pass_6 import _client_hello, _with_server_names

pytestmark = pytest.mark.netns

TPORT = 18107

POLICY = """\
name: attack7
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [hostile.allowed.test, other.allowed.test, sink.allowed.test, retry.allowed.test,
                    tls13.allowed.test], ports: [443, 80]}
  - name: no-delete
    action: deny
    match: {hosts: [hostile.allowed.test, sink.allowed.test], ports: [443, 80], methods: [DELETE]}
"""


def _setup_vault(gw) -> None:
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "hkey", input=he.KEY_A + "\n")
    gw.cli("vault", "secret", "put", "acme", "okey", input=he.KEY_B + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-hostile", "--tenant", "acme", "--secret", "hkey",
           "--host", he.H, "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")
    gw.cli("vault", "binding", "add", "--id", "b-other-get", "--tenant", "acme", "--secret", "okey",
           "--host", he.OTHER, "--port", "443", "--method", "GET",
           "--header", "Authorization", "--format", "Bearer {secret}")


RETRY_HOST, RETRY_IP = "retry.allowed.test", "198.18.0.71"   # no binding: TLS passthrough
TLS13_HOST, TLS13_IP = "tls13.allowed.test", "198.18.0.72"   # openssl s_server, X25519 only
DENIED = "evil.denied.test"

# A TLS 1.3 server's first round trip, no more: it answers every ClientHello with a
# HelloRetryRequest and logs (JSON lines) the first hello's random and every byte that follows.
RETRY_SERVER = r"""
import json, socket, sys, threading
HRR_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
LOG = open(sys.argv[2], "a", buffering=1)
lock = threading.Lock()
def read_exact(c, n):
    buf = b""
    while len(buf) < n:
        d = c.recv(n - len(buf))
        if not d:
            raise EOFError
        buf += d
    return buf
def serve(c):
    with c:
        c.settimeout(3)
        try:
            head = read_exact(c, 5)
            hello = head + read_exact(c, int.from_bytes(head[3:5], "big"))
            sid = hello[44:44 + hello[43]]
            exts = bytes.fromhex("002b00020304") + bytes.fromhex("003300020017")
            body = b"\x03\x03" + HRR_RANDOM + bytes([len(sid)]) + sid + b"\x13\x01\x00" + len(exts).to_bytes(2, "big") + exts
            hs = b"\x02" + len(body).to_bytes(3, "big") + body
            c.sendall(b"\x16\x03\x03" + len(hs).to_bytes(2, "big") + hs + bytes.fromhex("140303000101"))
            rest = b""
            c.settimeout(1.5)
            while True:
                d = c.recv(65536)
                if not d:
                    break
                rest += d
        except (EOFError, OSError):
            rest = locals().get("rest", b"")
            if "hello" not in locals():
                return
        with lock:
            LOG.write(json.dumps({"random": hello[11:43].hex(), "after": rest.hex()}) + "\n")
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 443)); s.listen(64)
print("READY", flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def _wait_listening(addr: tuple[str, int], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            socket.create_connection(addr, 1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    hostile = he.ensure_hostile(lab)
    tmp = tmp_path_factory.mktemp("attack7")
    retry_log = tmp / "retry.jsonl"
    retry_log.write_text("")
    lab.add_host(RETRY_HOST, RETRY_IP)
    popen = spawn_upstream(lab, [sys.executable, "-c", RETRY_SERVER, RETRY_IP, str(retry_log)], "retry")
    lab.add_host(TLS13_HOST, TLS13_IP)
    cert, key = lab.ca.issue([TLS13_HOST], stem="a7-tls13")
    server = lab.spawn_net(["openssl", "s_server", "-accept", f"{TLS13_IP}:443", "-cert", cert, "-key", key,
                            "-tls1_3", "-groups", "X25519", "-rev"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    netns.call_in_netns(lab.net_ns, _wait_listening, (TLS13_IP, 443), timeout=15)
    try:
        with switch_lab(lab, tmp, POLICY, sandbox=he.SANDBOX, tport=TPORT,
                        prefix="a7", before_start=_setup_vault) as (gw, sw, net):
            e = he.Env(gw, sw, net, hostile, "")
            e.retry_log = retry_log
            yield e
    finally:
        for p in (popen, server):
            p.kill()
            p.wait(5)


def _upstream_got(env, marker: str) -> list[dict]:
    time.sleep(0.3)                  # the upstream's log is written after it answered
    return env.hostile.requests(marker)


# ------------------------------------------------------------- method overrides
# Every way a common framework lets a request name another method than its request line's:
# Google APIs, Azure, Symfony (X-HTTP-Method-Override), OData/Microsoft (X-HTTP-Method),
# Express method-override (X-Method-Override), Rails/Laravel/Rack (_method in the query).
CARRIERS = {
    "x-http-method-override": lambda m: ("", [("X-HTTP-Method-Override", m)]),
    "x-http-method": lambda m: ("", [("X-HTTP-Method", m)]),
    "x-method-override": lambda m: ("", [("x-method-override", m.lower())]),
    "query": lambda m: (f"?a=1&_method={m}", []),
}
PLACES = [("http", he.SINK, "explicit"), ("http", he.SINK, "transparent"),
          ("https", he.H, "explicit"), ("https", he.H, "transparent")]
PLACE_IDS = ["plain-explicit", "plain-transparent", "intercepted-explicit", "intercepted-transparent"]


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
@pytest.mark.parametrize("scheme, host, mode", PLACES, ids=PLACE_IDS)
def test_a_method_override_does_not_get_around_a_method_rule(env, scheme, host, mode, carrier):
    """FINDING: the policy decided on the request line's method only. A POST (or GET) carrying
    `X-HTTP-Method-Override: DELETE` is a DELETE to every upstream that honours the header, past the
    rule that refuses DELETE to that host. A request that names another method is now decided by
    both, the stricter wins: here refused (rule_deny), and nothing reaches the upstream."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7m")
    query, headers = CARRIERS[carrier]("DELETE")
    r = sb.get(scheme, host, f"/{m}{query}", method="POST", headers=headers, body=b"")
    assert (r.status, r.reason) == (403, "rule_deny"), r
    assert _upstream_got(env, m) == [], "the overridden DELETE went upstream"


@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("host, want", [(he.H, (403, "rule_deny")), (he.OTHER, (403, "method_override_binding"))],
                         ids=["method-rule", "binding"])
def test_a_method_override_in_http2_is_decided_for_both_methods(env, mode, host, want):
    """FINDING (same class, HTTP/2): the override header in an h2 request is decided the same way."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7h")
    r = sb.h2(host, [(":method", "GET"), (":scheme", "https"), (":authority", host), (":path", f"/{m}"),
                     ("x-http-method-override", "DELETE")])
    assert (r.status, r.reason) == want, r
    assert _upstream_got(env, m) == []


@pytest.mark.parametrize("scheme, host, mode", PLACES, ids=PLACE_IDS)
def test_two_different_method_overrides_are_refused(env, scheme, host, mode):
    """FINDING (same class): which of two override values a server takes is its own choice; a
    request naming two different methods is refused as ambiguous, whatever the rules say."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7a")
    r = sb.get(scheme, host, f"/{m}?_method=PUT", method="POST",
               headers=[("X-HTTP-Method-Override", "PATCH")], body=b"")
    assert (r.status, r.reason) == (400, "ambiguous_method_override"), r
    assert _upstream_got(env, m) == []


@pytest.mark.parametrize("scheme, host, mode", PLACES, ids=PLACE_IDS)
def test_an_override_to_an_allowed_method_still_goes_through(env, scheme, host, mode):
    """HOLDS (and the fix keeps it): an override to a method the rules allow is relayed as sent."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7p")
    r = sb.get(scheme, host, f"/{m}", method="POST", headers=[("X-HTTP-Method-Override", "PATCH")], body=b"")
    assert r.status == 200, r
    got = _upstream_got(env, m)
    assert len(got) == 1 and [v for k, v in got[0]["headers"] if k.lower() == "x-http-method-override"] == ["PATCH"]


@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("carrier", sorted(CARRIERS))
def test_a_method_override_does_not_carry_a_key_bound_to_another_method(env, mode, carrier):
    """FINDING: the vault picked the binding by the request line's method: a GET carrying
    `X-HTTP-Method-Override: DELETE` got okey, bound for GET only, and the upstream ran a DELETE
    with it. The binding must hold for the overriding method too, else the request is refused
    (method_override_binding) and nothing goes upstream."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7k")
    query, headers = CARRIERS[carrier]("DELETE")
    r = sb.get("https", he.OTHER, f"/{m}{query}", headers=headers)
    assert (r.status, r.reason) == (403, "method_override_binding"), r
    assert _upstream_got(env, m) == [], "the key bound for GET went upstream on an overridden DELETE"
    assert he.KEY_B not in r.wire.decode("latin-1")


@pytest.mark.parametrize("mode", he.MODES)
def test_a_get_bound_key_is_injected_when_the_override_names_get(env, mode):
    """HOLDS (and the fix keeps it): an override naming the bound method keeps the key."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7g")
    r = sb.get("https", he.OTHER, f"/{m}", headers=[("X-HTTP-Method-Override", "get")])
    assert r.status == 200, r
    he.injected_request(env.hostile, m, he.KEY_B)


@pytest.mark.parametrize("method, fields, target, want", [
    ("GET", [], "/a?method=DELETE&x_method=PUT", None),
    ("POST", [(b"X-HTTP-Method-Override", b" delete ")], "/", "DELETE"),
    ("POST", [(b"x-http-method-override", b"POST")], "/?_METHOD=post", None),     # the same method
    ("POST", [(b"X-Method-Override", b"PUT")], "/?_method=put", "PUT"),          # one other method, twice
    ("POST", [(b"X-HTTP-Method", b"PUT")], "/?_method=PATCH", "ambiguous_method_override"),
    ("POST", [(b"X-HTTP-Method", b"PUT, DELETE")], "/", "bad_method_override"),
    ("POST", [], "/?_method=", "bad_method_override"),
    ("POST", [], "/?a=1;_method=DELETE", "DELETE"),                             # ';' as a separator
    ("POST", [], "/?%5Fmethod=DELETE", "DELETE"),                               # an encoded name
    ("POST", [], "/?_method%20=%44ELETE", "DELETE"),
])
def test_method_override_reads_every_carrier(method, fields, target, want):
    """The pure reading behind the tests above (egress.http_checks.method_override), and the fast
    path's pre-check agrees with it on every row."""
    from egress.http_checks import Refusal, method_override, names_method_override
    got = method_override(method, fields, target)
    assert (got.reason if isinstance(got, Refusal) else got) == want
    if want is not None:
        assert names_method_override(fields, target.encode())


@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("query", ["?%5Fmethod=DELETE", "?a=1;_method=DELETE"], ids=["encoded", "semicolon"])
def test_a_method_override_in_another_spelling_is_decided_too(env, mode, query):
    """FINDING (same class, found while fixing it): the fast path's pre-check looked for the bytes
    `_method` and the gate read mitmproxy's parsed query ('&' only): `%5Fmethod=` and `;_method=`
    (both read as _method by some servers) were decided as plain POSTs."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7e")
    r = sb.get("http", he.SINK, f"/{m}{query}", method="POST", body=b"")
    assert (r.status, r.reason) == (403, "rule_deny"), r
    assert _upstream_got(env, m) == []


# ------------------------------------------------------------- HelloRetryRequest in passthrough
def _tunnel(sb: he.Sandbox, host: str, ip: str) -> socket.socket:
    if sb.mode == "transparent":
        return sb.connect((ip, 443))
    s = sb.connect(sb.proxy_addr)
    s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n{sb.auth}\r\n\r\n".encode())
    assert rawclient.connect_status(rawclient.read_head(s)) == 200
    return s


def _read_record(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 5:
        d = sock.recv(5 - len(head))
        if not d:
            return head
        head += d
    body, n = b"", struct.unpack("!H", head[3:5])[0]
    while len(body) < n:
        d = sock.recv(n - len(body))
        if not d:
            break
        body += d
    return head + body


def _after_retry(env, hello: bytes, timeout: float = 4.0) -> bytes | None:
    """What the upstream read after its HelloRetryRequest on the connection of `hello` (None: no such connection)."""
    want = hello[11:43].hex()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in env.retry_log.read_text().splitlines():
            rec = json.loads(line)
            if rec["random"] == want:
                return bytes.fromhex(rec["after"])
        time.sleep(0.1)
    return None


CCS = bytes.fromhex("140303000101")


def _retry_exchange(env, mode: str, second_sni: str, *, pipelined: bool) -> tuple[bytes, bytes, bytes | None]:
    """CH1 for RETRY_HOST; CH2 (CCS first, as clients in compatibility mode send it) naming
    `second_sni`, after the retry request or in the same write as CH1. (CH1, what came back, what
    the upstream read after its retry request.)"""
    sb = env.sandbox(mode)
    hello = _client_hello(RETRY_HOST)
    second = CCS + _with_server_names(hello, [(0, second_sni.encode())])
    sock = _tunnel(sb, RETRY_HOST, RETRY_IP)
    got = b""
    try:
        sock.settimeout(3)
        sock.sendall(hello + second if pipelined else hello)
        try:
            got = _read_record(sock)
            if not pipelined and got[:1] == b"\x16":
                sock.sendall(second)
            sock.settimeout(2)
            while (d := sock.recv(65536)):
                got += d
        except (OSError, TimeoutError):
            pass
    finally:
        sock.close()
    return hello, got, _after_retry(env, hello)


@pytest.mark.parametrize("pipelined", [False, True], ids=["after-retry", "pipelined"])
@pytest.mark.parametrize("mode", he.MODES)
def test_the_hello_after_a_retry_request_cannot_name_another_server(env, mode, pipelined):
    """FINDING: in TLS passthrough the gateway read the first ClientHello only. A server that asks
    for a retry (HelloRetryRequest) acts on the second, and a hostile client names another server
    there (behind one CDN address: another site). Now, in passthrough, every client byte after the
    first hello waits until the server's first message is known; after a retry request the second
    hello must name the same server: here it does not, the connection is reset (sni_changed_on_retry)
    and the upstream never reads the other name (nor, sent with the first hello, anything after it)."""
    def refusals() -> int:
        return sum(1 for r in env.gw.audit_records() if r["event"] == "decision"
                   and r.get("reason") == "sni_changed_on_retry" and r.get("sni") == RETRY_HOST)
    before = refusals()
    hello, got, after = _retry_exchange(env, mode, DENIED, pipelined=pipelined)
    assert got[:1] == b"\x16" and HRR_RANDOM_HEX in got.hex(), f"no retry request came back: {got[:60]!r}"
    assert after is not None, "the upstream logged no connection for this hello"
    assert DENIED.encode() not in after, "the second hello naming another server reached the upstream"
    deadline = time.monotonic() + 3
    while refusals() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refusals() == before + 1, [r for r in env.gw.audit_records() if r.get("sni") == RETRY_HOST][-3:]


@pytest.mark.parametrize("pipelined", [False, True], ids=["after-retry", "pipelined"])
@pytest.mark.parametrize("mode", he.MODES)
def test_a_second_hello_naming_the_same_server_is_relayed(env, mode, pipelined):
    """HOLDS (and the fix keeps it): a retry's second hello for the same name goes upstream whole."""
    hello, got, after = _retry_exchange(env, mode, RETRY_HOST.upper(), pipelined=pipelined)
    assert after is not None and after.startswith(CCS) and RETRY_HOST.upper().encode() in after, after



@pytest.mark.parametrize("mode", he.MODES)
def test_a_real_tls13_handshake_with_a_retry_request_completes(env, mode):
    """HOLDS (and the fix keeps it): OpenSSL's client offers a P-256 key share first, the X25519-only
    server asks for a retry, the client's second hello names the same server: the handshake
    completes through the passthrough (verified against the lab CA)."""
    sb = env.sandbox(mode)
    argv = ["openssl", "s_client", "-servername", TLS13_HOST, "-groups", "P-256:X25519", "-tls1_3",
            "-CAfile", str(env.gw.lab.ca.bundle_path), "-verify_return_error", "-msg", "-brief"]
    if mode == "explicit":
        user, token = sb.sandbox, env.gw.tokens[sb.sandbox]
        argv += ["-connect", f"{TLS13_HOST}:443", "-proxy", "%s:%d" % sb.proxy_addr,
                 "-proxy_user", user, "-proxy_pass", f"pass:{token}"]
    else:
        argv += ["-connect", f"{TLS13_IP}:443"]
    out = netns.run(sb.ns, argv, input="retried-hello\n", capture_output=True, timeout=20, check=False)
    text = out.stdout + out.stderr
    assert text.count("ClientHello") >= 2, f"no retry happened: the test would prove nothing\n{text[-1500:]}"
    assert "CONNECTION ESTABLISHED" in text and "Verification: OK" in text, text[-1500:]


HRR_RANDOM_HEX = "cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c"


# ------------------------------------------------------------- CONNECT inside an intercepted tunnel
@pytest.mark.parametrize("mode", he.MODES)
def test_a_connect_inside_an_intercepted_http1_tunnel_opens_nothing(env, mode):
    """HOLDS: a CONNECT sent inside the TLS the gateway intercepts (to reach another host through
    the tunnel decided for this one) is refused; nothing reaches the other host."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7c")
    raw = (f"CONNECT {he.SINK}:80 HTTP/1.1\r\nHost: {he.SINK}:80\r\n\r\n"
           f"GET /{m} HTTP/1.1\r\nHost: {he.SINK}\r\nConnection: close\r\n\r\n").encode()
    r = sb.exchange("https", he.H, raw)
    assert r.status != 200, r
    assert _upstream_got(env, m) == []


@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("shape", ["connect", "extended-connect"])
def test_a_connect_stream_inside_an_intercepted_http2_tunnel_opens_nothing(env, mode, shape):
    """HOLDS: an HTTP/2 CONNECT stream (RFC 9113 8.5: :authority is the tunnel's target) or an
    extended CONNECT (RFC 8441 :protocol, not offered by the gateway) inside an intercepted h2
    connection gets no tunnel to another host."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7x")
    if shape == "connect":
        headers = [(":method", "CONNECT"), (":authority", f"{he.SINK}:80")]
    else:
        headers = [(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "https"),
                   (":path", f"/{m}"), (":authority", he.SINK)]
    body = f"GET /{m} HTTP/1.1\r\nHost: {he.SINK}\r\n\r\n".encode()
    try:
        r = sb.h2(he.H, headers, body=body, timeout=3)
        status = r.status
    except (OSError, ssl.SSLError):
        status = 0
    assert not 200 <= status < 300, r
    assert _upstream_got(env, m) == []
