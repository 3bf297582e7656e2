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
import functools
import hashlib
import inspect
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Protocol

from mitmproxy import connection, ctx, http, tls
from mitmproxy.proxy import layers, server_hooks
from mitmproxy.proxy.layer import NextLayer

from egress import hook_guard, mitm_internals, netguard
from egress.bodies import (BodyLimits, BodyRefused, BufferBudget, RefusedResponseStream, RequestLeakStream,
                           ResponseScrubStream, check_request_body, content_encoding, make_decoder,
                           scrub_response_body)
from egress.http_checks import (PROXY_ONLY_HEADERS, Refusal, check_framing, check_header_limits, method_override,
                                check_request_authority, is_websocket_upgrade, transparent_host)
from egress.conn_state import ConnectionClaims, ConnState
from egress.destination import AGENT_HOST, connected_refusal, decide_destination, keep_undenied, needs_interception
from egress.identity import Identity, IdentityStore, SandboxAddresses, accepted_from
from egress import records
from egress.audit.record import now_ts
from egress.refusal_budget import DEFAULT_REFUSALS_PER_INTERVAL, RefusalBudget
from egress.metrics import GatewayMetrics, LabelCache
from egress.policy import Decision, RequestInfo, normalize_host
from egress.revocation import Closer, OpenConnection, Predicate, Registered, denied_by

__all__ = ["AGENT_HOST", "ConnState", "PolicyGate"]   # ConnState/AGENT_HOST live in egress.conn_state/destination; re-exported

log = logging.getLogger("cubegate.gate")

PLAIN_HTTP_PORTS = frozenset({80})
TLS_PORTS = frozenset({443})


class CredentialHook(Protocol):
    """What the vault integration plugs in (see egress/credentials.py)."""

    def needs_interception(self, tenant: str | None, host: str, port: int) -> bool: ...

    def on_request(self, flow: http.HTTPFlow, conn: "ConnState", scheme: str,
                   override: str | None = None) -> Refusal | dict | None: ...

    def request_needles(self, flow: http.HTTPFlow, conn: "ConnState") -> Any: ...   # vault.Needles | Refusal

    def report_leak(self, conn: "ConnState", secret_ids, where: str) -> None: ...

    def injected_forms(self, flow: http.HTTPFlow) -> Any: ...   # vault.ScrubForms | None (nothing injected)

    def scrub_trailers(self, flow: http.HTTPFlow, trailers) -> Any: ...

    def on_response_headers(self, flow: http.HTTPFlow, conn: "ConnState") -> Refusal | None: ...

    scrubs_bodies: bool


class NoCredentials:
    scrubs_bodies = False

    def needs_interception(self, tenant, host, port) -> bool:
        return False

    def on_request(self, flow, conn, scheme, override=None):
        return None

    def request_needles(self, flow, conn):
        return None

    def report_leak(self, conn, secret_ids, where) -> None:
        return None

    def injected_forms(self, flow):
        return None

    def scrub_trailers(self, flow, trailers):
        return trailers

    def on_response_headers(self, flow, conn):
        return None


class AgentEndpoint(Protocol):
    """What a sandbox may ask the gateway itself at http://cubegate.internal/ (cubegate/agent_endpoint.py)."""

    max_body: int

    def answer(self, identity: Identity, method: str, path: str, body: bytes) -> tuple[int, dict]: ...
    # (or an awaitable of it: a worker process asks the daemon, cubegate/worker.py)


class SandboxLookup(Protocol):
    """Transparent mode: who owns this source address (cubevs registry)."""

    def lookup_by_ip(self, ip: str) -> Identity | None: ...


# What mitmproxy may hold unprocessed from one client while a hook of its runs (DNS, policy,
# vault): reading that client stops past it until the hook is done (egress.mitm_internals).
HOOK_QUEUE_BYTES = 1 << 20


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


