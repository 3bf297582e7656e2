"""The policy gate: a mitmproxy addon that decides every connection and request.

Hook order with connection_strategy=lazy (see design.md):
  deny        client_connected → http_connect (403, no upstream connection)
  passthrough http_connect → tls_clienthello(ignore_connection) → server_connect
  intercept   http_connect → tls_clienthello → tls_start_client → requestheaders → server_connect

Every decision is appended to the audit log *before* the sandbox sees its
outcome; if the audit log cannot be written the flow is refused (fail closed).
Decision logic lives in egress.policy (pure); this module is the edge.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from mitmproxy import connection, ctx, http, tls
from mitmproxy.proxy import layers, server_hooks
from mitmproxy.proxy.layer import NextLayer

from egress import netguard
from egress.audit.log import AuditWriteError
from egress.audit.record import now_ts
from egress.http_checks import (PROXY_ONLY_HEADERS, Refusal, check_framing,
                                check_header_limits, split_host_port)
from egress.identity import Identity, IdentityStore
from egress.metrics import GatewayMetrics
from egress.policy import Decision, RequestInfo, normalize_host

log = logging.getLogger("cubegate.gate")

PLAIN_HTTP_PORTS = frozenset({80})
TLS_PORTS = frozenset({443})


class CredentialHook(Protocol):
    """What the vault integration plugs in (see egress/credentials.py)."""

    def needs_interception(self, tenant: str | None, host: str, port: int) -> bool: ...

    def on_request(self, flow: http.HTTPFlow, conn: "ConnState", scheme: str) -> Refusal | dict | None: ...

    def on_request_body(self, flow: http.HTTPFlow, conn: "ConnState") -> Refusal | None: ...

    def on_response(self, flow: http.HTTPFlow, conn: "ConnState") -> None: ...


class NoCredentials:
    def needs_interception(self, tenant, host, port) -> bool:
        return False

    def on_request(self, flow, conn, scheme):
        return None

    def on_request_body(self, flow, conn):
        return None

    def on_response(self, flow, conn) -> None:
        return None


class SandboxLookup(Protocol):
    """Transparent mode: who owns this source address (cubevs registry)."""

    def lookup_by_ip(self, ip: str) -> Identity | None: ...


@dataclass
class ConnState:
    conn_id: str
    client: str
    started: float
    transparent: bool = False
    identity: Identity | None = None
    host: str | None = None          # normalised destination host (CONNECT, or SNI in transparent mode)
    port: int | None = None
    ip_literal: bool = False
    sni: str | None = None
    decision: Decision | None = None
    intercept: bool = False
    tunnel: bool = False             # an allowed CONNECT (or transparent TLS) fixed the destination
    kind: str = "pending"            # passthrough | intercept | http | denied | tcp
    denied_reason: str | None = None
    upstream: str | None = None
    bytes_out: int = 0               # sandbox → upstream
    bytes_in: int = 0                # upstream → sandbox
    requests: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    head_timer: Any = None           # slowloris: fires if the request head / ClientHello is not complete


class _CountingReader:
    """Wraps a connection's StreamReader to count bytes (mitmproxy keeps no counters)."""

    def __init__(self, inner, on_bytes):
        self._inner = inner
        self._on_bytes = on_bytes

    async def read(self, n: int = -1) -> bytes:
        data = await self._inner.read(n)
        if data:
            self._on_bytes(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._inner, name)


