"""Plain HTTP/1.1 on the fast path: parse (llhttp), decide each request as the gate does, relay.

Explicit proxy requests in absolute form (`GET http://host/...`) and transparent port 80.
Per request, with the gate's own units: framing and header checks (egress.http_checks),
identity (Proxy-Authorization on every explicit request), the per-sandbox claim, the
destination (egress.destination: policy with method/path, SSRF guard, guarded resolve),
the outbound leak check of the request line, every header and their concatenation, and
the body (streamed, vault.scan via egress.bodies), one `request` audit record before the
request goes out (refused when it cannot be written), metrics.

What goes upstream is rebuilt from the parsed pieces: origin-form target, the headers
llhttp read (proxy-only ones dropped), the body re-framed (Content-Length as read, or
chunked without extensions). Responses get the minimum parsing for framing (http1.ResponseReader)
and are re-framed the same way. Bodies stream with backpressure both ways.

Handed to mitmproxy (the gate decides and audits it) when this path does not implement
what the request needs: a host with credential bindings or method/path rules that need
interception, Upgrade/WebSocket, HTTP/1.0 and older, Expect other than 100-continue,
cubegate.internal, a method override (X-HTTP-Method-Override and kin: decided for both
methods there), other request-target forms. That happens at a request boundary, with
the request's raw bytes replayed; a request that needs it but whose raw bytes are gone
(pipelined behind another in one read) is refused instead. Anything ambiguous is refused
with the gate's deny shape (audited) and the connection closed.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from egress import netguard, records
from egress.bodies import (BodyRefused, RequestLeakStream, check_request_body, make_decoder)
from egress.destination import (AGENT_HOST, MAX_CACHED_HOST, connected_refusal, decide_destination, keep_undenied,
                                needs_interception, parse_destination_host)
from egress.fastpath import http1
from egress.fastpath.dial import dial
from egress.fastpath.request_decisions import RequestDecisionCache
from egress.http_checks import (PROXY_ONLY_HEADERS, Refusal, check_framing, check_header_limits, names_method_override,
                                check_request_authority, split_host_port, transparent_host)
from egress.policy import normalize_host
from egress.revocation import OpenConnection

log = logging.getLogger("cubegate.fastpath.plain")

MAX_PENDING_BYTES = 256 * 1024     # parsed but unsent request bytes before the client is paused
MAX_PENDING_EVENTS = 256
WRITE_HIGH = 256 * 1024            # a peer's unsent bytes before the other side is paused
REFUSED_LINGER = 2.0               # after a refusal: how long the sandbox's unread body is drained
INLINE_CHECK_BYTES = 64 * 1024     # held bodies larger than this are checked off the event loop
_DROP = frozenset(h.encode() for h in PROXY_ONLY_HEADERS) | {b"expect"}
_DROP_HOST = _DROP | {b"host"}

# llhttp's messages → the gate's refusal reasons (egress.http_checks names the same shapes)
_PARSE_REASONS = (
    ("head_too_large", 431, "head_too_large"),
    ("Duplicate Content-Length", 400, "duplicate_content_length"),
    ("can't be present with Content-Length", 400, "content_length_and_transfer_encoding"),
    ("Transfer-Encoding", 400, "bad_transfer_encoding"),
    ("Content-Length", 400, "bad_content_length"),
    ("header value", 400, "bad_header_value"),
)


def parse_refusal(why: str) -> Refusal:
    for needle, status, reason in _PARSE_REASONS:
        if needle in why:
            return Refusal(status, reason, f"request refused by the HTTP/1 parser: {why}")
    return Refusal(400, "invalid_request", f"request refused by the HTTP/1 parser: {why}")


def takes_explicit(head: bytes) -> bool:
    """An absolute-form http:// request line: this path's (CONNECT and the rest: not)."""
    sp = head.find(b" ")
    return 0 < sp < 32 and head[sp + 1:sp + 8].lower() == b"http://"


def canonical_host(h: str) -> str:
    """The gate's _canonical_host (pure: cached for short hosts; ValueError is not cached and raised again)."""
    return _canonical_host_cached(h) if len(h) <= MAX_CACHED_HOST else _canonical_host(h)


def _canonical_host(h: str) -> str:
    lit = netguard.parse_ip_literal(h)
    return str(lit) if lit is not None else normalize_host(h)


_canonical_host_cached = functools.lru_cache(maxsize=4096)(_canonical_host)


@dataclass
class Target:
    raw_host: str       # what decide_destination normalises and checks
    port: int
    path: bytes         # origin-form: what goes upstream
    authority: str      # for the Host header when the sandbox sent none


_AUTHORITY_END = re.compile(rb"[/?#]")


def _split_absolute(target: bytes) -> tuple[str, bytes]:
    """'http://a.b:8/x?y' → ('a.b:8', b'/x?y'); ValueError on anything else."""
    if target[:7].lower() != b"http://":
        raise ValueError("not an http:// absolute-form target")
    rest = target[7:]
    m = _AUTHORITY_END.search(rest)
    cut = m.start() if m is not None else len(rest)
    authority, path = rest[:cut], rest[cut:]
    if not authority:
        raise ValueError("empty authority")
    if b"@" in authority:
        raise ValueError("userinfo in the request target")
    if b"#" in path:
        raise ValueError("fragment in the request target")
    if not path.startswith(b"/"):
        path = b"/" + path
    return authority.decode("ascii"), path


