"""Attack pass 4: resource bounds and fail-closed behaviour of the gateway's data paths, as a sandbox
that runs arbitrary code and has read our source (earlier passes: test_attack_pass_1.py .. _3.py).

Each test asserts the secure behaviour: FINDING tests failed before their fix, HOLDS tests pin a
property no earlier test pinned. The sandbox resolver (cubegate/sandbox_dns.py) runs in-process on
loopback with the real GuardedResolver in front of a nameserver of ours; the data-path tests use a
real gateway (explicit + transparent, cubevs switch) and the hostile upstream (testbed/hostile.py).
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest
from dnslib import DNSRecord

from cubegate.sandbox_dns import SandboxDns
from egress.audit.log import AuditLog
from egress.identity import Identity
from egress.netguard import AddressGuard, GuardedResolver
from egress.policy.compiled import CompiledPolicySet
from egress.policy.loader import parse_policy_text

# ------------------------------------------------------------------ sandbox DNS: bounded work
DNS_POLICY = """\
name: p
default: deny
rules:
  - name: slow
    action: allow
    match: {hosts: [slow.x.test, "*.x.test"], ports: [443]}
"""


class _Policies:
    def __init__(self, text: str):
        self.current = CompiledPolicySet(parse_policy_text(text, "p.yaml")[0])


class _LoopbackSandbox:
    """The cubevs registry's answer for the one source these tests send from."""

    def lookup_by_ip(self, ip):
        return Identity("sb-dns4", {}) if ip == "127.0.0.1" else None