class PolicyGate:
    def __init__(
        self,
        *,
        policies,                      # egress.policy.PolicyStore (has .current)
        identities: IdentityStore,
        guard: netguard.AddressGuard,
        resolver: netguard.GuardedResolver,
        audit,                          # egress.audit.log.AuditLog
        metrics: GatewayMetrics,
        credentials: CredentialHook | None = None,
        sandbox_lookup: SandboxLookup | None = None,
        max_header_count: int = 100,
        max_header_bytes: int = 32 * 1024,
        header_timeout: float | None = None,
        upstream_timeout: float | None = None,
        connect_timeout: float | None = None,
    ):
        self.policies = policies
        self.identities = identities
        self.guard = guard
        self.resolver = resolver
        self.audit = audit
        self.metrics = metrics
        self.credentials = credentials or NoCredentials()
        self.sandbox_lookup = sandbox_lookup
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.upstream_timeout = upstream_timeout
        self.connect_timeout = connect_timeout
        self._connect_timers: dict[str, asyncio.TimerHandle] = {}
        self._connect_timeouts: set[str] = set()
        self.conns: dict[str, ConnState] = {}

    # ------------------------------------------------------------------ helpers
    def _audit(self, event: str, st: ConnState | None, **fields: Any) -> bool:
        rec: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "ts": now_ts(),
            "event": event,
        }
        if st is not None:
            rec.update(
                conn_id=st.conn_id,
                client=st.client,
                sandbox=st.identity.sandbox_id if st.identity else None,
                host=st.host,
                port=st.port,
                sni=st.sni,
            )
        rec.update({k: v for k, v in fields.items() if v is not None})
        try:
            self.audit.append(rec)
            return True
        except (AuditWriteError, OSError, ValueError) as e:
            self.metrics.audit_errors.inc()
            log.error("audit append failed, refusing flow: %s", e)
            return False

    def _decision_fields(self, d: Decision) -> dict[str, Any]:
        return dict(decision=d.action, reason=d.reason, rule=d.rule, policy=d.policy, mode=d.mode,
                    would_deny=d.would_deny or None)

    def _count(self, st: ConnState, action: str, reason: str, stage: str) -> None:
        sandbox = st.identity.sandbox_id if st.identity else "-"
        self.metrics.decisions.labels(sandbox, action, reason, stage).inc()

    def _kill_client(self, client: connection.Client) -> None:
        ps = ctx.master.addons.get("proxyserver")
        handler = ps.connections.get(client.id) if ps else None
        if handler is None:
            return
        transport = getattr(getattr(handler.transports.get(client), "writer", None), "transport", None)
        handler.close_connection(client)
        # close_connection only cancels the handler task; when that task is itself waiting
        # on this hook (e.g. after an await in tls_clienthello) the socket stays open and
        # the sandbox hangs until its own timeout. Reset it now (nothing buffered is lost).
        if transport is not None and not transport.is_closing():
            if transport.get_write_buffer_size() == 0:
                transport.abort()
            else:
                transport.close()     # flush what is queued (e.g. a 403), then close

    # --------------------------------------------------------------- deadlines
    # mitmproxy 12 only has tcp_timeout, an inactivity timer that every byte resets:
    # a client sending its head at 1 byte/s, or an upstream trickling its answer,
    # would hold a connection forever. These timers bound the whole head instead.
    def _arm_head_timer(self, st: ConnState, client: connection.Client) -> None:
        self._disarm_head_timer(st)
        if self.header_timeout:
            st.head_timer = asyncio.get_running_loop().call_later(self.header_timeout, self._head_timed_out, client)

    @staticmethod
    def _disarm_head_timer(st: ConnState | None) -> None:
        if st is not None and st.head_timer is not None:
            st.head_timer.cancel()
            st.head_timer = None

    def _head_timed_out(self, client: connection.Client) -> None:
        st = self.conns.get(client.id)
        if st is None:
            return
        st.head_timer = None
        st.kind, st.denied_reason = "denied", "header_timeout"  # in the connection_closed record
        self._count(st, "deny", "header_timeout", "connect")
        self._kill_client(client)

    def _arm_upstream_timer(self, flow: http.HTTPFlow) -> None:
        if self.upstream_timeout and "cubegate_up_timer" not in flow.metadata:
            flow.metadata["cubegate_up_timer"] = asyncio.get_running_loop().call_later(
                self.upstream_timeout, self._upstream_timed_out, flow)

    @staticmethod
    def _disarm_upstream_timer(flow: http.HTTPFlow) -> None:
        timer = flow.metadata.pop("cubegate_up_timer", None)
        if timer is not None:
            timer.cancel()

    def _upstream_timed_out(self, flow: http.HTTPFlow) -> None:
        """No complete response head in time: drop the upstream side; mitmproxy answers the client 502."""
        flow.metadata.pop("cubegate_up_timer", None)
        st = self.conns.get(flow.client_conn.id)
        if st is not None:
            self._audit("decision", st, decision="deny", reason="upstream_timeout", method=flow.request.method,
                        path=_path_only(flow.request.path), status=502,
                        extra={"error": f"no response head within {self.upstream_timeout}s"})
            self._count(st, "deny", "upstream_timeout", "upstream")
        ps = ctx.master.addons.get("proxyserver")
        handler = ps.connections.get(flow.client_conn.id) if ps else None
        io = handler.transports.get(flow.server_conn) if handler is not None else None
        if io is not None and io.handler is not None:
            io.handler.cancel("upstream timeout")
        elif handler is not None:
            handler.close_connection(flow.client_conn)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._disarm_upstream_timer(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._disarm_upstream_timer(flow)

    @staticmethod
    def _deny_response(status: int, reason: str, detail: str) -> http.Response:
        body = f"cubegate: request refused: {reason}: {detail}\n"
        return http.Response.make(status, body.encode(), {
            "Content-Type": "text/plain; charset=utf-8",
            "X-Cubegate-Reason": reason,
            "Connection": "close",
        })

    async def _destination(self, st: ConnState, raw_host: str, port: int, *, scheme, method, path) -> tuple[Decision | None, Refusal | None]:
        """Normalise + SSRF-check a destination and ask the policy. No upstream I/O but DNS."""
        literal = netguard.parse_ip_literal(raw_host)
        if literal is not None:
            reason = self.guard.check(literal, port)
            if reason is not None:
                return None, Refusal(403, f"ssrf_{reason}", f"destination {literal} is {reason}")
            host = str(literal)
        else:
            try:
                host = normalize_host(raw_host)
            except ValueError as e:
                return None, Refusal(400, "invalid_host", str(e))
        st.ip_literal = literal is not None
        identity = st.identity
        decision = self.policies.current.decide(RequestInfo(
            sandbox_id=identity.sandbox_id, labels=identity.labels, host=host, port=port,
            scheme=scheme, method=method, path=path, is_ip_literal=literal is not None,
        ))
        st.host, st.port = host, port
        if decision.action == "allow" and literal is None:
            # Resolve now so a name pointing at a private address gets a clear 403
            # instead of a dead tunnel. The connect re-resolves through the same
            # guard, so a rebinding answer cannot slip through in between.
            try:
                await self.resolver.resolve(host, port)
            except netguard.DestinationBlocked as e:
                return decision, Refusal(403, f"ssrf_{e.reason}", str(e))
            except netguard.DestinationUnresolvable as e:
                return decision, Refusal(502, "unresolvable", str(e))
        return decision, None

    # ------------------------------------------------------------- connection
    def client_connected(self, client: connection.Client) -> None:
        st = ConnState(
            conn_id=client.id, client=f"{client.peername[0]}:{client.peername[1]}", started=time.monotonic(),
            transparent=client.proxy_mode.type_name == "transparent",
        )
        self.conns[client.id] = st
        self.metrics.active_connections.inc()
        self._arm_head_timer(st, client)
        if st.transparent:
            ident = self.sandbox_lookup.lookup_by_ip(client.peername[0]) if self.sandbox_lookup else None
            if ident is None:
                st.kind, st.denied_reason = "denied", "unknown_source"
                self._audit("decision", st, decision="deny", reason="unknown_source")
                self._count(st, "deny", "unknown_source", "connect")
                client.error = "unknown source address"
                return
            st.identity = ident
            # Destination comes from SNI/Host; the original destination IP is never trusted.
            st.port = client.sockname[1] if client.sockname else None
        self._wrap_reader(client, "out", st)

    def _wrap_reader(self, conn: connection.Connection, direction: str, st: ConnState) -> None:
        ps = ctx.master.addons.get("proxyserver")
        handler = ps.connections.get(st.conn_id) if ps else None
        io = handler.transports.get(conn) if handler is not None else None
        if io is None or io.reader is None:
            return

        def add(n: int, st=st, direction=direction) -> None:
            if direction == "out":
                st.bytes_out += n
            else:
                st.bytes_in += n

        io.reader = _CountingReader(io.reader, add)

    def client_disconnected(self, client: connection.Client) -> None:
        st = self.conns.pop(client.id, None)
        self.metrics.active_connections.dec()
        if st is None:
            return
        self._disarm_head_timer(st)
        duration = time.monotonic() - st.started
        sandbox = st.identity.sandbox_id if st.identity else "-"
        self.metrics.bytes.labels(sandbox, "out").inc(st.bytes_out)
        self.metrics.bytes.labels(sandbox, "in").inc(st.bytes_in)
        self.metrics.connection_duration.labels(st.kind).observe(duration)
        self._audit(
            "connection_closed", st, bytes_in=st.bytes_in, bytes_out=st.bytes_out,
            duration_ms=round(duration * 1000, 3), upstream=st.upstream,
            decision=st.decision.action if st.decision and st.kind != "denied" else ("deny" if st.kind == "denied" else None),
            reason=st.denied_reason or (st.decision.reason if st.decision else None),
            extra={"kind": st.kind, "requests": st.requests},
        )

    # ---------------------------------------------------------------- CONNECT
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        st = self.conns.get(flow.client_conn.id)
        if st is None:
            flow.response = self._deny_response(503, "no_connection_state", "internal error")
            return
        self._disarm_head_timer(st)
        t0 = time.perf_counter()
        st.identity = self.identities.authenticate_header(flow.request.headers.get("Proxy-Authorization"))
        if st.identity is None:
            reason = "proxy_auth_missing" if "Proxy-Authorization" not in flow.request.headers else "proxy_auth_invalid"
            st.kind, st.denied_reason = "denied", reason
            self._audit("decision", st, decision="deny", reason=reason, method="CONNECT",
                        status=407, extra={"target": f"{flow.request.host}:{flow.request.port}"})
            self._count(st, "deny", reason, "connect")
            flow.response = self._deny_response(407, reason, "send Proxy-Authorization: Basic base64(sandbox_id:token)")
            flow.response.headers["Proxy-Authenticate"] = 'Basic realm="cubegate"'
            return
        decision, refusal = await self._destination(
            st, flow.request.host, flow.request.port, scheme=None, method=None, path=None)
        st.decision = decision
        self.metrics.decision_latency.labels("connect").observe(time.perf_counter() - t0)
        if refusal is None and decision.action != "allow":
            refusal = Refusal(403, decision.reason, _explain(decision))
        if refusal is not None:
            st.kind, st.denied_reason = "denied", refusal.reason
            fields = self._decision_fields(decision) if decision else {}
            fields.update(decision="deny", reason=refusal.reason, status=refusal.status)
            self._audit("decision", st, method="CONNECT", **fields)
            self._count(st, "deny", refusal.reason, "connect")
            flow.response = self._deny_response(refusal.status, refusal.reason, refusal.detail)
            return
        tenant = decision.tenant
        st.intercept = decision.needs_inspection or self.credentials.needs_interception(tenant, st.host, st.port)
        if not self._audit("decision", st, method="CONNECT", status=200,
                           extra={"intercept": st.intercept}, **self._decision_fields(decision)):
            st.kind, st.denied_reason = "denied", "audit_unavailable"
            flow.response = self._deny_response(503, "audit_unavailable", "audit log not writable")
            return
        st.tunnel = True
        self._count(st, decision.action, decision.reason, "connect")
        if st.port in TLS_PORTS | PLAIN_HTTP_PORTS:
            self._arm_head_timer(st, flow.client_conn)  # the ClientHello / first request must follow in time

    # ------------------------------------------------------------- next layer
    def next_layer(self, nextlayer: NextLayer) -> None:
        st = self.conns.get(nextlayer.context.client.id)
        if st is None or nextlayer.layer is None:
            return
        if st.host is None and not st.transparent:
            return  # explicit mode: nothing decided yet (CONNECT comes first)
        layer = nextlayer.layer
        if not nextlayer.context.server.address:
            return
        port = st.port
        reason = None
        if isinstance(layer, layers.TCPLayer) and port in TLS_PORTS | PLAIN_HTTP_PORTS:
            reason = "non_tls_on_tls_port" if port in TLS_PORTS else "non_http_on_http_port"
        elif isinstance(layer, layers.HttpLayer) and port in TLS_PORTS and not nextlayer.context.client.tls:
            reason = "plaintext_on_tls_port"
        if reason:
            st.kind, st.denied_reason = "denied", reason
            self._audit("decision", st, decision="deny", reason=reason)
            self._count(st, "deny", reason, "protocol")
            self._kill_client(nextlayer.context.client)
        elif isinstance(layer, layers.TCPLayer) and st.kind == "pending":
            st.kind = "tcp"

    # -------------------------------------------------------------- ClientHello
    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        client = data.context.client
        st = self.conns.get(client.id)
        self._disarm_head_timer(st)
        if st is None or st.kind == "denied":
            self._kill_client(client)
            return
        sni = data.client_hello.sni
        st.sni = sni
        refusal: Refusal | None = None
        if st.transparent and st.host is None:
            if st.port in PLAIN_HTTP_PORTS:
                refusal = Refusal(403, "tls_on_plain_port", f"TLS ClientHello on plain-HTTP port {st.port}")
            elif not sni:
                refusal = Refusal(403, "sni_missing", "transparent TLS without SNI: destination unknown")
            else:
                decision, refusal = await self._destination(st, sni, st.port or 443, scheme=None, method=None, path=None)
                st.decision = decision
                if refusal is None and decision.action != "allow":
                    refusal = Refusal(403, decision.reason, _explain(decision))
                if refusal is None:
                    st.intercept = decision.needs_inspection or self.credentials.needs_interception(
                        decision.tenant, st.host, st.port)
                    # Connect to the name the sandbox asked for, resolved by us, never to its chosen IP.
                    data.context.server.address = (st.host, st.port)
                    st.tunnel = True
        elif st.host is None:
            refusal = Refusal(403, "tls_without_connect", "TLS to the proxy port without CONNECT")
        elif st.port in PLAIN_HTTP_PORTS:
            refusal = Refusal(403, "tls_on_plain_port", f"TLS ClientHello on plain-HTTP port {st.port}")
        elif sni:
            try:
                sni_host = normalize_host(sni)
            except ValueError as e:
                sni_host = None
                refusal = Refusal(403, "invalid_sni", str(e))
            if refusal is None and sni_host != st.host:
                refusal = Refusal(403, "sni_mismatch", f"SNI {sni_host} differs from CONNECT host {st.host}")
        if refusal is not None:
            st.kind, st.denied_reason = "denied", refusal.reason
            self._audit("decision", st, decision="deny", reason=refusal.reason, status=refusal.status)
            self._count(st, "deny", refusal.reason, "sni")
            self._kill_client(client)
            return
        if st.decision is not None and st.decision.needs_inspection and not st.transparent:
            # Now we know it is TLS: rules that only differ by scheme may settle it without MITM.
            d = self.policies.current.decide(RequestInfo(
                sandbox_id=st.identity.sandbox_id, labels=st.identity.labels, host=st.host, port=st.port,
                scheme="https", is_ip_literal=st.ip_literal))
            if d.action != "allow":
                st.kind, st.denied_reason = "denied", d.reason
                self._audit("decision", st, **self._decision_fields(d))
                self._count(st, "deny", d.reason, "sni")
                self._kill_client(client)
                return
            st.intercept = d.needs_inspection or self.credentials.needs_interception(d.tenant, st.host, st.port)
        if st.transparent and not self._audit("decision", st, extra={"intercept": st.intercept},
                                              **self._decision_fields(st.decision)):
            st.kind, st.denied_reason = "denied", "audit_unavailable"
            self._kill_client(client)
            return
        if st.intercept:
            st.kind = "intercept"
        else:
            st.kind = "passthrough"
            data.ignore_connection = True

    def tls_start_client(self, data: tls.TlsData) -> None:
        st = self.conns.get(data.context.client.id)
        if st is None or st.kind == "denied":
            # Never hand out a certificate for a denied destination.
            self._kill_client(data.context.client)

    # ------------------------------------------------------------ HTTP requests
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        st = self.conns.get(flow.client_conn.id)
        self._disarm_head_timer(st)
        if st is None or st.kind == "denied":
            flow.response = self._deny_response(403, "connection_denied", "connection was refused")
            return
        t0 = time.perf_counter()
        st.requests += 1
        fields = list(flow.request.headers.fields)
        refusal = check_header_limits(fields, max_count=self.max_header_count, max_bytes=self.max_header_bytes) \
            or check_framing(fields)
        in_tunnel = st.tunnel
        scheme = flow.request.scheme
        decision = None
        if refusal is None and in_tunnel:
            refusal = self._check_authority(flow, st)
            if refusal is None:
                decision = self.policies.current.decide(RequestInfo(
                    sandbox_id=st.identity.sandbox_id, labels=st.identity.labels, host=st.host, port=st.port,
                    scheme=scheme, method=flow.request.method, path=flow.request.path, is_ip_literal=st.ip_literal))
        elif refusal is None:
            # Plain proxy request in absolute form: authenticate every request.
            ident = st.identity if st.transparent else self.identities.authenticate_header(
                flow.request.headers.get("Proxy-Authorization"))
            if ident is None:
                refusal = Refusal(407, "proxy_auth_missing" if "Proxy-Authorization" not in flow.request.headers
                                  else "proxy_auth_invalid", "send Proxy-Authorization")
            else:
                st.identity = ident
                host_hdr = flow.request.host_header
                if st.transparent:
                    # flow.request.host is the original destination IP here: the sandbox
                    # chose it, so never use it. The Host header names the destination;
                    # the gateway resolves it and connects to (name, original port).
                    refusal = self._transparent_target(flow, st, host_hdr)
                elif host_hdr:
                    try:
                        hh, _ = split_host_port(host_hdr)
                        if normalize_host(hh) != normalize_host(flow.request.host):
                            refusal = Refusal(421, "host_mismatch",
                                              f"Host header {hh} differs from request target {flow.request.host}")
                    except ValueError as e:
                        refusal = Refusal(400, "invalid_host", str(e))
                if refusal is None:
                    decision, refusal = await self._destination(
                        st, flow.request.host, flow.request.port, scheme=scheme,
                        method=flow.request.method, path=flow.request.path)
                    st.kind = "http"
        for h in PROXY_ONLY_HEADERS:
            flow.request.headers.pop(h, None)
        if refusal is None and decision is not None and decision.action != "allow":
            refusal = Refusal(403, decision.reason, _explain(decision))
        injected = None
        if refusal is None and decision is not None:
            st.decision = decision  # the request-level decision (tenant, rule) is the one in force
            out = self.credentials.on_request(flow, st, scheme)
            if isinstance(out, Refusal):
                refusal = out
            else:
                injected = out
        self.metrics.decision_latency.labels("request").observe(time.perf_counter() - t0)
        fields_d = self._decision_fields(decision) if decision else {}
        if refusal is not None:
            fields_d.update(decision="deny", reason=refusal.reason)
        ok = self._audit("request", st, scheme=scheme, method=flow.request.method, path=_path_only(flow.request.path),
                         status=refusal.status if refusal else None, extra=injected, **fields_d)
        if not ok and refusal is None:
            refusal = Refusal(503, "audit_unavailable", "audit log not writable")
        self._count(st, "deny" if refusal else "allow", refusal.reason if refusal else decision.reason, "request")
        if refusal is not None:
            flow.response = self._deny_response(refusal.status, refusal.reason, refusal.detail)
        else:
            flow.metadata["cubegate_t0"] = time.perf_counter()

    @staticmethod
    def _transparent_target(flow: http.HTTPFlow, st: ConnState, host_hdr: str | None) -> Refusal | None:
        if not host_hdr:
            return Refusal(400, "host_missing", "transparent HTTP request without Host header: destination unknown")
        try:
            hh, _ = split_host_port(host_hdr)
        except ValueError as e:
            return Refusal(400, "invalid_host", str(e))
        flow.request.data.host = hh   # _destination normalises and SSRF-checks it
        flow.request.data.port = st.port or 80
        return None

    def _check_authority(self, flow: http.HTTPFlow, st: ConnState) -> Refusal | None:
        """Inside a tunnel every request must name the tunnel's host (HTTP/2 coalescing, fronting)."""
        authority = flow.request.authority or flow.request.host_header
        if not authority:
            return None  # HTTP/1.0 without Host: the tunnel host applies
        try:
            h, _ = split_host_port(authority)
            lit = netguard.parse_ip_literal(h)
            name = str(lit) if lit is not None else normalize_host(h)
        except ValueError as e:
            return Refusal(400, "invalid_host", str(e))
        if name != st.host:
            return Refusal(421, "authority_mismatch", f"request for {name} inside a tunnel to {st.host}")
        return None

    def request(self, flow: http.HTTPFlow) -> None:
        """Full body available: last chance to stop a secret or placeholder leaving in it."""
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        st = self.conns.get(flow.client_conn.id)
        if st is None or st.identity is None:
            return
        refusal = self.credentials.on_request_body(flow, st)
        if refusal is None:
            self._arm_upstream_timer(flow)  # connect + response head must come within upstream_timeout
            return
        self._audit("request", st, scheme=flow.request.scheme, method=flow.request.method,
                    path=_path_only(flow.request.path), decision="deny", reason=refusal.reason, status=refusal.status)
        self._count(st, "deny", refusal.reason, "body")
        flow.response = self._deny_response(refusal.status, refusal.reason, refusal.detail)

    def response(self, flow: http.HTTPFlow) -> None:
        st = self.conns.get(flow.client_conn.id)
        if st is not None:
            self.credentials.on_response(flow, st)
        t0 = flow.metadata.get("cubegate_t0")
        if t0 is not None and st is not None and st.identity:
            self.metrics.request_latency.labels(st.identity.sandbox_id).observe(time.perf_counter() - t0)

    # ------------------------------------------------------------ upstream side
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        st = self.conns.get(data.client.id)
        address = data.server.address
        if st is None or st.kind == "denied" or address is None:
            data.server.error = "cubegate: connection denied"
            return
        if st.transparent and st.host is None:
            # Nothing decided yet: the only address known is the one the sandbox chose.
            data.server.error = "cubegate: transparent connection without a decided destination"
            return
        host, port = address
        literal = netguard.parse_ip_literal(host)
        if literal is not None:
            reason = self.guard.check(literal, port)
            if reason is not None:
                data.server.error = f"cubegate: blocked destination {literal}: {reason}"
                return
            host = str(literal)
        else:
            try:
                host = normalize_host(host)
            except ValueError:
                data.server.error = "cubegate: invalid upstream host"
                return
        if st.host is not None and (host != st.host or port != st.port):
            data.server.error = f"cubegate: upstream {host}:{port} is not the decided destination {st.host}:{st.port}"
            return
        if self.connect_timeout:
            # mitmproxy dials without a timeout: a black-holed address would hold the
            # sandbox for the kernel's SYN retries (~2 min).
            self._connect_timers[data.server.id] = asyncio.get_running_loop().call_later(
                self.connect_timeout, self._connect_timed_out, data.client, data.server)

    def _connect_timed_out(self, client: connection.Client, server: connection.Server) -> None:
        self._connect_timers.pop(server.id, None)
        ps = ctx.master.addons.get("proxyserver")
        handler = ps.connections.get(client.id) if ps else None
        io = handler.transports.get(server) if handler is not None else None
        if io is not None and io.handler is not None and server.timestamp_tcp_setup is None:
            self._connect_timeouts.add(server.id)
            io.handler.cancel("upstream connect timeout")

    def _connect_done(self, server: connection.Server) -> bool:
        timer = self._connect_timers.pop(server.id, None)
        if timer is not None:
            timer.cancel()
        if server.id in self._connect_timeouts:
            self._connect_timeouts.discard(server.id)
            return True
        return False

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._connect_done(data.server)
        st = self.conns.get(data.client.id)
        peer = data.server.peername
        if st is None or peer is None:
            return
        reason = self.guard.check(peer[0], peer[1])
        st.upstream = f"{peer[0]}:{peer[1]}"
        if reason is not None:
            # Should be impossible (the resolver filtered it); close rather than trust.
            st.kind, st.denied_reason = "denied", f"ssrf_{reason}"
            self._audit("decision", st, decision="deny", reason=f"ssrf_{reason}", upstream=st.upstream)
            self._kill_client(data.client)
            return
        self._wrap_reader(data.server, "in", st)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        timed_out = self._connect_done(data.server)
        st = self.conns.get(data.client.id)
        if st is None:
            return
        err = data.server.error or "connect failed"
        reason = "upstream_blocked" if "blocked destination" in err else "upstream_connect_failed"
        if timed_out:
            reason, err = "upstream_connect_timeout", f"no TCP connection within {self.connect_timeout}s"
        st.denied_reason = st.denied_reason or reason
        self._audit("decision", st, decision="deny", reason=reason, extra={"error": err[:300]})
        self._count(st, "deny", reason, "upstream")


def _explain(d: Decision) -> str:
    parts = [f"policy {d.policy}" if d.policy else "no policy"]
    if d.rule:
        parts.append(f"rule {d.rule}")
    return ", ".join(parts)


def _path_only(path: str) -> str:
    # Query strings may carry secrets (placeholders, keys): the audit log keeps the path only.
    return path.split("?", 1)[0][:2048]