def host_values(head: http1.RequestHead) -> list[str]:
    """Every Host header value without its OWS; ValueError for a byte that is not visible ASCII.
    A host name is ASCII (RFC 3986): the checks below would otherwise decide on Python's str.strip()
    of it (which also drops NBSP, NEL, \\x1c-\\x1f) while the upstream reads the bytes as sent."""
    out = []
    for v in head.get_all(b"host"):
        v = v.strip(b" \t")
        if _VISIBLE_ASCII.fullmatch(v) is None:
            raise ValueError("Host header with a byte that is not visible ASCII")
        out.append(v.decode("ascii"))
    return out


_VISIBLE_ASCII = re.compile(rb"[\x21-\x7e]*")


def explicit_target(head: http1.RequestHead) -> Target | Refusal:
    """The absolute-form target decides; every Host header must name it (host and port)."""
    try:
        authority, path = _split_absolute(head.target)
        host, port = split_host_port(authority)
        want = canonical_host(host)
        hosts = host_values(head)
    except (ValueError, UnicodeError) as e:
        return Refusal(400, "invalid_host", str(e)[:200])
    port = port or 80
    refusal = check_request_authority(want_host=want, want_port=port, scheme="http", authority="",
                                      host_headers=hosts, normalize=canonical_host)
    return refusal or Target(host, port, path, authority)


def transparent_target(head: http1.RequestHead, conn_port: int) -> Target | Refusal:
    """Host names the destination, on the dialled port (as the gate's _transparent_target)."""
    try:
        hosts = host_values(head)
    except ValueError as e:
        return Refusal(400, "invalid_host", str(e))
    checked = transparent_host(hosts, conn_port)
    if isinstance(checked, Refusal):
        return checked
    hh = checked[0]
    path = head.target
    if not path.startswith(b"/"):
        try:
            authority, path = _split_absolute(head.target)
            want = canonical_host(hh)
        except (ValueError, UnicodeError) as e:
            return Refusal(400, "invalid_host", str(e)[:200])
        refusal = check_request_authority(want_host=want, want_port=conn_port, scheme="http", authority=authority,
                                          host_headers=[], normalize=canonical_host)
        if refusal is not None:
            return refusal
    return Target(hh, conn_port, path, hosts[0])


_FRAMING_NAMES = frozenset({b"content-length", b"transfer-encoding", b"host", b"trailer"})


def connection_tokens_refusal(head: http1.RequestHead) -> Refusal | None:
    """`Connection: content-length` asks the next hop to drop a framing header: an upstream
    proxy that obeys would read the body as the next request. Refused, never forwarded."""
    for v in head.get_all(b"connection"):
        for token in v.lower().split(b","):
            if token.strip() in _FRAMING_NAMES:
                return Refusal(400, "bad_connection_header",
                               f"Connection names a framing header ({token.strip().decode('latin-1')})")
    return None


def _is_agent(host: str) -> bool:
    return parse_destination_host(host)[1] == AGENT_HOST


def needs_mitmproxy(head: http1.RequestHead, *, transparent: bool) -> bool:
    if head.version != "1.1" or head.method in ("CONNECT", "PRI"):
        return True
    if b"upgrade" in head.by_name or any(b"upgrade" in v.lower() for v in head.get_all(b"connection")) \
            or any(v.strip().lower() != b"100-continue" for v in head.get_all(b"expect")):
        return True
    if names_method_override(head.headers, head.target):
        return True     # decided for both methods by the gate (egress.gate._stricter_for_override)
    t = head.target
    if transparent:
        return not (t.startswith(b"/") or t[:7].lower() == b"http://")
    return t[:7].lower() != b"http://"


@dataclass
class _UpstreamOwner:      # the gate counts upstream connections per sandbox under this key
    sandbox_id: str


@dataclass
class _UpstreamClaim:
    identity: Any = None
    counted_for: str | None = None


def upstream_key(sandbox: str) -> str:
    return "^" + hashlib.sha256(sandbox.encode()).hexdigest()[:40]   # = egress.gate._claim_upstream


class PlainHttp:
    """The fast path's plain-HTTP handler (one per FastPath)."""

    takes_explicit = staticmethod(takes_explicit)

    def __init__(self, fp) -> None:
        from egress.gate import NoCredentials
        self.fp = fp
        self.gate = fp.gate
        creds = fp.gate.credentials
        # The vault's checks without a mitmproxy flow (egress/credentials.py); another hook: mitmproxy decides
        self.leak_checks = hasattr(creds, "check_unbound_request") and hasattr(creds, "unbound_needles")
        self.supported = self.leak_checks or isinstance(creds, NoCredentials)
        self.decisions = RequestDecisionCache()
        self.decide_latency = fp._latency("request")     # the one child every request observes

    async def serve(self, c) -> None:
        """Take over a fast-path connection (_Conn) whose first bytes are in c.buf."""
        gate, st = self.gate, c.st
        if c.transparent:
            if not gate.claims.claim(st, st.identity):
                self.fp._refuse(c, "sandbox_connection_limit", stage="connect")
                return
            if not await self.fp._head(c, lambda b: len(b) >= 1):
                return
            first = bytes(c.buf[:1])
            if not (first.isalpha() and first.isupper()):
                self.fp._hand_over(c)    # TLS or other bytes on 80: the gate refuses them with its reasons
                return
        conn = PlainConn(self, c)
        await conn.run()