class _SilentNameserver:
    """A nameserver that reads every query and answers none (an attacker's authoritative server
    for an allowed wildcard, or an upstream that is down): each query costs its full timeout."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                self.sock.recvfrom(4096)
                self.queries += 1
            except socket.timeout:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def _run_dns(tmp_path, client):
    """Run a SandboxDns on loopback (its resolver asks a silent nameserver), then `client(port)`
    in a thread; returns (client's result, queries the nameserver got)."""
    silent = _SilentNameserver()

    async def go():
        resolver = GuardedResolver(AddressGuard(), [f"127.0.0.1:{silent.port}"], timeout=2.0)
        audit = AuditLog(tmp_path / "audit", fsync="never")
        srv = SandboxDns(lookup=_LoopbackSandbox(), policies=_Policies(DNS_POLICY), resolver=resolver, audit=audit)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        await srv.start("127.0.0.1", port)
        try:
            return await asyncio.to_thread(client, port)
        finally:
            await srv.stop()
            audit.close()

    try:
        out = asyncio.run(go())
        time.sleep(0.3)
        return out, silent.queries
    finally:
        silent.close()


def test_a_udp_query_flood_does_not_multiply_upstream_dns_work(tmp_path):
    """FINDING: every UDP datagram became a task that resolved on its own (A and AAAA, no limit, no
    sharing): a sandbox sending 600 queries for an allowed name whose nameserver is slow got 1200+
    upstream queries in flight at once (memory and upstream load without bound, an amplifier toward
    any nameserver an allowed wildcard delegates to). The work one source may cause at once is capped."""
    n = 600

    def flood(port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for i in range(n):
            q = DNSRecord.question("slow.x.test", "A")
            q.header.id = i
            s.sendto(q.pack(), ("127.0.0.1", port))
        time.sleep(1.0)
        s.close()

    _, upstream = _run_dns(tmp_path, flood)
    assert upstream <= 4 * SandboxDns.MAX_INFLIGHT_PER_SOURCE, f"{n} sandbox queries → {upstream} upstream queries"


def _tcp_query(name: str) -> bytes:
    q = DNSRecord.question(name, "TXT").pack()     # TXT: answered without an upstream query
    return struct.pack("!H", len(q)) + q


def test_tcp_dns_connections_per_source_are_capped(tmp_path):
    """FINDING: the TCP listener took every connection and kept each for as long as a message
    trickled in (10 s per read): one sandbox could hold thousands of the gateway's file descriptors
    (shared with every proxy listener) in TCP DNS connections. Beyond a few per source, a new one is
    closed at once; the ones held keep working, and closing them frees the budget."""
    n = 40

    def hold(port):
        socks = [socket.create_connection(("127.0.0.1", port), timeout=3) for _ in range(n)]
        time.sleep(0.3)
        answered = 0
        for s in socks:
            try:
                s.sendall(_tcp_query("a.x.test"))
                if len(s.recv(2)) == 2:
                    answered += 1
            except OSError:
                pass
        for s in socks:
            s.close()
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:   # the budget is back
            s.sendall(_tcp_query("a.x.test"))
            again = len(s.recv(2)) == 2
        return answered, again

    (answered, again), _ = _run_dns(tmp_path, hold)
    assert 1 <= answered <= SandboxDns.MAX_TCP_PER_SOURCE, answered
    assert again


# ------------------------------------------------------------------ identity changes vs. open connections
from tests.gateway import hostile_env as he                                      # noqa: E402
from tests.gateway.hostile_env import H, KEY_A, SECOND, SINK                      # noqa: E402

TPORT = 18097
FLOOD, FLOOD_UNBOUND, FLOOD_IP = "flood.allowed.test", "flood2.allowed.test", "198.18.0.64"
POLICY = he.POLICY.replace("sink.allowed.test]", f"sink.allowed.test, {FLOOD}, {FLOOD_UNBOUND}]", 1)
assert POLICY != he.POLICY

# A plain HTTP/1.1 upstream whose every answer is a chunked body followed by a trailer section that
# never ends (or, for /ext, a chunk header that never ends); it logs how much of it it got to send.
FLOOD_SERVER = r"""
import json, socket, sys, threading
LOG = open(sys.argv[2], "a", buffering=1)
def serve(c):
    with c:
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = c.recv(65536)
            if not d:
                return
            buf += d
        target = buf.split(b" ", 2)[1].decode()
        start = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        start += b"1;" if "/ext" in target else b"0\r\nX-Flood: "
        sent, error = 0, None
        try:
            c.sendall(start)
            block = b"a" * 65536
            while sent < (32 << 20):
                c.sendall(block)
                sent += len(block)
        except OSError as e:
            error = type(e).__name__
        LOG.write(json.dumps({"target": target, "sent": sent, "error": error}) + "\n")
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 80)); s.listen(64)
print("READY", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)    # a 64 KiB send stalled this long: the gateway stopped reading (the bound held)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def _setup_vault(gw) -> None:
    he.setup_vault(gw)
    gw.cli("vault", "binding", "add", "--id", "b-flood", "--tenant", "acme", "--secret", "hkey",
           "--host", FLOOD, "--port", "80", "--allow-plaintext",
           "--header", "Authorization", "--format", "Bearer {secret}")


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    import sys

    from testbed.serving import spawn_upstream
    from tests.gateway.switchlab import switch_lab
    tmp = tmp_path_factory.mktemp("attack4")
    hostile = he.ensure_hostile(lab)
    log_path = tmp / "flood.jsonl"
    log_path.write_text("")
    lab.add_host(FLOOD, FLOOD_IP)
    lab.add_host(FLOOD_UNBOUND, FLOOD_IP)
    popen = spawn_upstream(lab, [sys.executable, "-c", FLOOD_SERVER, FLOOD_IP, str(log_path)], "flood")
    try:
        with switch_lab(lab, tmp, POLICY, sandbox=he.SANDBOX, tport=TPORT, prefix="a4",
                        before_start=_setup_vault) as (gw, sw, net):
            out = gw.cli("identity", "placeholders", he.SANDBOX)
            phs = dict(line.split("=", 1) for line in out.split() if "=" in line)
            e = he.Env(gw, sw, net, hostile, phs["CUBEGATE_SECRET_HKEY"])
            e.flood_log = log_path
            yield e
    finally:
        popen.kill()
        popen.wait(5)


def _marker() -> str:
    return he.new_marker("a4-")


def _ask(sock, path: str, host: str) -> tuple[int, bytes]:
    """One keep-alive request on an open (TLS) connection; (status, body), (0, b"") when it is gone."""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = sock.recv(65536)
            if not d:
                return 0, b""
            buf += d
        head, _, rest = buf.partition(b"\r\n\r\n")
        n = next((int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
                  if k.strip().lower() == b"content-length"), 0)
        while len(rest) < n:
            d = sock.recv(65536)
            if not d:
                break
            rest += d
        return int(head.split(b" ", 2)[1]), rest[:n]
    except (OSError, ValueError):
        return 0, b""


def _closed_within(sock, seconds: float) -> bool:
    """The gateway closed (or reset) this connection within `seconds`; nothing is sent on it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if sock.recv(65536) == b"":
                return True
        except socket.timeout:
            return False
        except OSError:
            return True
    return False


def _rekey(env, sandbox: str, *labels: str) -> None:
    env.gw.tokens[sandbox] = env.gw.cli("identity", "add", sandbox, "--replace",
                                        *[f"--label={x}" for x in labels]).strip()


@pytest.mark.netns
@pytest.mark.parametrize("target", [H, SINK], ids=["intercepted", "passthrough"])
def test_a_rekeyed_sandbox_loses_its_open_tunnels(env, target):
    """FINDING: an identity is checked when a connection (CONNECT, or each plain request) is
    authenticated, never again. A sandbox whose token was rotated (`identity add --replace`, the
    answer to a leaked token) or removed kept every tunnel it held: a fast-path passthrough tunnel
    relayed on, and an intercepted one had each new request decided for, and the credential
    injected into it under, the old identity, for as long as the sandbox kept it busy. Open
    connections of an identity that changed are closed (and audited as revoked)."""
    sb = env.sandbox("explicit", SECOND)
    m = _marker()
    with sb.tls(target) as s:
        assert _ask(s, f"/status/{m}-before?code=200", target)[0] == 200
        if target == H:
            he.injected_request(env.hostile, f"{m}-before", KEY_A)
        _rekey(env, SECOND)
        closed = _closed_within(s, 5.0)
        after = _ask(s, f"/status/{m}-after?code=200", target) if not closed else (0, b"")
    assert closed and after[0] == 0, after
    assert env.hostile.requests(f"{m}-after") == []
    rec = env.gw.wait_record(lambda r: r.get("reason") == "policy_revoked" and r.get("sandbox") == SECOND
                             and (r.get("extra") or {}).get("denied_by") == "identity_changed")
    assert rec["decision"] == "deny"
    fresh = env.sandbox("explicit", SECOND)       # the new token works at once
    with fresh.tls(target) as s:
        assert _ask(s, f"/status/{m}-new?code=200", target)[0] == 200


@pytest.mark.netns
def test_a_relabelled_transparent_sandbox_is_decided_again_not_cut(env):
    """FINDING (same class): in transparent mode the identity (labels from the identity table, which
    select its policy) was read once per connection. After a relabel, requests on a kept-alive
    connection were still decided with the old labels. Now a relabel re-decides the sandbox's open
    connections with its new labels (PolicyGate.relabel): closed when the new labels' policy denies
    them, kept with the new labels otherwise — both pinned, with label-selected policies, in
    tests/gateway/test_relabel.py (transparent cases). Here the policy selects no labels, so the
    kept-alive connection must survive the re-key (an address, not the revoked token, identifies it)
    and go on serving."""
    sb = env.sandbox("transparent")
    m = _marker()
    try:
        with sb.tls(H) as s:
            assert _ask(s, f"/status/{m}-before?code=200", H)[0] == 200
            _rekey(env, he.SANDBOX, "team=moved")
            closed = _closed_within(s, 2.0)
            after = _ask(s, f"/status/{m}-after?code=200", H) if not closed else (0, b"")
        assert not closed and after[0] == 200, after
        assert len(env.hostile.requests(f"{m}-after")) == 1
    finally:
        _rekey(env, he.SANDBOX, "team=t")


@pytest.mark.netns
def test_an_unchanged_identity_keeps_its_connections(env):
    """HOLDS (and the fix keeps it): another sandbox's re-key, or none, closes nothing of this one."""
    sb = env.sandbox("explicit")
    m = _marker()
    with sb.tls(SINK) as s:
        assert _ask(s, f"/status/{m}-a?code=200", SINK)[0] == 200
        _rekey(env, SECOND)
        assert not _closed_within(s, 1.5)
        assert _ask(s, f"/status/{m}-b?code=200", SINK)[0] == 200


# ------------------------------------------------------------------ policy changes vs. blind tunnels
def _wait_policy(sb, done, path: str, seconds: float = 10.0) -> bool:
    """Until a request on a new tunnel to the sink gets a status `done` accepts (the files are polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with sb.tls(SINK) as probe:
            if done(_ask(probe, path, SINK)[0]):
                return True
        time.sleep(0.2)
    return False


@pytest.mark.netns
@pytest.mark.parametrize("mode", he.MODES)
def test_a_rule_that_needs_inspection_is_not_skipped_by_an_open_passthrough_tunnel(env, mode):
    """FINDING: a policy change revokes the open connections its new policy denies at the CONNECT
    stage. A new method/path rule (deny POST, deny /admin) does not deny there: it makes the
    destination need inspection, so new tunnels are intercepted and the rule enforced per request;
    but a passthrough tunnel opened before stayed open, blind: the sandbox went on sending the
    requests the rule denies through it, for as long as it kept it alive. A blind tunnel whose
    destination now needs inspection is closed (the sandbox reconnects and is inspected)."""
    sb = env.sandbox(mode)
    m = _marker()
    policy = env.gw.policy_dir / "main.yaml"
    original = policy.read_text()
    rule = (f"  - name: sink-no-{m}\n    action: deny\n"
            f"    match: {{hosts: [{SINK}], ports: [443], paths: [/deny-{m}]}}\n")
    with sb.tls(SINK) as s:
        assert _ask(s, f"/status/{m}-before?code=200", SINK)[0] == 200
        policy.write_text(original + rule)
        try:
            assert _wait_policy(sb, lambda status: status == 403, f"/deny-{m}/probe"), \
                "the new rule never took effect: the test proves nothing"
            closed = _closed_within(s, 3.0)
            after = _ask(s, f"/deny-{m}/through-the-old-tunnel", SINK) if not closed else (0, b"")
        finally:
            policy.write_text(original)
            _wait_policy(sb, lambda status: status == 200, f"/deny-{m}/restored")
    assert closed and after[0] == 0, after
    assert env.hostile.requests(f"/deny-{m}/through-the-old-tunnel") == []


# ------------------------------------------------------------------ HTTP/1 framing outside the head
FLOOD_BYTES = 48 << 20
RSS_BOUND = 24 << 20  # the gateway's growth while a flood passes (a buffering gateway: the flood, and more)
BOUND = 6 << 20       # what the sandbox may get of a response cut short


# A gateway that reads on (the unbounded one) never stalls a 64 KiB send for seconds; one that
# stopped reading stalls every send: this long without progress ends the flood, not 10 s.
STALLED_S = 3


def _flood_request(sb, host: str, shape: str, answer_wait: float) -> tuple[int, bytes | None]:
    """A chunked POST whose chunk header (ext) or trailer section (trailer) never ends: the flood
    bytes sent (until the gateway cut the connection or stopped reading), then what the gateway
    answered (None: it neither answered nor closed within `answer_wait` s)."""
    explicit = sb.mode == "explicit"
    target = f"http://{host}/flood-{shape}" if explicit else f"/flood-{shape}"
    head = f"POST {target} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
    head += (sb.auth + "\r\n") if explicit else ""
    start = b"5\r\nhello\r\n" + (b"1;" if shape == "ext" else b"0\r\nX-Flood: ")
    sent = 0
    with sb.plain(host) as s:
        s.settimeout(STALLED_S)
        try:
            s.sendall(head.encode() + b"\r\n" + start)
            block = b"a" * 65536
            while sent < FLOOD_BYTES:
                s.sendall(block)
                sent += len(block)
        except (ConnectionError, socket.timeout):
            pass
        s.settimeout(answer_wait)
        try:
            answer = s.recv(65536)
        except ConnectionError:
            answer = b""
        except socket.timeout:
            answer = None
    return sent, answer


@pytest.mark.netns
@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("host", [SINK, H], ids=["fast_plain", "mitmproxy"])
@pytest.mark.parametrize("shape", ["trailer", "ext"])
def test_a_request_chunk_header_or_trailer_that_never_ends_is_bounded(env, mode, host, shape):
    """FINDING: the head of a request is bounded (max_header_bytes), the framing after it was not.
    A chunked body's trailer section that never ends was accumulated whole by the parser on both
    paths (httptools joins a header value by bytes concatenation: quadratic CPU too, on the event
    loop every sandbox shares; mitmproxy's h11 reader buffers until the blank line), and mitmproxy
    did the same with a chunk header line (size + extension) that never ends: one sandbox could
    grow the gateway without bound. (Fast path + ext: llhttp streams it, memory HOLDS; the request
    went on forever.) Beyond about a head's worth the request is refused or the connection cut."""
    from tests.gateway.test_exhaustion import RssWatch
    with RssWatch(env.gw, RSS_BOUND) as watch:
        # the fast path must answer (10 s); mitmproxy may stop reading and stay silent, so a short
        # wait reads an answer it sent (already buffered) without waiting out a silence
        sent, answer = _flood_request(env.sandbox(mode), host, shape, 10 if host == SINK else STALLED_S)
    assert watch.growth <= RSS_BOUND, f"the gateway grew by {watch.growth >> 20} MiB for {sent >> 20} MiB of flood"
    if host == SINK:
        assert answer is not None, "the gateway is still reading the never-ending section"
    # mitmproxy, after the refusal of a streamed body, sometimes neither answers nor closes: it
    # stops reading (memory stays bounded) and the connection waits for the idle timeout (reported)
    assert not answer or answer.startswith(b"HTTP/1.1 4"), answer[:200]


@pytest.mark.netns
@pytest.mark.parametrize("host", [FLOOD_UNBOUND, FLOOD], ids=["fast_plain", "mitmproxy"])
@pytest.mark.parametrize("shape", ["trailer", "ext"])
def test_a_response_chunk_header_or_trailer_that_never_ends_is_bounded(env, host, shape):
    """FINDING (same class, the upstream's side): an allowed upstream answering with a trailer
    section (or, to mitmproxy, a chunk header) that never ends grew the gateway without bound.
    Beyond about a head's worth the upstream is cut off; the sandbox sees its response cut."""
    import json

    from tests.gateway.test_exhaustion import RssWatch
    sb = env.sandbox("explicit")
    m = _marker()
    path = f"/{m}/" + ("ext" if shape == "ext" else "trailer")
    with RssWatch(env.gw, RSS_BOUND) as watch:
        with sb.plain(host) as s:
            s.settimeout(10)
            s.sendall(f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{sb.auth}\r\n\r\n".encode())
            got = 0
            deadline = time.monotonic() + 20
            try:
                while time.monotonic() < deadline:
                    d = s.recv(65536)
                    if not d:
                        break
                    got += len(d)
            except OSError:
                pass
        deadline = time.monotonic() + 25
        rec = None
        while time.monotonic() < deadline and rec is None:
            recs = [json.loads(x) for x in env.flood_log.read_text().splitlines() if x.strip()]
            rec = next((r for r in recs if r["target"] == path), None)
            time.sleep(0.2)
    assert rec is not None, "the upstream never finished (the gateway neither read all nor cut it)"
    assert watch.growth <= RSS_BOUND, f"the gateway grew by {watch.growth >> 20} MiB; upstream: {rec}"
    assert rec["sent"] < (32 << 20), f"the gateway took the whole flood: {rec}"
    assert got < BOUND, got


@pytest.mark.parametrize("shape", ["trailer", "ext", "many_small_chunks"])
def test_the_http1_readers_bound_what_follows_a_head(shape):
    """The parsers behind the two tests above, both directions and both paths: a chunk header or
    trailer section over the head limit is an error; a body of many 1-byte chunks (framing bytes
    five times its size, each read carrying body) is not."""
    import h11
    from mitmproxy.proxy.layers.http import _http1

    from egress import mitm_internals
    from egress.fastpath.http1 import RequestReader, ResponseReader

    limit = 8192
    tail = {"trailer": b"5\r\nhello\r\n0\r\nX: " + b"a" * 40000,
            "ext": b"5\r\nhello\r\n1;" + b"a" * 40000,
            "many_small_chunks": b"1\r\nx\r\n" * 20000 + b"0\r\n\r\n"}[shape]
    reads = [tail[i:i + 1024] for i in range(0, len(tail), 1024)]

    req = RequestReader(limit)
    req.feed(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
    for d in reads:
        req.feed(d)
    errors = [v for k, v in req.events if k == "error"]

    class Sink:
        def __init__(self):
            self.errors, self.ended = [], False

        def head(self, *a): pass

        def body(self, d): pass

        def trailers(self, f): pass

        def end(self, keep): self.ended = True

        def error(self, why): self.errors.append(why)

    sink = Sink()
    resp = ResponseReader(sink, max_head_bytes=limit).begin(head_request=False)
    resp.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for d in reads:
        resp.feed(d)

    mitm_internals.install_head_limit(limit)
    reader, buf, mitm_error = _http1.make_body_reader(None), h11._receivebuffer.ReceiveBuffer(), None
    try:
        for d in reads:
            buf += d
            while reader(buf) is not None:
                pass
    except h11.LocalProtocolError as e:
        mitm_error = str(e)

    if shape == "many_small_chunks":
        assert errors == [] and sink.errors == [] and sink.ended and mitm_error is None, (errors, sink.errors)
        assert [k for k, _ in req.events][-1] == "end"
    else:
        assert errors and errors[0].startswith("head_too_large"), req.events
        assert sink.errors and not sink.ended
        assert mitm_error is not None and "over" in mitm_error