@hook_guard.fail_closed   # an exception in any hook refuses its flow/connection (hook_failed)
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
        sandbox_addresses: SandboxAddresses | None = None,
        max_header_count: int = 100,
        max_header_bytes: int = 32 * 1024,
        header_timeout: float | None = None,
        upstream_timeout: float | None = None,
        connect_timeout: float | None = None,
        max_connections_per_sandbox: int | None = None,
        body_limits: BodyLimits | None = None,
        agent_endpoint: "AgentEndpoint | None" = None,
        refusal_budget: RefusalBudget | None = None,
    ):
        self.policies = policies
        self.identities = identities
        self.guard = guard
        self.resolver = resolver
        self.audit = audit
        self.metrics = metrics
        # the per-request series' children, looked up once per label values (labels() locks and converts)
        self._decision_count = LabelCache(metrics.decisions) if metrics is not None else None
        self._latency = LabelCache(metrics.decision_latency) if metrics is not None else None
        self._request_latency = LabelCache(metrics.request_latency) if metrics is not None else None
        self.credentials = credentials or NoCredentials()
        self.sandbox_lookup = sandbox_lookup
        self.sandbox_addresses = sandbox_addresses   # a sandbox's token works from its address only
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.upstream_timeout = upstream_timeout
        self.connect_timeout = connect_timeout
        self._connect_timers: dict[str, asyncio.TimerHandle] = {}
        self._connect_refusals: dict[str, str] = {}   # upstream connection id -> the policy's reason it was not dialled
        self.conns: dict[str, ConnState] = {}
        self.max_connections_per_sandbox = max_connections_per_sandbox
        self.body_limits = body_limits or BodyLimits()
        self.buffer_budget = BufferBudget(self.body_limits.max_buffered_bytes_per_sandbox)
        self.claims = ConnectionClaims(max_connections_per_sandbox)   # shared with the fast path
        # client connection id -> {upstream connection id -> its claim}: released with the upstream, or
        # with the client (mitmproxy cancels a dial waiting for a slot without any further server hook)
        self._upstream_tokens: dict[str, dict[str, "_UpstreamClaim"]] = {}
        self.agent_endpoint = agent_endpoint   # serves cubegate.internal (None: the name is refused like any other)
        self.registered = Registered()   # other data paths' connections (revoke_where closes them too)
        # refusals written one by one per source and interval; the rest counted (flush_refusals)
        self.refusal_budget = refusal_budget or RefusalBudget(DEFAULT_REFUSALS_PER_INTERVAL)
        self._refusals_since = now_ts()

    # ------------------------------------------------------------- revocation
    def register_connection(self, conn: OpenConnection, close: Closer) -> None:
        """Another data path's connection, revocable like ours until unregistered."""
        self.registered.register(conn, close)

    def unregister_connection(self, conn_id: str) -> None:
        self.registered.unregister(conn_id)

    def open_connections(self) -> list[OpenConnection]:
        """Every open connection whose destination is decided (ours with a tunnel/request, and registered ones)."""
        out = []
        for st in list(self.conns.values()):
            if st.identity is None or st.host is None or st.port is None or st.kind in ("denied", "agent") \
                    or (st.kind == "pending" and not st.tunnel):
                continue
            out.append(OpenConnection(st.conn_id, st.identity.sandbox_id, st.host, st.port,
                                      labels=st.identity.labels, ip_literal=st.ip_literal, kind=st.kind,
                                      issued=st.identity.issued, transparent=st.transparent,
                                      upstream_ip=st.upstream.rpartition(":")[0] if st.upstream else None))
        return out + [c for c, _ in self.registered.items()]

    def revoke_where(self, predicate: Predicate) -> list[tuple[OpenConnection, str]]:
        """Close every open connection for which predicate(conn) returns a reason (e.g.
        egress.revocation.denied_by(new_policy)); each gets a `policy_revoked` audit record."""
        revoked = []
        closers = {c.conn_id: close for c, close in self.registered.items()}
        for conn in self.open_connections():
            why = predicate(conn)
            if why is None:
                continue
            revoked.append((conn, why))
            st = self.conns.get(conn.conn_id)
            rec = dict(decision="deny", reason="policy_revoked", extra={"denied_by": why, "kind": conn.kind})
            if st is not None:
                st.kind, st.denied_reason = "denied", "policy_revoked"
                self._audit("decision", st, **rec)
                self._count(st, "deny", "policy_revoked", "revoke")
                client = mitm_internals.client_of(conn.conn_id)
                if client is not None:
                    mitm_internals.close_client(client, flush=False)
            elif conn.conn_id in closers:
                self._audit("decision", None, conn_id=conn.conn_id, sandbox=conn.sandbox_id, host=conn.host,
                            port=conn.port, **rec)
                self.registered.unregister(conn.conn_id)
                try:
                    closers[conn.conn_id]("policy_revoked")
                except Exception:   # one path's failure must not stop the others being closed
                    log.exception("closing a revoked connection failed")
        return revoked

    def relabel(self, labels: Mapping[str, Mapping[str, str]], policy) -> list[tuple[OpenConnection, str]]:
        """Sandboxes whose labels changed (sandbox id → its labels now): their open connections
        are re-decided with the new labels as on a policy change, and the ones `policy` now denies
        are closed (policy_revoked). Ours carry the new labels on, so every later request is
        decided with them; another path's connection is re-registered with them when nothing is
        decided after its CONNECT (a passthrough tunnel), and closed otherwise: its per-request
        state holds the old labels, out of our reach."""
        if not labels:
            return []
        for st in list(self.conns.values()):
            if st.identity is not None and st.identity.sandbox_id in labels:
                st.identity = Identity(st.identity.sandbox_id, dict(labels[st.identity.sandbox_id]))
        stale = set()
        for conn, close in self.registered.items():
            if conn.sandbox_id not in labels:
                continue
            if conn.kind in ("passthrough", "tcp"):
                self.registered.register(replace(conn, labels=dict(labels[conn.sandbox_id])), close)
            else:
                stale.add(conn.conn_id)
        check = denied_by(policy)
        return self.revoke_where(lambda c: "labels_changed" if c.conn_id in stale
                                 else check(c) if c.sandbox_id in labels else None)

    # ------------------------------------------------------------ fail closed
    def hook_failed(self, hook: str, args: tuple, exc: Exception) -> None:
        """One of our hooks raised (a bug, or a part failing in a way nobody planned for): the
        flow or connection is refused, never let through. Audited and counted as internal_error;
        logged with the exception's class and frames only (its text may quote what was sent)."""
        error = type(exc).__name__
        log.error("gate hook %s raised %s at %s: refused (fail closed)", hook, error, hook_guard.where(exc))
        data = args[0] if args else None
        client = _client_of(data)
        try:
            self._fail_closed(hook, data, client, error)
        except Exception as e:   # noqa: BLE001 - the refusal itself failed: reset what we can reach
            log.error("fail-closed refusal after hook %s raised %s: connection reset", hook, type(e).__name__)
            if client is not None:
                mitm_internals.close_client(client, flush=False)

    def _fail_closed(self, hook: str, data: Any, client: connection.Client | None, error: str) -> None:
        flow = data if isinstance(data, http.HTTPFlow) else None
        st = self.conns.get(client.id) if client is not None else None
        if st is None and flow is not None:
            st = flow.metadata.get("cubegate_conn")
        if st is not None:
            st.kind, st.denied_reason = "denied", "internal_error"
        status = None
        if flow is not None:
            status = self._fail_flow(hook, flow, st)
        elif hook == "client_connected" and client is not None:
            client.error = "cubegate: internal error"    # mitmproxy closes it before reading a byte
        elif hook == "server_connect":
            data.server.error = "cubegate: internal error"   # never dialled
            if client is not None:
                mitm_internals.close_client(client, flush=False)
        elif hook not in _AFTER_THE_END and client is not None:
            if isinstance(data, tls.ClientHelloData):
                data.ignore_connection = False   # never a raw pass-through past a failed check
            server = getattr(data, "server", None) or getattr(getattr(data, "context", None), "server", None)
            if server is not None:
                mitm_internals.abort_now(client.id, server)
            mitm_internals.close_client(client, flush=False)
        fields: dict[str, Any] = dict(decision="deny", reason="internal_error", status=status,
                                      extra={"hook": hook, "error": error})
        if flow is not None:
            fields.update(scheme=flow.request.scheme or None, method=flow.request.method,
                          path=_path_only(flow.request.path))
        if st is None:
            fields["conn_id"] = client.id if client is not None else None
        self._audit("decision", st, **fields)
        sandbox = st.identity.sandbox_id if st is not None and st.identity else "-"
        self.metrics.decisions.labels(sandbox, "deny", "internal_error", "internal").inc()

    def _fail_flow(self, hook: str, flow: http.HTTPFlow, st: ConnState | None) -> int | None:
        """Refuse an HTTP flow whose hook raised: our answer where nothing of the flow has reached
        the sandbox yet and nothing of the request has gone upstream, else both sides reset.
        Returns the status answered (None: reset)."""
        self._disarm_upstream_timer(flow)
        self._release_buffer(flow)
        flow.metadata.pop("cubegate_needles", None)
        flow.metadata.pop("cubegate_agent", None)
        streamed_up = hook == "request" and bool(flow.request.stream)   # the body is upstream already
        if hook in ("http_connect", "requestheaders", "request") and not streamed_up:
            refusal = Refusal(503, "internal_error", "the gateway failed to check this request")
            if hook == "requestheaders" and st is not None:
                self._respond_before_body(flow, st, refusal)   # with the refused body's allowance
            else:
                flow.request.stream = False
                flow.response = self._deny_response(refusal.status, refusal.reason, refusal.detail, st=st)
            return 503
        if hook == "responseheaders" or (hook == "response" and flow.response is not None
                                         and not flow.response.stream):
            deny = self._deny_response(502, "internal_error", "the gateway failed to check this response", st=st)
            if hook == "responseheaders":   # the upstream's body is dropped, ours sent (see _refuse_response)
                flow.metadata["cubegate_own_response"] = deny.raw_content
                deny.stream = RefusedResponseStream(deny.raw_content)
            flow.response = deny
            return 502
        if flow.websocket is not None and flow.websocket.messages:
            flow.websocket.messages[-1].drop()
        if flow.killable:
            flow.kill()
        mitm_internals.abort_now(flow.client_conn.id, flow.client_conn, flow.server_conn)
        return None

    # ------------------------------------------------------------------ helpers
    def _audit(self, event: str, st: ConnState | None, **fields: Any) -> bool:
        return records.append(self.audit, self.metrics, records.audit_record(event, st, **fields))

    def _audit_refusal(self, event: str, st: ConnState | None, **fields: Any) -> bool:
        """A refusal's record, within its source's budget (egress.refusal_budget)."""
        return records.append_refusal(self.audit, self.metrics, self.refusal_budget, st,
                                      records.audit_record(event, st, **fields))

    def flush_refusals(self, interval_s: float) -> int:
        """The interval's end (and drain): one refusals_counted record per source past its budget;
        the number of records written. Not writable: logged and counted (the refusals happened)."""
        since, self._refusals_since = self._refusals_since, now_ts()
        recs = records.refusal_summaries(self.refusal_budget.drain(), since=since, interval_s=interval_s,
                                         per_interval=self.refusal_budget.per_interval)
        return sum(records.append(self.audit, self.metrics, r) for r in recs)

    _decision_fields = staticmethod(records.decision_fields)

    def _count(self, st: ConnState, action: str, reason: str, stage: str) -> None:
        sandbox = st.identity.sandbox_id if st.identity else "-"
        self._decision_count(sandbox, action, reason, stage).inc()

    def _deny(self, st: ConnState, reason: str, *, stage: str, status: int | None = None,
              flow: http.HTTPFlow | None = None, client: connection.Client | None = None,
              detail: str = "", **fields: Any) -> None:
        """The one way a connection or request is refused: state, audit record, metric, then
        either a response on `flow` (explicit proxy) or the client connection reset."""
        st.kind, st.denied_reason = "denied", reason
        self._audit_refusal("decision", st, decision="deny", reason=reason, status=status, **fields)
        self._count(st, "deny", reason, stage)
        if flow is not None:
            flow.response = self._deny_response(status or 403, reason, detail or reason)
        elif client is not None:
            self._kill_client(client)

    def _refuse_connection(self, st: ConnState, client: connection.Client, reason: str, *,
                           identity: Identity | None = None) -> None:
        """Refuse at client_connected (transparent mode): mitmproxy closes a client whose
        .error is set before any byte is read."""
        st.identity = identity or st.identity
        st.kind, st.denied_reason = "denied", reason
        self._audit_refusal("decision", st, decision="deny", reason=reason)
        self._count(st, "deny", reason, "connect")
        client.error = reason

    def _claim_connection(self, st: ConnState, identity: Identity) -> bool:
        """Count this connection against its sandbox's budget; False when the budget is spent."""
        return self.claims.claim(st, identity)

    def _release_connection(self, st: ConnState) -> None:
        self.claims.release(st)

    def _kill_client(self, client: connection.Client) -> None:
        # Flush what is queued (e.g. a 403), else reset: the sandbox must not hang on a
        # refused connection until its own timeout.
        mitm_internals.close_client(client, flush=True)

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

    def cubegate_head_timeout(self, client: connection.Client) -> None:
        """A later request head timed out inside mitmproxy (refused 408 there, egress.mitm_internals)."""
        st = self.conns.get(client.id)
        if st is not None and st.denied_reason != "header_timeout":
            st.kind, st.denied_reason = "denied", "header_timeout"  # in the connection_closed record
            self._count(st, "deny", "header_timeout", "connect")

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
        if not mitm_internals.cancel_server(flow.client_conn.id, flow.server_conn, "upstream timeout"):
            mitm_internals.close_client(flow.client_conn, flush=True)

    def error(self, flow: http.HTTPFlow) -> None:
        self._disarm_upstream_timer(flow)
        self._release_buffer(flow)
        # The sandbox may have hung up before this hook runs: the flow keeps its connection's state.
        st = self.conns.get(flow.client_conn.id) or flow.metadata.get("cubegate_conn")
        self._refused_answered(flow, st)
        if st is not None and flow.error is not None and flow.error.msg == mitm_internals.TRAILERS_REFUSED:
            self._audit("request", st, scheme=flow.request.scheme, method=flow.request.method,
                        path=_path_only(flow.request.path), decision="deny", reason="trailers_refused", status=400)
            self._count(st, "deny", "trailers_refused", "body")

    @staticmethod
    def _deny_response(status: int, reason: str, detail: str, *, st: ConnState | None = None,
                       decision: Decision | None = None) -> http.Response:
        """Every refusal: X-Cubegate-Reason plus a short JSON body an agent can read (egress.records)."""
        return http.Response.make(status, records.deny_body(status, reason, detail, st=st, decision=decision),
                                  records.deny_headers(reason))

    async def _destination(self, st: ConnState, raw_host: str, port: int, *, scheme, method, path) -> tuple[Decision | None, Refusal | None]:
        """Normalise + SSRF-check a destination and ask the policy. No upstream I/O but DNS."""
        v = await decide_destination(st, raw_host, port, policies=self.policies, guard=self.guard,
                                     resolver=self.resolver, scheme=scheme, method=method, path=path)
        return v.decision, v.refusal

    def explicit_identity(self, proxy_authorization: str | None, source_ip: str) -> tuple[Identity | None, str]:
        """Who a Proxy-Authorization sent from `source_ip` names, and the 407's reason when that is
        None. Every explicit authentication (CONNECT, absolute-form, both data paths) asks here."""
        reason = "proxy_auth_missing" if proxy_authorization is None else "proxy_auth_invalid"
        ident = None if proxy_authorization is None else self.identities.authenticate_header(proxy_authorization)
        if ident is not None and self.sandbox_addresses is not None and not accepted_from(
                self.sandbox_addresses.address_of(ident.sandbox_id), source_ip):
            ident, reason = None, "proxy_auth_wrong_source"   # a sandbox's token from elsewhere
        return ident, reason

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
                self._audit_refusal("decision", st, decision="deny", reason="unknown_source")
                self._count(st, "deny", "unknown_source", "connect")
                client.error = "unknown source address"
                return
            # Destination comes from SNI/Host; the original destination IP is never trusted.
            # Only connections the switch steered (80/443) are served: one dialled straight at
            # the transparent port would otherwise make us dial an allowed host on that port.
            st.conn_port = st.port = client.sockname[1] if client.sockname else None
            if st.port not in TLS_PORTS | PLAIN_HTTP_PORTS:
                self._refuse_connection(st, client, "not_steered", identity=ident)
                return
            if not self._claim_connection(st, ident):
                self._refuse_connection(st, client, "sandbox_connection_limit", identity=ident)
                return
        self._wrap_reader(client, "out", st)
        mitm_internals.bound_hook_queue(client.id, HOOK_QUEUE_BYTES)
        mitm_internals.cork_writes(client.id, client)   # one send per connection per event

    def _kill_if_open(self, conn_id: str) -> None:
        st = self.conns.get(conn_id)
        client = mitm_internals.client_of(conn_id)
        if st is not None and client is not None:
            st.kind, st.denied_reason = "denied", st.denied_reason or "refused_body_too_large"
            mitm_internals.close_client(client, flush=False)

    def _wrap_reader(self, conn: connection.Connection, direction: str, st: ConnState) -> None:
        def add(n: int, st=st, direction=direction) -> None:
            if direction == "out":
                st.bytes_out += n
                if st.refused_pending:
                    st.refused_allowance -= n
                    if st.refused_allowance < 0:   # a refused request's body beyond its allowance
                        st.refused_pending = 0
                        asyncio.get_running_loop().call_soon(self._kill_if_open, st.conn_id)
            else:
                st.bytes_in += n

        mitm_internals.wrap_reader(st.conn_id, conn, lambda reader: _CountingReader(reader, add))

    def client_disconnected(self, client: connection.Client) -> None:
        for token in self._upstream_tokens.pop(client.id, {}).values():
            self.claims.release(token)       # its upstreams are cancelled next, some before any server hook
        st = self.conns.pop(client.id, None)
        self.metrics.active_connections.dec()
        if st is None:
            return
        if client.error == mitm_internals.CLIENT_HELLO_TOO_LARGE and st.kind != "denied":
            self._refuse_protocol(st, client, "invalid_client_hello")   # already closed: the audit and count
        self._release_connection(st)
        self._disarm_head_timer(st)
        duration = time.monotonic() - st.started
        sandbox = st.identity.sandbox_id if st.identity else "-"
        self.metrics.bytes.labels(sandbox, "out").inc(st.bytes_out)
        self.metrics.bytes.labels(sandbox, "in").inc(st.bytes_in)
        self.metrics.connection_duration.labels(st.kind).observe(duration)
        if st.refusal_counted and not st.tunnel and st.requests <= 1:
            return               # refused at its first decision and counted: its closed record is that count
        self._audit("connection_closed", st, **records.closed_fields(st, duration))

    # ---------------------------------------------------------------- CONNECT
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        st = self.conns.get(flow.client_conn.id)
        if st is None:
            flow.response = self._deny_response(503, "no_connection_state", "internal error")
            return
        self._disarm_head_timer(st)
        t0 = time.perf_counter()
        st.identity, reason = self.explicit_identity(flow.request.headers.get("Proxy-Authorization"),
                                                     flow.client_conn.peername[0])
        if st.identity is None:
            st.kind, st.denied_reason = "denied", reason
            self._audit_refusal("decision", st, decision="deny", reason=reason, method="CONNECT",
                                status=407, extra={"target": f"{flow.request.host}:{flow.request.port}"})
            self._count(st, "deny", reason, "connect")
            flow.response = self._deny_response(407, reason, "send Proxy-Authorization: Basic base64(sandbox_id:token)")
            flow.response.headers["Proxy-Authenticate"] = 'Basic realm="cubegate"'
            return
        if not self._claim_connection(st, st.identity):
            self._deny(st, "sandbox_connection_limit", stage="connect", status=429, flow=flow, method="CONNECT",
                       detail=f"sandbox already holds {self.max_connections_per_sandbox} connections")
            return
        decision, refusal = await self._destination(
            st, flow.request.host, flow.request.port, scheme=None, method=None, path=None)
        st.decision = decision
        self._latency("connect").observe(time.perf_counter() - t0)
        if refusal is None and decision.action != "allow":
            refusal = records.policy_refusal(decision)
        if refusal is not None:
            st.kind, st.denied_reason = "denied", refusal.reason
            fields = self._decision_fields(decision) if decision else {}
            fields.update(decision="deny", reason=refusal.reason, status=refusal.status)
            self._audit_refusal("decision", st, method="CONNECT", **fields)
            self._count(st, "deny", refusal.reason, "connect")
            flow.response = self._deny_response(refusal.status, refusal.reason, refusal.detail, st=st,
                                                decision=decision)
            return
        st.intercept = needs_interception(decision, self.credentials, st.host, st.port)
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
        if st is None:
            return
        if nextlayer.layer is None:
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
            self._refuse_protocol(st, nextlayer.context.client, reason)
        elif isinstance(layer, layers.TCPLayer) and st.kind == "pending":
            st.kind = "tcp"

    def _refuse_protocol(self, st: ConnState, client: connection.Client, reason: str) -> None:
        st.kind, st.denied_reason = "denied", reason
        self._audit_refusal("decision", st, decision="deny", reason=reason)
        self._count(st, "deny", reason, "protocol")
        self._kill_client(client)

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
        if mitm_internals.unread_server_name(data.client_hello):
            refusal = Refusal(403, "invalid_sni", "a server_name that is not exactly one valid host name")
        elif st.transparent and st.host is None:
            if st.port in PLAIN_HTTP_PORTS:
                refusal = Refusal(403, "tls_on_plain_port", f"TLS ClientHello on plain-HTTP port {st.port}")
            elif not sni:
                refusal = Refusal(403, "sni_missing", "transparent TLS without SNI: destination unknown")
            else:
                decision, refusal = await self._destination(st, sni, st.port or 443, scheme=None, method=None, path=None)
                st.decision = decision
                if refusal is None and decision.action != "allow":
                    refusal = records.policy_refusal(decision)
                if refusal is None:
                    st.intercept = needs_interception(decision, self.credentials, st.host, st.port)
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
            self._audit_refusal("decision", st, decision="deny", reason=refusal.reason, status=refusal.status)
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
                self._audit_refusal("decision", st, **self._decision_fields(d))
                self._count(st, "deny", d.reason, "sni")
                self._kill_client(client)
                return
            st.intercept = needs_interception(d, self.credentials, st.host, st.port)
        if st.transparent and not self._audit("decision", st, extra={"intercept": st.intercept},
                                              **self._decision_fields(st.decision)):
            st.kind, st.denied_reason = "denied", "audit_unavailable"
            self._kill_client(client)
            return
        if st.transparent:
            self._count(st, st.decision.action, st.decision.reason, "sni")   # explicit mode counts at CONNECT
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
        if st is None:
            flow.response = self._deny_response(403, "connection_denied", "connection was refused")
            return
        if st.kind == "denied":
            self._respond_before_body(flow, st, Refusal(403, "connection_denied", "connection was refused"))
            return
        t0 = time.perf_counter()
        st.requests += 1
        flow.metadata["cubegate_conn"] = st
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
            ident, reason = (st.identity, "unknown_source") if st.transparent else self.explicit_identity(
                flow.request.headers.get("Proxy-Authorization"), flow.client_conn.peername[0])
            if ident is None:
                refusal = Refusal(407, reason, "send Proxy-Authorization")
            elif not self._claim_connection(st, ident):
                refusal = Refusal(429, "sandbox_connection_limit",
                                  f"sandbox already holds {self.max_connections_per_sandbox} connections")
            else:
                host_hdr = flow.request.host_header
                if st.transparent:
                    # flow.request.host is the original destination IP here: the sandbox
                    # chose it, so never use it. The Host header names the destination;
                    # the gateway resolves it and connects to (name, original port).
                    refusal = self._transparent_target(flow, st, host_hdr)
                else:
                    # The absolute-form target decides; every Host header must name it (host and port).
                    try:
                        target = _canonical_host(flow.request.host)
                    except ValueError as e:
                        refusal = Refusal(400, "invalid_host", str(e))
                    else:
                        refusal = check_request_authority(
                            want_host=target, want_port=flow.request.port, scheme=scheme, authority="",
                            host_headers=flow.request.headers.get_all("host"), normalize=_canonical_host)
                if refusal is None and self.agent_endpoint is not None and _is_agent_target(flow.request.host):
                    self._agent_request(flow, st)   # answered by the gateway itself, never upstream
                    return
                if refusal is None:
                    decision, refusal = await self._destination(
                        st, flow.request.host, flow.request.port, scheme=scheme,
                        method=flow.request.method, path=flow.request.path)
                    st.kind = "http"
        _drop_headers(flow.request.headers, PROXY_ONLY_HEADERS)
        override = None
        if refusal is None and decision is not None and decision.action == "allow":
            override = method_override(flow.request.method, flow.request.headers.fields, flow.request.path)
            if isinstance(override, Refusal):
                refusal, override = override, None
            elif override is not None:
                decision = self._stricter_for_override(st, decision, scheme, override, flow.request.path)
        if refusal is None and decision is not None and decision.action != "allow":
            refusal = records.policy_refusal(decision)
        injected = None
        if refusal is None and decision is not None:
            st.decision = decision  # the request-level decision (tenant, rule) is the one in force
            out = self.credentials.on_request(flow, st, scheme, override)
            if isinstance(out, Refusal):
                refusal = out
            else:
                injected = out
        if refusal is None and decision is not None:
            refusal = self._plan_request_body(flow, st)
        self._latency("request").observe(time.perf_counter() - t0)
        fields_d = self._decision_fields(decision) if decision else {}
        if refusal is not None:
            fields_d.update(decision="deny", reason=refusal.reason)
        audit = self._audit_refusal if refusal is not None else self._audit   # allowed requests: never counted
        ok = audit("request", st, scheme=scheme, method=flow.request.method, path=_path_only(flow.request.path),
                         status=refusal.status if refusal else None, extra=injected, **fields_d)
        if not ok and refusal is None:
            refusal = Refusal(503, "audit_unavailable", "audit log not writable")
        self._count(st, "deny" if refusal else "allow", refusal.reason if refusal else decision.reason, "request")
        if refusal is not None:
            self._respond_before_body(flow, st, refusal, decision)
        else:
            flow.metadata["cubegate_t0"] = time.perf_counter()

    def _stricter_for_override(self, st: ConnState, decision: Decision, scheme: str, override: str,
                               path: str) -> Decision:
        """An allowed request that names another method (X-HTTP-Method-Override and kin) is a
        request for that method to an upstream that honours it: it is allowed only if that method
        is too. Same destination (st.host/port, decided already), same policy object."""
        other = self.policies.current.decide(RequestInfo(
            sandbox_id=st.identity.sandbox_id, labels=st.identity.labels, host=st.host, port=st.port,
            scheme=scheme, method=override, path=path, is_ip_literal=st.ip_literal))
        return other if other.action != "allow" or (other.would_deny and not decision.would_deny) else decision

    def _respond_before_body(self, flow: http.HTTPFlow, st: ConnState, refusal: Refusal,
                             decision: Decision | None = None) -> None:
        """Refuse at the request head. mitmproxy still reads the request's body into memory
        before it answers, so the connection gets a small allowance for that body and is
        closed when the sandbox sends more (see _CountingReader)."""
        self._release_buffer(flow, "request")
        flow.request.stream = False
        flow.metadata.pop("cubegate_needles", None)
        flow.response = self._deny_response(refusal.status, refusal.reason, refusal.detail, st=st,
                                            decision=decision)
        flow.metadata["cubegate_refused_early"] = True
        if st.refused_pending == 0:
            st.refused_allowance = self.body_limits.inspect_buffer_bytes
        st.refused_pending += 1

    def _refused_answered(self, flow: http.HTTPFlow, st: ConnState | None) -> None:
        if flow.metadata.pop("cubegate_refused_early", None) and st is not None:
            st.refused_pending = max(0, st.refused_pending - 1)

    @staticmethod
    def _transparent_target(flow: http.HTTPFlow, st: ConnState, host_hdr: str | None) -> Refusal | None:
        port = st.conn_port or 80
        checked = transparent_host(flow.request.headers.get_all("host"), port)
        if isinstance(checked, Refusal):
            return checked
        hh = checked[0]
        if flow.request.authority:
            # An absolute-form target would reach the upstream as it is, and servers route by it
            # (RFC 9112 3.2.2), not by Host: it must name the same host and port, and goes out
            # in origin form.
            try:
                want = _canonical_host(hh)
            except ValueError as e:
                return Refusal(400, "invalid_host", str(e))
            refusal = check_request_authority(want_host=want, want_port=port, scheme=flow.request.scheme,
                                              authority=flow.request.authority, host_headers=[],
                                              normalize=_canonical_host)
            if refusal is not None:
                return refusal
            flow.request.authority = ""
        flow.request.data.host = hh   # _destination normalises and SSRF-checks it
        flow.request.data.port = port
        return None

    def _check_authority(self, flow: http.HTTPFlow, st: ConnState) -> Refusal | None:
        """Inside a tunnel every name the request carries (absolute-form target or HTTP/2
        :authority, and every Host header) must be the tunnel's host AND port: HTTP/2
        coalescing and domain fronting would otherwise get a key under another name."""
        return check_request_authority(
            want_host=st.host, want_port=st.port, scheme=flow.request.scheme,
            authority=flow.request.authority, host_headers=flow.request.headers.get_all("host"),
            normalize=_canonical_host)

    # ------------------------------------------------------------------ bodies
    # Every body streams; the ones that must be inspected (outbound leak check, scrub on
    # injected flows) stream through a checker (egress/bodies.py). Known-length bodies up
    # to inspect_buffer_bytes may be held whole instead, so a refusal is a readable answer.
    def _plan_request_body(self, flow: http.HTTPFlow, st: ConnState) -> Refusal | None:
        req = flow.request
        length = _content_length(req.headers)
        if length == 0 or _http1_without_body(req):
            return None
        needles = self.credentials.request_needles(flow, st)
        if isinstance(needles, Refusal):
            return needles
        if needles is None or needles.empty:
            req.stream = True
            return None
        encoding = content_encoding(req.headers)
        try:
            make_decoder(encoding, self.body_limits, what="request")
        except BodyRefused as r:
            return Refusal(r.status, r.reason, r.detail)
        if length is not None and self._hold_body(flow, st, length, "request"):
            flow.metadata["cubegate_needles"] = needles
            return None
        req.stream = RequestLeakStream(needles, encoding, self.body_limits,
                                       lambda r: self._stream_refused(flow, st, r, "request"))
        return None

    def _hold_body(self, flow: http.HTTPFlow, st: ConnState, length: int, what: str) -> bool:
        sandbox = st.identity.sandbox_id if st.identity else "-"
        if length > self.body_limits.inspect_buffer_bytes or not self.buffer_budget.reserve(sandbox, length):
            return False
        flow.metadata[f"cubegate_held_{what}"] = (sandbox, length)
        return True

    def _release_buffer(self, flow: http.HTTPFlow, what: str | None = None) -> None:
        for w in (what,) if what else ("request", "response"):
            held = flow.metadata.pop(f"cubegate_held_{w}", None)
            if held is not None:
                self.buffer_budget.release(*held)

    def _stream_refused(self, flow: http.HTTPFlow, st: ConnState, r: BodyRefused, what: str) -> None:
        """A streamed body failed its check: reset both sides now, before anything more is sent."""
        mitm_internals.abort_now(flow.client_conn.id, flow.client_conn, flow.server_conn)
        if r.reason == "credential_leak":
            self.credentials.report_leak(st, r.secret_ids, "body")
        st.kind, st.denied_reason = "denied", r.reason
        self._audit("request" if what == "request" else "response", st, scheme=flow.request.scheme,
                    method=flow.request.method, path=_path_only(flow.request.path), decision="deny",
                    reason=r.reason, extra={"stage": f"{what}_stream", "detail": r.detail})
        self._count(st, "deny", r.reason, "body")

    def _agent_request(self, flow: http.HTTPFlow, st: ConnState) -> None:
        """A request to cubegate.internal: plain HTTP on port 80, a small body of known length;
        answered in request() once the body is in (by the sandbox's identity, nothing else)."""
        st.kind = "agent"
        length = _content_length(flow.request.headers)
        limit = self.agent_endpoint.max_body
        if flow.request.port != 80 or "transfer-encoding" in flow.request.headers or (length or 0) > limit:
            self._audit("request", st, method=flow.request.method, path=_path_only(flow.request.path),
                        decision="deny", reason="agent_request_refused", status=413)
            self._respond_before_body(flow, st, Refusal(413, "agent_request_refused",
                                                        f"port 80 and a Content-Length body of at most {limit} bytes"))
            return
        flow.request.stream = False
        flow.metadata["cubegate_agent"] = True

    async def _agent_answer(self, flow: http.HTTPFlow) -> None:
        st = self.conns.get(flow.client_conn.id)
        if st is None or st.identity is None:
            flow.response = self._deny_response(403, "connection_denied", "connection was refused")
            return
        answer = self.agent_endpoint.answer(st.identity, flow.request.method, flow.request.path,
                                            flow.request.raw_content or b"")
        status, doc = await answer if inspect.isawaitable(answer) else answer   # a worker asks the daemon
        self._audit("request", st, scheme="http", method=flow.request.method, path=_path_only(flow.request.path),
                    decision="allow" if status < 400 else "deny", reason="agent_endpoint", status=status)
        flow.response = http.Response.make(status, (json.dumps(doc) + "\n").encode(), {
            "Content-Type": "application/json", "Cache-Control": "no-store"})

    async def request(self, flow: http.HTTPFlow) -> None:
        """A held request body is complete: check it before anything goes upstream."""
        if flow.metadata.pop("cubegate_agent", None) and flow.response is None:
            await self._agent_answer(flow)
            return
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        st = self.conns.get(flow.client_conn.id)
        if st is None or st.identity is None:
            return
        if flow.request.trailers and self._trailers_leak(flow, st):
            return
        needles = flow.metadata.pop("cubegate_needles", None)
        if needles is not None:
            body = flow.request.raw_content or b""
            try:
                if len(body) > _INLINE_CHECK_BYTES:
                    await asyncio.to_thread(functools.partial(
                        check_request_body, body, content_encoding(flow.request.headers), needles,
                        self.body_limits, on_loop=False))
                else:
                    check_request_body(body, content_encoding(flow.request.headers), needles, self.body_limits)
            except BodyRefused as r:
                if r.reason == "credential_leak":
                    self.credentials.report_leak(st, r.secret_ids, "body")
                self._audit("request", st, scheme=flow.request.scheme, method=flow.request.method,
                            path=_path_only(flow.request.path), decision="deny", reason=r.reason, status=r.status)
                self._count(st, "deny", r.reason, "body")
                flow.response = self._deny_response(r.status, r.reason, r.detail)
                return
            finally:
                self._release_buffer(flow, "request")
        self._arm_upstream_timer(flow)  # connect + response head must come within upstream_timeout

    def _trailers_leak(self, flow: http.HTTPFlow, st: ConnState) -> bool:
        """Request trailers (HTTP/2) are sent after this hook: a secret in them is refused here."""
        needles = self.credentials.request_needles(flow, st)
        if isinstance(needles, Refusal) or needles is None or needles.empty:
            found = () if not isinstance(needles, Refusal) else ("?",)
        else:
            fields = flow.request.trailers.fields
            found = tuple(sorted(needles.find(b"\n".join(k + b": " + v for k, v in fields)
                                              + b"\n" + b"".join(v for _, v in fields))))
        if not found:
            return False
        reason = needles.reason if isinstance(needles, Refusal) else "credential_leak"
        if reason == "credential_leak":
            self.credentials.report_leak(st, found, "trailers")
        self._audit("request", st, scheme=flow.request.scheme, method=flow.request.method,
                    path=_path_only(flow.request.path), decision="deny", reason=reason,
                    extra={"stage": "request_trailers"})
        self._count(st, "deny", reason, "body")
        flow.request.trailers = None
        if flow.request.stream:     # the body is upstream already: cut both sides before the trailers go
            mitm_internals.abort_now(flow.client_conn.id, flow.client_conn, flow.server_conn)
            st.kind, st.denied_reason = "denied", reason
        else:
            self._release_buffer(flow, "request")
            flow.metadata.pop("cubegate_needles", None)
            flow.response = self._deny_response(403, reason, "request trailers carry a secret")
        return True

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._disarm_upstream_timer(flow)
        st = self.conns.get(flow.client_conn.id)
        resp = flow.response
        if st is None or resp is None or "cubegate_own_response" in flow.metadata:
            return
        if resp.status_code == 101 and not is_websocket_upgrade(flow.request.headers, resp):
            # Anything but a WebSocket becomes a raw byte pipe that no check sees, in either
            # direction (and past the per-request policy): refused on every inspected path.
            self._refuse_response(flow, st, Refusal(502, "upgrade_refused",
                                                    "only WebSocket upgrades are relayed on inspected connections"))
            return
        forms = self.credentials.injected_forms(flow)
        if forms is None:
            resp.stream = True
            return
        refusal = self.credentials.on_response_headers(flow, st)
        encoding = content_encoding(resp.headers)
        te = [v.strip().lower() for v in ",".join(resp.headers.get_all("transfer-encoding")).split(",") if v.strip()]
        if refusal is None and te and te != ["chunked"]:
            # A transfer coding mitmproxy does not decode (gzip, chunked) would reach the sandbox
            # compressed, past the scrubber: refused like an unknown Content-Encoding.
            refusal = Refusal(502, "response_undecodable", "response Transfer-Encoding other than chunked")
        if refusal is None and self.credentials.scrubs_bodies:
            try:
                make_decoder(encoding, self.body_limits, what="response")
            except BodyRefused as r:
                refusal = Refusal(r.status, r.reason, r.detail)
        if refusal is not None:
            self._refuse_response(flow, st, refusal)
            return
        if not self.credentials.scrubs_bodies or resp.status_code == 101:
            resp.stream = True      # a WebSocket's messages are scrubbed in websocket_message
            return
        body_expected = _may_have_body(flow)
        length = _content_length(resp.headers)
        if body_expected and length is not None and self._hold_body(flow, st, length, "response"):
            return   # scrubbed whole in response()
        # Even where no body is expected (HEAD, 204, 304) whatever the upstream sends anyway
        # (HTTP/2 DATA frames after a 204) goes through the scrubber.
        resp.stream = ResponseScrubStream(forms, encoding, self.body_limits,
                                          lambda r: self._stream_refused(flow, st, r, "response"))
        if body_expected:
            _reframe_decoded(flow)

    def _refuse_response(self, flow: http.HTTPFlow, st: ConnState, refusal: Refusal) -> None:
        self._audit("response", st, scheme=flow.request.scheme, method=flow.request.method,
                    path=_path_only(flow.request.path), decision="deny", reason=refusal.reason,
                    status=refusal.status, extra={"upstream_status": flow.response.status_code})
        self._count(st, "deny", refusal.reason, "response")
        deny = self._deny_response(refusal.status, refusal.reason, refusal.detail)
        flow.metadata["cubegate_own_response"] = deny.raw_content
        deny.stream = RefusedResponseStream(deny.raw_content)   # upstream body dropped, ours sent
        flow.response = deny

    async def response(self, flow: http.HTTPFlow) -> None:
        st = self.conns.get(flow.client_conn.id)
        self._refused_answered(flow, st)
        own = flow.metadata.pop("cubegate_own_response", None)
        if own is not None:
            if flow.response is not None and not flow.response.raw_content:
                flow.response.raw_content = own    # upstream sent no body: the layer never called our stream
            return
        if st is not None and "cubegate_held_response" in flow.metadata and flow.response is not None:
            try:
                await self._scrub_held_response(flow)
            except BodyRefused as r:
                self._refuse_response(flow, st, Refusal(r.status, r.reason, r.detail))
                flow.response.stream = False
                flow.response.raw_content = flow.metadata.pop("cubegate_own_response")
            finally:
                self._release_buffer(flow, "response")
        if flow.response is not None and flow.response.trailers:
            # Trailers go out after this hook, past both the header and the body scrub.
            flow.response.trailers = self.credentials.scrub_trailers(flow, flow.response.trailers)
        t0 = flow.metadata.get("cubegate_t0")
        if t0 is not None and st is not None and st.identity:
            self._request_latency(st.identity.sandbox_id).observe(time.perf_counter() - t0)

    async def _scrub_held_response(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        body = resp.raw_content or b""
        args = (body, content_encoding(resp.headers), self.credentials.injected_forms(flow), self.body_limits)
        if len(body) > _INLINE_CHECK_BYTES:
            out = await asyncio.to_thread(functools.partial(scrub_response_body, *args, on_loop=False))
        else:
            out = scrub_response_body(*args)
        resp.headers.pop("content-encoding", None)
        resp.raw_content = out
        if "content-length" in resp.headers:
            resp.headers["content-length"] = str(len(out))

    # --------------------------------------------------------------- WebSocket
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        st = self.conns.get(flow.client_conn.id)
        ws = flow.websocket
        if ws is None or not ws.messages:
            return
        msg = ws.messages[-1]
        del ws.messages[:-1]          # mitmproxy keeps every message of a connection: keep one
        if st is None or st.identity is None:
            msg.drop()
            return
        if msg.from_client:
            needles = self.credentials.request_needles(flow, st)
            if isinstance(needles, Refusal):
                reason, leaks = needles.reason, ()
            else:
                leaks = tuple(sorted(needles.find(msg.content))) if needles is not None and not needles.empty else ()
                reason = "credential_leak" if leaks else None
            if reason:
                if leaks:
                    self.credentials.report_leak(st, leaks, "websocket")
                self._ws_refused(flow, st, msg, reason)
            return
        forms = self.credentials.injected_forms(flow)
        if forms is None:
            return
        try:
            out = scrub_response_body(msg.content, None, forms, self.body_limits)
        except BodyRefused as r:
            self._ws_refused(flow, st, msg, r.reason)
            return
        msg.content = out

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        ws = flow.websocket
        if ws is None or not mitm_internals.websocket_message_refused(flow.client_conn.id, flow.server_conn.id):
            return
        st = self.conns.get(flow.client_conn.id) or flow.metadata.get("cubegate_conn")
        if st is not None:
            st.kind, st.denied_reason = "denied", "websocket_message_too_large"
            self._audit("websocket", st, decision="deny", reason="websocket_message_too_large",
                        path=_path_only(flow.request.path),
                        extra={"direction": "out" if ws.closed_by_client else "in",
                               "limit": self.body_limits.max_buffered_bytes_per_sandbox})
            self._count(st, "deny", "websocket_message_too_large", "websocket")
        self._kill_client(flow.client_conn)   # the 1009 is sent: nothing more is read from it

    def _ws_refused(self, flow: http.HTTPFlow, st: ConnState, msg, reason: str) -> None:
        msg.drop()
        self._audit("websocket", st, decision="deny", reason=reason, path=_path_only(flow.request.path),
                    extra={"direction": "out" if msg.from_client else "in"})
        self._count(st, "deny", reason, "websocket")
        mitm_internals.abort_now(flow.client_conn.id, flow.client_conn, flow.server_conn)

    # ------------------------------------------------------------ upstream side
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
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
        if literal is None and not await self._pin_address(st, data.server, host, port):
            return
        if not self._claim_upstream(st, data.server):
            data.server.error = _UPSTREAM_LIMIT
            return
        if self.connect_timeout:
            # mitmproxy dials without a timeout: a black-holed address would hold the
            # sandbox for the kernel's SYN retries (~2 min).
            self._connect_timers[data.server.id] = asyncio.get_running_loop().call_later(
                self.connect_timeout, self._connect_timed_out, data.client, data.server)

    async def _pin_address(self, st: ConnState, server: connection.Server, host: str, port: int) -> bool:
        """Resolve `host` here (guarded), drop the answers a deny CIDR of the policy covers, and have
        mitmproxy dial the first address left: never the name, which it would resolve again (an answer
        that changed since the decision could lead into a denied range). The SNI was set already."""
        try:
            addresses = await self.resolver.resolve(host, port)
        except (netguard.DestinationBlocked, netguard.DestinationUnresolvable) as e:
            server.error = f"cubegate: {e}"   # "blocked destination ..." / "cannot resolve ...", as getaddrinfo's
            return False
        sandbox = st.identity.sandbox_id if st.identity else ""
        kept, denied = keep_undenied(self.policies.current, sandbox, st.decision, addresses, port)
        if denied is not None:   # answered as the fast path answers it: 403, its reason (not a 502)
            self._connect_refusals[server.id] = denied.reason
            refusal = records.policy_refusal(denied)
            server.error = mitm_internals.connect_refusal(refusal.status, refusal.reason, refusal.detail)
            return False
        mitm_internals.note_on_server(server, "dialled_name", (host, port))
        server.address = (kept[0][1], port)
        return True

    def _claim_upstream(self, st: ConnState, server: connection.Server) -> bool:
        """Upstream connections count per sandbox too: over HTTP/2 mitmproxy opens one upstream
        connection per stream to an HTTP/1-only server (up to 5 per client connection). They are
        counted in the same claims as client connections (shared by every worker), under their
        own key, so the cap holds across workers."""
        sandbox = st.identity.sandbox_id if st.identity else None
        if sandbox is None or not self.max_connections_per_sandbox or server.id in self._upstream_tokens.get(
                st.conn_id, ()):
            return True
        token = _UpstreamClaim()
        key = "^" + hashlib.sha256(sandbox.encode()).hexdigest()[:40]   # fits the shared table's id column
        if not self.claims.claim(token, _UpstreamOwner(key)):
            return False
        self._upstream_tokens.setdefault(st.conn_id, {})[server.id] = token
        return True

    def _release_upstream(self, client: connection.Client, server: connection.Server) -> None:
        mine = self._upstream_tokens.get(client.id)
        token = mine.pop(server.id, None) if mine is not None else None
        if token is not None:
            self.claims.release(token)
        if mine is not None and not mine:
            del self._upstream_tokens[client.id]

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._release_upstream(data.client, data.server)

    def _connect_timed_out(self, client: connection.Client, server: connection.Server) -> None:
        self._connect_timers.pop(server.id, None)
        if server.timestamp_tcp_setup is None and mitm_internals.cancel_server(client.id, server,
                                                                               "upstream connect timeout"):
            mitm_internals.note_on_server(server, "connect_timed_out", True)

    def _connect_done(self, server: connection.Server) -> bool:
        timer = self._connect_timers.pop(server.id, None)
        if timer is not None:
            timer.cancel()
        return mitm_internals.take_server_note(server, "connect_timed_out", False)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._connect_done(data.server)
        mitm_internals.cork_writes(data.client.id, data.server)
        name = mitm_internals.take_server_note(data.server, "dialled_name")
        if name is not None:            # reusable for the next request to the name (mitm_internals)
            mitm_internals.name_the_dialled_server(data.server, name)
        st = self.conns.get(data.client.id)
        peer = data.server.peername
        if st is None or peer is None:
            return
        sandbox = st.identity.sandbox_id if st.identity else ""
        reason = connected_refusal(self.guard, self.policies.current, sandbox, peer[0], peer[1])
        st.upstream = f"{peer[0]}:{peer[1]}"
        if reason is not None:
            # Should be impossible (server_connect dials a guarded, policy-filtered address); close rather than trust.
            st.kind, st.denied_reason = "denied", reason
            self._audit("decision", st, decision="deny", reason=reason, upstream=st.upstream)
            self._count(st, "deny", reason, "upstream")
            self._kill_client(data.client)
            return
        self._wrap_reader(data.server, "in", st)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        timed_out = self._connect_done(data.server)
        self._release_upstream(data.client, data.server)
        st = self.conns.get(data.client.id)
        if st is None:
            return
        err = data.server.error or "connect failed"
        reason = "upstream_blocked" if "blocked destination" in err else "upstream_connect_failed"
        refused = self._connect_refusals.pop(data.server.id, None)   # a policy deny at connect time: 403
        reason = refused or reason
        if err == _UPSTREAM_LIMIT:
            reason = "sandbox_connection_limit"
        if timed_out:
            reason, err = "upstream_connect_timeout", f"no TCP connection within {self.connect_timeout}s"
        st.denied_reason = st.denied_reason or reason
        self._audit("decision", st, decision="deny", reason=reason, extra={"error": err[:300]},
                    status=403 if refused else 502 if reason.startswith("upstream_") else None)
        self._count(st, "deny", reason, "upstream")


# hooks after which there is nothing left to refuse (the connection is gone or failing already)
_AFTER_THE_END = frozenset({"client_disconnected", "server_disconnected", "server_connect_error"})


def _client_of(data: Any) -> connection.Client | None:
    """The sandbox's connection a hook's argument belongs to."""
    if isinstance(data, connection.Client):
        return data
    for path in (("client_conn",), ("client",), ("context", "client")):
        obj = data
        for attr in path:
            obj = getattr(obj, attr, None)
        if isinstance(obj, connection.Client):
            return obj
    return None


_INLINE_CHECK_BYTES = 64 * 1024   # larger held bodies are checked in a thread, off the event loop
_UPSTREAM_LIMIT = "cubegate: the sandbox holds its limit of upstream connections"


@dataclass
class _UpstreamOwner:      # what a claim needs of an identity: the key it counts under
    sandbox_id: str


@dataclass
class _UpstreamClaim:      # what a claim needs of a connection's state
    identity: Any = None
    counted_for: str | None = None


def _content_length(headers) -> int | None:
    values = headers.get_all("content-length")
    if len(values) == 1 and values[0].strip().isascii() and values[0].strip().isdigit():
        return int(values[0].strip())
    return None


def _drop_headers(headers, names: tuple[str, ...]) -> None:
    """Remove every field with one of these (lower-case) names; one pass over the fields, where
    mitmproxy's pop() raises and catches a KeyError for each name that is absent."""
    present = {k.decode("latin-1").lower() for k, _ in headers.fields}
    for name in names:
        if name in present:
            headers.pop(name, None)


def _http1_without_body(req: http.Request) -> bool:
    """An HTTP/1 request with neither Content-Length nor Transfer-Encoding has no body
    (RFC 9112 6.3; mitmproxy reads none): nothing to check. HTTP/2 may send DATA anyway."""
    return req.http_version.startswith("HTTP/1") and "content-length" not in req.headers \
        and "transfer-encoding" not in req.headers


def _may_have_body(flow: http.HTTPFlow) -> bool:
    status = flow.response.status_code
    return flow.request.method != "HEAD" and status >= 200 and status not in (204, 304)


def _reframe_decoded(flow: http.HTTPFlow) -> None:
    """The body is forwarded decoded and scrubbed: its encoding and length are no longer the upstream's."""
    headers = flow.response.headers
    headers.pop("content-encoding", None)
    headers.pop("content-length", None)
    if not flow.request.is_http2 and not flow.request.is_http3:
        headers["transfer-encoding"] = "chunked"


def _is_agent_target(host: str) -> bool:
    try:
        return normalize_host(host) == AGENT_HOST
    except ValueError:
        return False


@functools.lru_cache(maxsize=4096)   # pure, and every request's Host goes through it (IDNA is slow)
def _canonical_host(h: str) -> str:
    lit = netguard.parse_ip_literal(h)
    return str(lit) if lit is not None else normalize_host(h)


_explain = records.explain


def _path_only(path: str) -> str:
    # Query strings may carry secrets (placeholders, keys): the audit log keeps the path only.
    return path.split("?", 1)[0][:2048]