class _Upstream(asyncio.Protocol):
    """The upstream side of one client connection: bytes into its ResponseReader while a response is due."""

    def __init__(self, conn: "PlainConn") -> None:
        self.conn = conn
        self.transport = None
        self.responses = http1.ResponseReader(conn, max_head_bytes=conn.gate.max_header_bytes)
        self.reader: http1.ResponseReader | None = None    # self.responses, or None: bytes are not relayed
        self.closed = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.target: tuple[str, int] | None = None
        self.owner: str | None = None      # the sandbox it was opened for: reused for that one only
        self.claim = _UpstreamClaim()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH)

    def data_received(self, data: bytes) -> None:
        try:
            self._relay(data)
        except Exception as e:   # noqa: BLE001 - fail closed (PlainConn.internal_error)
            self.conn.internal_error(e)

    def _relay(self, data: bytes) -> None:
        conn = self.conn
        conn.st.bytes_in += len(data)
        conn.last_activity = asyncio.get_running_loop().time()
        if self.reader is None:
            conn.upstream_garbage()
            return
        conn.out = []            # what one read produces goes to the sandbox in one write
        try:
            self.reader.feed(data)
        finally:
            out, conn.out = conn.out, None
            if out and not conn.transport.is_closing():
                conn.transport.write(b"".join(out))

    def eof_received(self) -> bool:
        self.closed = True
        if self.reader is not None:
            self.reader.eof()
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.writable.set()
        if self.reader is not None:
            self.reader.eof()
        self.conn.upstream_lost(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


class PlainConn(asyncio.Protocol):
    """One client connection on the plain-HTTP path (the transport's protocol from takeover on)."""

    def __init__(self, handler: PlainHttp, c) -> None:
        self.h, self.gate, self.fp, self.c = handler, handler.gate, handler.fp, c
        self.st = c.st
        c.per_request = True             # its refusals are records among others, its close its own record
        self.transport = c.transport
        self.reader = http1.RequestReader(self.gate.max_header_bytes)
        self.eof = False
        self.lost = False
        self.paused = False
        self._wake: asyncio.Future | None = None
        self.client_writable = asyncio.Event()
        self.client_writable.set()
        self.up: _Upstream | None = None
        self.head_started = c.st.started     # the first head is due header_timeout after connect
        self.response: asyncio.Future | None = None
        self.resp_framing: str | None = None
        self.resp_started = False
        self.resp_trailers = b""
        self.revoked = False
        self.lingering = False
        self.linger_timer: asyncio.TimerHandle | None = None
        self.up_timer = None
        self.closed = asyncio.get_running_loop().create_future()
        self.out: list[bytes] | None = None    # response bytes collected during one upstream read
        self.idle_timer = None
        self.last_activity = 0.0
        self._registered_as: tuple | None = None    # what _register last registered

    # ------------------------------------------------------------ protocol
    def data_received(self, data: bytes) -> None:
        try:
            self.st.bytes_out += len(data)
            self.last_activity = asyncio.get_running_loop().time()
            self._feed(data)
        except Exception as e:   # noqa: BLE001 - fail closed, see internal_error
            self.internal_error(e)

    def internal_error(self, e: Exception) -> None:
        """A bug in a protocol callback: asyncio would log it (with its text) and only close one
        side. Refused and audited as internal_error (FastPath.internal_error), both sides reset;
        a bug in run() reaches FastPath.serve's catch-all instead."""
        self.fp.internal_error(self.c, e)
        self.revoked = True
        self._reset_both()
        self._poke()

    def _feed(self, data: bytes) -> None:
        if not self.reader._in_message:
            self.head_started = asyncio.get_running_loop().time()
        self.reader.feed(data)
        if not self.paused and (self.reader.pending_bytes > MAX_PENDING_BYTES
                                or len(self.reader.events) > MAX_PENDING_EVENTS):
            self.paused = True
            self.transport.pause_reading()
        self._poke()

    def eof_received(self) -> bool:
        self.eof = True
        self._poke()
        if self.lingering:
            self.transport.close()       # the sandbox read our refusal and left
        return True

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.linger_timer is not None:   # it would hold this connection for REFUSED_LINGER more
            self.linger_timer.cancel()
            self.linger_timer = None
        self.client_writable.set()
        self._poke()
        if self.up is not None:
            self.up.close()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.client_writable.clear()
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        self.client_writable.set()
        if self.up is not None and self.up.transport is not None and not self.up.closed:
            self.up.transport.resume_reading()

    def _poke(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------- events
    async def _next(self, *, head: bool):
        """The next parsed event; None on EOF, loss or timeout (recorded)."""
        loop = asyncio.get_running_loop()
        while True:
            if self.reader.events:
                ev = self.reader.pop()
                if self.paused and self.reader.pending_bytes <= MAX_PENDING_BYTES // 2 \
                        and len(self.reader.events) <= MAX_PENDING_EVENTS // 2 and not self.lost:
                    self.paused = False
                    self.transport.resume_reading()
                return ev
            if self.lost or self.eof:
                return None
            if head and self.reader._in_message:
                timeout = self.gate.header_timeout
                deadline = self.head_started + timeout if timeout else None
            else:
                deadline = loop.time() + self.fp.idle_timeout if self.fp.idle_timeout else None
            if deadline is not None and loop.time() >= deadline:
                self._timed_out(head)
                return None
            self._wake = loop.create_future()
            timer = loop.call_at(deadline, self._poke) if deadline is not None else None
            try:
                await self._wake
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()

    def _timed_out(self, head: bool) -> None:
        st = self.st
        if head and self.reader._in_message:
            st.kind, st.denied_reason = "denied", "header_timeout"
            self.fp._count(st, "deny", "header_timeout", "connect")
        self._abort()

    # ---------------------------------------------------------------- run
    async def run(self) -> None:
        c = self.c
        self.transport.set_protocol(self)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        first = bytes(c.buf)
        c.buf.clear()
        self.eof = c.eof
        self.fp.outcomes("plain_http").inc()
        try:
            if first:
                self._feed(first)
            self.transport.resume_reading()
            while not self.lost and not self.revoked:
                ev = await self._next(head=True)
                if ev is None:
                    break
                kind, value = ev
                if kind != "head":
                    self._refuse_unparsed(kind, value)
                    break
                if not await self._request(value):
                    break
        finally:
            self._disarm_upstream_timer()
            self._disarm_idle()
            self._release_upstream()
            if not c.handed:
                self._close_client()
                try:   # a refusal's linger, a flush: the connection's records wait for its end
                    await asyncio.wait_for(asyncio.shield(self.closed), REFUSED_LINGER + 5)
                except (asyncio.TimeoutError, TimeoutError):
                    self.transport.abort()

    def _refuse_unparsed(self, kind: str, value) -> None:
        if kind == "error":
            refusal = parse_refusal(value)
        elif kind == "trailers":
            refusal = Refusal(400, "trailers_refused", "HTTP/1 trailers are not supported")
        else:
            refusal = Refusal(400, "invalid_request", f"unexpected {kind} between requests")
        self._deny(refusal, None, method=None, path=None)

    # ------------------------------------------------------------ requests
    async def _request(self, head: http1.RequestHead) -> bool:
        """One request: decide, forward, relay its response. False: the connection ends."""
        gate, st = self.gate, self.st
        t0 = time.perf_counter()
        st.requests += 1
        if not self.h.supported or needs_mitmproxy(head, transparent=st.transparent):
            return self._hand_over(head)
        try:
            return await self._decide(head, t0)
        finally:
            self.reader.done_with(head)

    async def _decide(self, head: http1.RequestHead, t0: float) -> bool:
        gate, st = self.gate, self.st
        path_s = _path_str(head.target)
        refusal = check_header_limits(head.headers, max_count=gate.max_header_count,
                                      max_bytes=gate.max_header_bytes) or check_framing(head.headers) \
            or connection_tokens_refusal(head)
        target = decision = None
        if refusal is None and not st.transparent:
            refusal = self._authenticate(head)      # every explicit request, as the gate does
        if refusal is None:
            target = transparent_target(head, st.conn_port or 80) if st.transparent else explicit_target(head)
            if isinstance(target, Refusal):
                refusal, target = target, None
        if refusal is None and _is_agent(target.raw_host):
            return self._hand_over(head)
        if refusal is None:
            path_s = _path_str(target.path)
            up = self.up
            verdict = await decide_destination(st, target.raw_host, target.port, policies=gate.policies,
                                               guard=gate.guard, resolver=gate.resolver, scheme="http",
                                               method=head.method, path=path_s, cache=self.h.decisions,
                                               connected_to=self._reusable(up))
            if self.lost:
                return False
            decision, refusal = verdict.decision, verdict.refusal
            st.kind = "http"
            if refusal is None and decision.action != "allow":
                refusal = records.policy_refusal(decision)
            if refusal is None and needs_interception(decision, gate.credentials, st.host, st.port):
                return self._hand_over(head)
        plan = None
        if refusal is None:
            st.decision = decision
            refusal = self._check_head(head, target)
        if refusal is None:
            plan = self._plan_body(head)
            if isinstance(plan, Refusal):
                refusal, plan = plan, None
        self.h.decide_latency.observe(time.perf_counter() - t0)
        if refusal is not None:
            self._deny(refusal, decision, method=head.method, path=path_s)
            return False
        if not self.fp._audit("request", st, scheme="http", method=head.method, path=_path_only(path_s),
                              **records.decision_fields(decision)):
            self._deny(Refusal(503, "audit_unavailable", "audit log not writable"), decision,
                       method=head.method, path=path_s, audited=False)
            return False
        self.fp._count(st, "allow", decision.reason, "request")
        self._register()
        return await self._forward(head, target, verdict.addresses, plan, path_s, t0)

    def _authenticate(self, head: http1.RequestHead) -> Refusal | None:
        gate, st = self.gate, self.st
        values = head.get_all(b"proxy-authorization")
        if not values:
            return Refusal(407, "proxy_auth_missing", "send Proxy-Authorization")
        ident, reason = gate.explicit_identity(values[0].decode("latin-1"), self.c.peer[0]) if len(values) == 1 \
            else (None, "proxy_auth_invalid")
        if ident is None:
            return Refusal(407, reason, "send Proxy-Authorization")
        if not gate.claims.claim(st, ident):
            return Refusal(429, "sandbox_connection_limit",
                           f"sandbox already holds {gate.max_connections_per_sandbox} connections")
        return None

    def _check_head(self, head: http1.RequestHead, target: Target) -> Refusal | None:
        """The outbound leak check of the request line and headers (the gate's on_request)."""
        if not self.h.leak_checks:
            return None          # NoCredentials: nothing to leak
        # No await since needs_interception said "no binding here": the same vault state decides both.
        return self.gate.credentials.check_unbound_request(
            self.st, url=f"http://{target.authority}{_path_str(target.path)}", fields=head.headers)

    def _plan_body(self, head: http1.RequestHead):
        """None (stream as is), a RequestLeakStream, ("hold", needles, encoding), or a Refusal."""
        if not head.has_body:
            return None
        if not self.h.leak_checks:
            return None
        needles = self.gate.credentials.unbound_needles(self.st)
        if isinstance(needles, Refusal):
            return needles
        if needles is None or needles.empty:
            return None
        encoding = ",".join(v.decode("latin-1") for v in head.get_all(b"content-encoding") if v.strip()) or None
        limits = self.gate.body_limits
        try:
            make_decoder(encoding, limits, what="request")
        except BodyRefused as r:
            return Refusal(r.status, r.reason, r.detail)
        length = head.content_length
        if length is not None and length <= limits.inspect_buffer_bytes \
                and self.gate.buffer_budget.reserve(self.st.sandbox, length):
            return ("hold", needles, encoding, length)
        return RequestLeakStream(needles, encoding, limits, lambda r: None)

    def _register(self) -> None:
        """Revocable as what it is now connected to. A keep-alive connection's next request to the same
        destination, with the same identity object, would register the same entry: skipped (an entry
        leaves the registry only as its connection is revoked or ends, never while requests follow)."""
        st = self.st
        key = (st.identity, st.host, st.port, st.ip_literal, st.upstream)
        if key == self._registered_as:
            return
        self._registered_as = key
        self.gate.register_connection(OpenConnection(st.conn_id, st.identity.sandbox_id, st.host, st.port,
                                                     labels=st.identity.labels, ip_literal=st.ip_literal,
                                                     kind="http", issued=st.identity.issued,
                                                     transparent=st.transparent,
                                                     upstream_ip=st.upstream.rpartition(":")[0] if st.upstream else None),
                                      self.revoke)

    # ---------------------------------------------------------- forwarding
    async def _forward(self, head, target: Target, addresses, plan, path_s: str, t0: float) -> bool:
        st = self.st
        held = None
        if isinstance(plan, tuple):
            held = await self._read_held(plan, head, path_s)
            if held is None:
                return False
            plan = None
        if not await self._upstream_for(target, addresses, head, path_s):
            return False
        up = self.up
        # llhttp keeps a value's trailing OWS, which is not part of it (RFC 9110 5.5): sent without
        if not self.st.transparent or b"host" not in head.by_name:
            # Absolute form: the target's authority is the Host (RFC 9112 3.2.2: a proxy replaces the
            # sandbox's, which was only checked to name the same host, e.g. an empty one passed)
            headers = [(b"Host", target.authority.encode("ascii"))]
            headers += [(k, v.rstrip(b" \t")) for n, (k, v) in zip(head.names, head.headers) if n not in _DROP_HOST]
        else:
            headers = [(k, v.rstrip(b" \t")) for n, (k, v) in zip(head.names, head.headers) if n not in _DROP]
        if head.has_body and held is None and head.get_all(b"expect"):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")   # as mitmproxy does: we answer it
        self.response = asyncio.get_running_loop().create_future()
        self.resp_started = False
        self.resp_trailers = b""
        up.reader = up.responses.begin(head_request=head.method == "HEAD")
        self._arm_upstream_timer(head, path_s)
        up.transport.write(http1.serialize_request_head(head.method, target.path, headers))
        if held is not None:
            up.transport.write(held)
            body_ok = True
        elif head.has_body:
            body_ok = await self._stream_body(head, plan, path_s)
        else:
            body_ok = await self._expect_end()
        if not body_ok:
            return False
        self._arm_idle()
        try:
            keep = await self.response
        finally:
            self._disarm_idle()
        self.response = None
        self.fp._request_latency(st.sandbox).observe(time.perf_counter() - t0)
        if not keep:
            self._release_upstream()
        return head.keep_alive and not self.lost and self.resp_framing != "close" and not self.revoked

    async def _expect_end(self) -> bool:
        ev = await self._next(head=False)
        if ev is None or ev[0] != "end":
            if ev is not None:
                self._refuse_unparsed(*ev)
            self._abort()
            return False
        return True

    async def _read_held(self, plan, head, path_s: str) -> bytes | None:
        """A known-length body up to inspect_buffer_bytes, checked whole before any of it goes out."""
        _, needles, encoding, length = plan
        sandbox = self.st.sandbox
        try:
            if head.get_all(b"expect"):
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            parts = []
            while True:
                ev = await self._next(head=False)
                if ev is None:
                    self._abort()
                    return None
                if ev[0] == "end":
                    break
                if ev[0] != "body":
                    self._refuse_unparsed(*ev)
                    return None
                parts.append(ev[1])
            body = b"".join(parts)
            limits = self.gate.body_limits
            try:
                if len(body) > INLINE_CHECK_BYTES:
                    await asyncio.to_thread(functools.partial(check_request_body, body, encoding, needles, limits,
                                                              on_loop=False))
                else:
                    check_request_body(body, encoding, needles, limits)
            except BodyRefused as r:
                if r.reason == "credential_leak":
                    self.gate.credentials.report_leak(self.st, r.secret_ids, "body")
                self._deny(Refusal(r.status, r.reason, r.detail), None, method=head.method, path=path_s,
                           stage="body")
                return None
            return body
        finally:
            self.gate.buffer_budget.release(sandbox, length)

    async def _stream_body(self, head, stream, path_s: str) -> bool:
        up = self.up
        while True:
            ev = await self._next(head=False)
            if ev is None:
                self._abort()
                return False
            kind, data = ev
            if kind == "body":
                out = [data] if stream is None else stream(data)
                if stream is not None and stream.failed is not None:
                    return self._stream_refused(stream.failed, head, path_s)
                for piece in out:
                    if piece:
                        up.transport.write(http1.chunk(piece) if head.chunked else piece)
            elif kind == "end":
                out = [] if stream is None else stream(b"")
                if stream is not None and stream.failed is not None:
                    return self._stream_refused(stream.failed, head, path_s)
                for piece in out:
                    if piece:
                        up.transport.write(http1.chunk(piece) if head.chunked else piece)
                if head.chunked:
                    up.transport.write(http1.LAST_CHUNK)
                return True
            else:   # trailers, or a framing error: the body is upstream already, cut it before its end
                refusal = (Refusal(400, "trailers_refused", "HTTP/1 trailers are not supported")
                           if kind == "trailers" else parse_refusal(str(data)))
                self._body_refused(refusal, head.method, path_s)
                return False
            if self.response is not None and self.response.done():
                self._abort()        # answered before the body ended: the two sides cannot be kept in step
                return False
            if not up.writable.is_set():
                await up.writable.wait()
                if up.closed:
                    self._abort()
                    return False

    def _body_refused(self, refusal: Refusal, method, path_s) -> None:
        """Mid-body: the upstream is reset (its request never ends); the sandbox gets the refusal
        if no response has started, else a reset."""
        self._disarm_upstream_timer()
        if self.up is not None:
            self.up.reader = None
            self.up.close()
        self._audit_refusal(refusal, method, path_s, "body")
        if self.resp_started:
            self._abort()
        else:
            self._respond_and_close(refusal)
        if self.response is not None and not self.response.done():
            self.response.set_result(False)

    def _stream_refused(self, r: BodyRefused, head, path_s: str) -> bool:
        self._reset_both()
        if r.reason == "credential_leak":
            self.gate.credentials.report_leak(self.st, r.secret_ids, "body")
        st = self.st
        st.kind, st.denied_reason = "denied", r.reason
        self.fp._audit("request", st, scheme="http", method=head.method, path=_path_only(path_s), decision="deny",
                       reason=r.reason, extra={"stage": "request_stream", "detail": r.detail})
        self.fp._count(st, "deny", r.reason, "body")
        return False

    # ------------------------------------------------------------ upstream
    def _reusable(self, up: "_Upstream | None") -> tuple[str, int] | None:
        """(host, port) of the upstream connection this request may reuse (same sandbox, still open)."""
        if up is None or up.closed or up.owner != self.st.sandbox:
            return None
        return up.target

    async def _upstream_for(self, target: Target, addresses, head, path_s: str) -> bool:
        """The kept-alive upstream connection for (host, port) and this sandbox, or a new one
        (bounded: one at a time)."""
        gate, st = self.gate, self.st
        want = (st.host, st.port)
        if self.up is not None and (self.up.closed or self.up.target != want or self.up.owner != st.sandbox):
            self._release_upstream()
        if self.up is not None:
            return True
        if not addresses:
            # Decided against the connection held then (no resolve); it closed since (an idle close
            # while the body was read): resolve now, guarded, as decide_destination would have.
            try:
                addresses = await gate.resolver.resolve(st.host, st.port)
            except netguard.DestinationBlocked as e:
                self._upstream_failed(f"ssrf_{e.reason}", str(e))
                return False
            except netguard.DestinationUnresolvable as e:
                self._upstream_failed("unresolvable", str(e))
                return False
            addresses, denied = keep_undenied(gate.policies.current, st.sandbox, st.decision, addresses, st.port)
            if denied is not None:
                self._upstream_failed(denied.reason, f"{st.host} resolves only into a denied range ({denied.rule})")
                return False
            if self.lost:
                return False
        up = _Upstream(self)
        if gate.max_connections_per_sandbox and not gate.claims.claim(
                up.claim, _UpstreamOwner(upstream_key(st.sandbox))):
            self._upstream_failed("sandbox_connection_limit", "the sandbox holds its limit of upstream connections")
            return False
        d = await dial(lambda: up, addresses, st.port, gate.connect_timeout, lambda: self.lost)
        transport = d.transport
        if transport is None:
            gate.claims.release(up.claim)
            if not self.lost:
                self._upstream_failed(d.reason, d.error)
            return False
        up.target, up.owner = want, st.sandbox
        self.up = up
        peer = transport.get_extra_info("peername")
        st.upstream = f"{peer[0]}:{peer[1]}"
        blocked = connected_refusal(gate.guard, gate.policies.current, st.sandbox, peer[0], peer[1])
        if blocked is not None or self.lost or self.revoked:
            if blocked is not None:   # should be impossible (the resolver filtered it); close rather than trust
                st.kind, st.denied_reason = "denied", blocked
                self.fp._audit("decision", st, decision="deny", reason=blocked, upstream=st.upstream)
            self._abort()
            return False
        self._register()   # again, with the address connected to (revocable by a deny CIDR added later)
        return True

    def _upstream_failed(self, reason: str, error: str) -> None:
        st = self.st
        st.denied_reason = st.denied_reason or reason
        self.fp._audit("decision", st, decision="deny", reason=reason, status=502, extra={"error": error})
        self.fp._count(st, "deny", reason, "upstream")
        self._respond_and_close(Refusal(502, reason, error))

    def _release_upstream(self) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.close()
            self.gate.claims.release(up.claim)

    def upstream_lost(self, up: _Upstream) -> None:
        if self.response is not None and not self.response.done() and up is self.up and not self.resp_started:
            up.reader = None
            self._upstream_failed("upstream_connect_failed", "upstream closed before its response")
            self.response.set_result(False)

    def upstream_garbage(self) -> None:
        if self.up is not None:
            self.up.close()      # bytes with no request outstanding: never relayed

    def _arm_idle(self) -> None:
        """While a response is awaited or relayed: no byte either way for idle_timeout → reset."""
        idle = self.fp.idle_timeout
        if idle:
            loop = asyncio.get_running_loop()
            self.last_activity = loop.time()
            self.idle_timer = loop.call_later(idle, self._idle_check)

    def _disarm_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _idle_check(self) -> None:
        loop = asyncio.get_running_loop()
        left = self.last_activity + self.fp.idle_timeout - loop.time()
        if left > 0:
            self.idle_timer = loop.call_later(left, self._idle_check)
            return
        self.idle_timer = None
        self._abort()
        if self.response is not None and not self.response.done():
            self.response.set_result(False)

    def _arm_upstream_timer(self, head, path_s: str) -> None:
        t = self.gate.upstream_timeout
        if t:
            self.up_timer = asyncio.get_running_loop().call_later(t, self._upstream_timed_out, head.method, path_s)

    def _disarm_upstream_timer(self) -> None:
        if self.up_timer is not None:
            self.up_timer.cancel()
            self.up_timer = None

    def _upstream_timed_out(self, method: str, path_s: str) -> None:
        self.up_timer = None
        st = self.st
        self.fp._audit("decision", st, decision="deny", reason="upstream_timeout", method=method,
                       path=_path_only(path_s), status=502,
                       extra={"error": f"no response head within {self.gate.upstream_timeout}s"})
        self.fp._count(st, "deny", "upstream_timeout", "upstream")
        if self.up is not None:
            self.up.reader = None
            self.up.close()
        self._respond_and_close(Refusal(502, "upstream_timeout", "no response head in time"))
        if self.response is not None and not self.response.done():
            self.response.set_result(False)

    # ------------------------------------------------- the response (sink)
    def _send(self, data: bytes) -> None:
        if self.out is not None:
            self.out.append(data)
        else:
            self.transport.write(data)

    def head(self, status: int, reason: bytes, headers, framing: str) -> None:
        if 100 <= status < 200:
            self._send(http1.serialize_response_head(status, reason, headers))
            return
        self._disarm_upstream_timer()
        self.resp_started = True
        self.resp_framing = framing
        self._send(http1.serialize_response_head(status, reason, headers))

    def body(self, data: bytes) -> None:
        self._send(http1.chunk(data) if self.resp_framing == "chunked" else data)

    def trailers(self, fields) -> None:
        self.resp_trailers = b"".join(k + b": " + v + b"\r\n" for k, v in fields)

    def end(self, keep_alive: bool) -> None:
        if self.resp_framing == "chunked":
            self._send(b"0\r\n" + self.resp_trailers + b"\r\n")
        fut = self.response
        if fut is not None and not fut.done():
            fut.set_result(keep_alive and self.resp_framing != "close")

    def error(self, why: str) -> None:
        """The upstream's answer cannot be relayed as one interpretation: 502 before its head, else reset."""
        fut = self.response
        if fut is None or fut.done():
            if self.up is not None:
                self.up.reader = None
                self.up.close()     # misbehaving after its answer: the connection is not reused
            return
        self._disarm_upstream_timer()
        out, self.out = self.out, None
        if out and self.resp_started:
            self.transport.write(b"".join(out))    # what came before the break, then the reset
        st = self.st
        self.fp._audit("decision", st, decision="deny", reason="upstream_invalid_response", status=502,
                       extra={"error": why[:200]})
        self.fp._count(st, "deny", "upstream_invalid_response", "response")
        if self.up is not None:
            self.up.reader = None
            self.up.close()
        if self.resp_started:
            # what was relayed is flushed, then a FIN: the sandbox sees a short body or a chunk stream
            # without its end (a reset could discard the bytes it has not read yet, hiding the cut)
            self.revoked = True
            self.transport.close()
        else:
            self._respond_and_close(Refusal(502, "upstream_invalid_response", why[:200]))
        fut.set_result(False)

    # ----------------------------------------------------------- refusals
    def _audit_refusal(self, refusal: Refusal, method, path_s, stage: str, decision=None, audited=True) -> None:
        st = self.st
        st.kind, st.denied_reason = "denied", refusal.reason
        if audited:
            fields = records.decision_fields(decision) if decision else {}
            fields.update(decision="deny", reason=refusal.reason)
            # at the head (nothing of this request written yet): within the budget; later stages one by one
            audit = self.fp._audit_refusal if stage == "request" else self.fp._audit
            audit("request", st, scheme="http", method=method,
                  path=_path_only(path_s) if path_s is not None else None, status=refusal.status, **fields)
        self.fp._count(st, "deny", refusal.reason, stage)

    def _deny(self, refusal: Refusal, decision, *, method, path, stage: str = "request", audited: bool = True) -> None:
        """The gate's deny: one audit record, the JSON refusal (Connection: close), then the connection ends."""
        self._audit_refusal(refusal, method, path, stage, decision, audited)
        self._respond_and_close(refusal, decision)

    def _respond_and_close(self, refusal: Refusal, decision=None) -> None:
        t = self.transport
        if t.is_closing():
            return
        body = records.deny_body(refusal.status, refusal.reason, refusal.detail, st=self.st, decision=decision)
        hdrs = dict(records.deny_headers(refusal.reason), **{"Content-Length": str(len(body))})
        t.write(http1.serialize_response_head(refusal.status, _REASONS.get(refusal.status, b"Refused"),
                                              [(k.encode(), v.encode()) for k, v in hdrs.items()]) + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close after a refusal and drain what the sandbox still sends (bounded), so the
        refusal is read instead of lost to a reset; then close."""
        t = self.transport
        if t.is_closing():
            return
        try:
            t.write_eof()
        except (OSError, RuntimeError):
            t.abort()
            return
        self.reader = _Discard(self.gate.body_limits.inspect_buffer_bytes, t)
        self.lingering = True
        self.revoked = True     # no further request is read
        if self.eof:
            t.close()
        else:
            self.linger_timer = asyncio.get_running_loop().call_later(REFUSED_LINGER, self._linger_over)

    def _linger_over(self) -> None:
        self.lingering = False
        self._close_client()

    def _close_client(self) -> None:
        """The end of a connection: what is queued is flushed, then it is closed."""
        t = self.transport
        if t is not None and not t.is_closing() and not self.lingering:
            t.close()

    def _reset_both(self) -> None:
        if self.up is not None:
            self.up.close()
        self._abort()

    def _abort(self) -> None:
        if self.up is not None:
            self.up.close()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def revoke(self, reason: str) -> None:
        """The policy now denies this connection: reset it (its connection_closed record says why)."""
        st = self.st
        st.kind, st.denied_reason = "denied", reason
        self.fp._count(st, "deny", reason, "revoke")
        self.revoked = True
        self._abort()

    # ---------------------------------------------------------- hand-over
    def _hand_over(self, head: http1.RequestHead) -> bool:
        """mitmproxy takes the rest of the connection, this request's raw bytes replayed."""
        replay = head.replay
        if replay is None or self.lost:   # refused here, not handed over: it stays one of ours
            self._deny(Refusal(400, "pipelined_request_refused",
                               "this request needs inspection; send it on a new connection, not pipelined"),
                       None, method=head.method, path=_path_str(head.target))
            return False
        self._release_upstream()
        st = self.st
        st.requests -= 1
        if st.requests:
            # Earlier requests were ours: their connection_closed record too; mitmproxy opens its own.
            self.fp._forget(self.c, audit=True)
            self.fp.conns.add(self.c)
            self.gate.metrics.active_connections.inc()
        else:
            self.gate.unregister_connection(st.conn_id)
        self.c.buf = bytearray(replay)
        self.c.eof = self.eof
        self.fp._hand_over(self.c)
        return False


class _Discard:
    """The reader after a refusal: drops what the sandbox still sends, up to an allowance."""

    def __init__(self, allowance: int, transport) -> None:
        self.left = allowance
        self.transport = transport
        self.events: list = []
        self.pending_bytes = 0
        self._in_message = False

    def feed(self, data: bytes) -> None:
        self.left -= len(data)
        if self.left < 0 and not self.transport.is_closing():
            self.transport.abort()

    def waiting(self) -> bool:
        return self.left >= 0

    def done_with(self, head) -> None:
        return None


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 407: b"Proxy Authentication Required", 413: b"Payload Too Large",
            415: b"Unsupported Media Type", 421: b"Misdirected Request", 429: b"Too Many Requests",
            431: b"Request Header Fields Too Large", 502: b"Bad Gateway", 503: b"Service Unavailable"}


def _path_str(target: bytes) -> str:
    return target.decode("utf-8", "surrogateescape")


def _path_only(path: str) -> str:
    # Query strings may carry secrets (placeholders, keys): the audit log keeps the path only.
    return path.split("?", 1)[0][:2048]
