"""The fast path's connections: accept, read the first bytes, decide, then relay or hand over.

Explicit mode:   CONNECT head (bounded: max_header_bytes, header_timeout) → identity →
                 destination (policy, cached per policy object; SSRF guard, guarded resolve) →
                 403/407 here, or (a tunnel of ours) connection claim → 429, or 200 →
                 ClientHello (bounded) → SNI check → connect upstream (connect_timeout) → relay.
Transparent:     source → sandbox, steered port, ClientHello → SNI = destination → the same.
Handed over to mitmproxy (the bytes already read replayed; the gate decides and audits
everything again, this path writes nothing for such a connection): flows that need
interception (egress.destination.needs_interception), ports other than 443, heads this
path does not parse, and — transparent only — non-TLS bytes on 443. Plain HTTP (absolute-form
http:// on the explicit port, transparent port 80) goes to egress/fastpath/plain.py, which
decides each request and hands over only what it does not implement (proxy.fast_plain_http;
off: plain HTTP is handed over too).

Audit: the records of a connection this path finishes are the gate's records (egress.records):
a decision before the outcome (refused if it cannot be written), connection_closed at the end —
except for a connection refused at its first decision, whose one decision record carries the
closed fields too (extra.closed; README, Audit): nothing is read or relayed after a refusal.
Fail closed: an exception refuses the connection (reset) and audits it, never relays it.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

from egress import hook_guard, mitm_internals, netguard, records
from egress.audit.record import new_id
from egress.conn_state import ConnState
from egress.destination import DecisionCache, connected_refusal, decide_destination, needs_interception
from egress.fastpath import heads
from egress.fastpath.deny_memo import DenyMemo
from egress.fastpath.dial import dial
from egress.fastpath.listeners import listen_sockets
from egress.fastpath.relay import Relay, SpliceRelay
from egress.fastpath.retry_hello import RetryHelloCheck
from egress.http_checks import Refusal
from egress.metrics import LabelCache, MetricBatch
from egress.policy import normalize_host
from egress.revocation import OpenConnection

log = logging.getLogger("cubegate.fastpath")

TLS_PORTS = frozenset({443})
_SOURCE_FIELDS = frozenset({"sandbox", "client", "host"})   # audit_record takes these from st unless given
PLAIN_HTTP_PORTS = frozenset({80})
FORCED_CLOSE_GRACE = 2.0
_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


class FastPath:
    def __init__(self, *, gate, master, listen_host: str, explicit_port: int | None,
                 transparent_port: int | None, idle_timeout: float | None, plain_http: bool = True,
                 splicer=None) -> None:
        self.gate = gate            # the shared pieces: policies, identities, guard, resolver, audit, metrics, claims
        self.master = master        # for the hand-over
        self.listen_host = listen_host
        self.explicit_port = explicit_port
        self.transparent_port = transparent_port
        self.idle_timeout = idle_timeout
        self.splicer = splicer      # cubevs.splice.Splicer (from the composition root) or None: userspace relay
        self.servers: list[asyncio.base_events.Server] = []
        self.specs: dict[bool, str] = {}           # transparent? → the mitmproxy mode of the hand-over
        self.conns: set[_Conn] = set()
        self.handed_over: set[asyncio.Task] = set()
        m = gate.metrics
        self.outcomes = LabelCache(m.fast_path)
        self.tally = MetricBatch()                 # this loop tick's metric updates, written when it ends
        self.decisions = DecisionCache()
        self.denials = DenyMemo(self.decisions)    # policy denials at CONNECT, remembered per generation
        self._decision_count = LabelCache(m.decisions)
        self._latency = LabelCache(m.decision_latency)
        self._request_latency = LabelCache(m.request_latency)
        self._bytes = LabelCache(m.bytes)
        self._duration = LabelCache(m.connection_duration)
        self.plain = None                          # plain HTTP decided and relayed here (proxy.fast_plain_http)
        if plain_http:
            from egress.fastpath.plain import PlainHttp
            self.plain = PlainHttp(self)

    # ------------------------------------------------------------------ listen
    async def start(self, sockets: dict[bool, list] | None = None) -> None:
        """Listen. `sockets` (transparent? → bound listening sockets): ones the daemon made and
        shares between its worker processes (SO_REUSEPORT); None: bind our own."""
        loop = asyncio.get_running_loop()
        for transparent, port in ((False, self.explicit_port), (True, self.transparent_port)):
            if port is None:
                continue
            socks = sockets[transparent] if sockets is not None else listen_sockets(self.listen_host, port)
            for sock in socks:
                bound = sock.getsockname()[1]
                kind = "transparent" if transparent else "regular"
                self.specs.setdefault(transparent, f"{kind}@{self.listen_host}:{bound}")
                self.servers.append(await loop.create_server(
                    lambda t=transparent: _Conn(self, t), sock=sock, backlog=4096))

    def listeners_bound(self) -> tuple[bool, str]:
        if not self.servers:
            return False, "no listeners configured"
        down = [s for s in self.servers if not s.is_serving()]
        if down:
            return False, f"{len(down)} fast-path listener(s) not serving"
        return True, ", ".join(f"{a[0]}:{a[1]}" for s in self.servers for a in (x.getsockname() for x in s.sockets))

    def listen_addrs(self) -> list[tuple]:
        return [sock.getsockname() for s in self.servers for sock in s.sockets]

    async def close_listeners(self) -> None:
        for s in self.servers:
            s.close()
        self.servers = []

    async def drain(self, seconds: float) -> dict:
        """SIGTERM: stop accepting; open connections may finish within `seconds`, then are closed."""
        await self.close_listeners()
        started = time.monotonic()
        stats = {"fast_at_start": len(self.conns), "fast_forced": 0}
        deadline = started + max(0.0, seconds)
        while self.conns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            c.close_now()
            stats["fast_forced"] += 1
        grace = time.monotonic() + FORCED_CLOSE_GRACE
        while self.conns and time.monotonic() < grace:
            await asyncio.sleep(0.05)
        stats["fast_left"] = len(self.conns)
        self.tally.flush()
        log.info("fast path drain done: %s", stats)
        return stats

    # --------------------------------------------------------------- helpers
    def _audit(self, event: str, st: ConnState, **fields) -> bool:
        return records.append(self.gate.audit, self.gate.metrics, records.audit_record(event, st, **fields))

    def _audit_refusal(self, event: str, st: ConnState, **fields) -> bool:
        """A refusal's record, within its source's budget (the gate's: one per worker, both paths)."""
        gate = self.gate
        if _SOURCE_FIELDS.isdisjoint(fields):   # the record's source, reason and host are st's and fields'
            return records.append_refusal_built(gate.audit, gate.metrics, gate.refusal_budget, st,
                                                records.state_refusal_source(st), fields.get("reason"), st.host,
                                                lambda: records.audit_record(event, st, **fields), self.tally)
        return records.append_refusal(gate.audit, gate.metrics, gate.refusal_budget, st,
                                      records.audit_record(event, st, **fields))

    def _count(self, st: ConnState, action: str, reason: str, stage: str) -> None:
        self.tally.inc(self._decision_count(st.sandbox, action, reason, stage))

    def _refuse(self, c: "_Conn", reason: str, *, stage: str, status: int | None = None,
                response: bytes | None = None, **fields) -> None:
        """The deny sequence: state, audit record, metric, then a response (explicit) or a reset."""
        st = c.st
        st.kind, st.denied_reason = "denied", reason
        fields.update(decision="deny", reason=reason, status=status)
        if c.finished_deciding:          # its allow was written: this refusal and connection_closed follow
            self._audit("decision", st, **fields)
        elif c.per_request:              # plain HTTP: connection_closed follows (skipped if this is counted)
            self._audit_refusal("decision", st, **fields)
        else:
            self._audit_refused_connection(c, fields)
        self._count(st, "deny", reason, stage)
        self.tally.inc(self.outcomes("refused"))
        c.finish(response)

    def _audit_refused_connection(self, c: "_Conn", fields: dict) -> None:
        """A connection refused at its first decision gets one record: the decision, carrying what its
        connection_closed record would (no byte goes either way after it: the refusal closes the
        connection; bytes_in is 0, bytes_out what was read, the duration up to now) and
        extra.closed = true. Only when it is written does _forget skip the connection_closed record."""
        st = c.st
        duration = time.monotonic() - st.started        # now: the record may be made later (or never)
        extra = fields.pop("extra", None)

        def fields_with_closed() -> dict:
            closed = records.closed_fields(st, duration)
            closed["extra"].update(extra or {}, closed=True)
            del closed["decision"], closed["reason"]      # the refusal's own, in `fields`
            return {**closed, **fields}

        gate = self.gate
        if not _SOURCE_FIELDS.isdisjoint(fields):
            c.closed_audited = self._audit_refusal("decision", st, **fields_with_closed())
            return
        c.closed_audited = records.append_refusal_built(
            gate.audit, gate.metrics, gate.refusal_budget, st, records.state_refusal_source(st), fields.get("reason"),
            st.host, lambda: records.audit_record("decision", st, **fields_with_closed()), self.tally)

    def internal_error(self, c: "_Conn", e: Exception) -> None:
        """Fail closed on our own bug (here or in plain.py): audited and counted as internal_error,
        logged with the exception's class and frames only (its text may quote what was sent);
        the caller resets the connection."""
        log.error("fast path: refusing connection %s after %s at %s (fail closed)", c.st.conn_id,
                  type(e).__name__, hook_guard.where(e))
        c.handed = False
        if c.st.denied_reason == "internal_error":
            return                       # refused once already
        if c.finished_deciding:          # its allow was audited: this record says why it ended
            c.st.kind, c.st.denied_reason = "denied", "internal_error"
            self._audit("decision", c.st, decision="deny", reason="internal_error", extra={"error": type(e).__name__})
            self._count(c.st, "deny", "internal_error", "internal")
        else:
            self._refuse(c, "internal_error", stage="internal", extra={"error": type(e).__name__})

    def _refuse_http(self, c: "_Conn", refusal: Refusal, *, stage: str, extra_headers=None, **fields) -> None:
        self._refuse(c, refusal.reason, stage=stage, status=refusal.status,
                     response=heads.refusal_response(refusal.status, refusal.reason, refusal.detail, extra_headers),
                     **fields)

    def _hand_over(self, c: "_Conn") -> None:
        """mitmproxy takes the connection from here; the gate decides and audits it."""
        if c.lost:
            return                       # gone already: its connection_closed record is ours
        coro = mitm_internals.hand_over(self.master, self.specs[c.transparent], c.transport, bytes(c.buf), c.eof)
        self.gate.claims.release(c.st)
        c.handed = True
        self.tally.inc(self.outcomes("handed_over"))
        task = asyncio.get_running_loop().create_task(coro)
        self.handed_over.add(task)
        task.add_done_callback(self.handed_over.discard)

    # ----------------------------------------------------------------- serve
    async def serve(self, c: "_Conn") -> None:
        try:
            if c.transparent:
                await self._transparent(c)
            else:
                await self._explicit(c)
        except Exception as e:   # fail closed: refused and audited, never relayed
            self.internal_error(c, e)
            c.abort()
        finally:
            if c.handed:
                self._forget(c, audit=False)
            else:
                if c.relay is not None:
                    await c.relay.done
                else:
                    c.finish(None)       # every path has answered by now; this only makes sure
                self._forget(c, audit=True)

    def _register(self, c: "_Conn") -> None:
        """From its allowed decision on, the connection is revocable: a policy change that now
        denies it closes it (PolicyGate.revoke_where audits policy_revoked, then calls c.revoke)."""
        st = c.st
        self.gate.register_connection(OpenConnection(st.conn_id, st.identity.sandbox_id, st.host, st.port,
                                                     labels=st.identity.labels, ip_literal=st.ip_literal,
                                                     kind="passthrough", issued=st.identity.issued,
                                                     transparent=st.transparent,
                                                     upstream_ip=st.upstream.rpartition(":")[0] if st.upstream else None),
                                      c.revoke)

    def _forget(self, c: "_Conn", *, audit: bool) -> None:
        self.conns.discard(c)
        self.gate.unregister_connection(c.st.conn_id)
        self.tally.inc(self.gate.metrics.active_connections, -1)
        st = c.st
        if c.timer is not None:
            c.timer.cancel()
        if not audit:
            return
        self.gate.claims.release(st)
        duration = time.monotonic() - st.started
        # adding zero (a refusal has no bytes in) would still be a locked metric write
        if st.bytes_out:
            self.tally.inc(self._bytes(st.sandbox, "out"), st.bytes_out)
        if st.bytes_in:
            self.tally.inc(self._bytes(st.sandbox, "in"), st.bytes_in)
        self.tally.observe(self._duration(st.kind), duration)
        if st.refusal_counted and not st.tunnel and st.requests <= 1:
            return                       # refused at its first decision and counted: its closed record is that count
        if not c.closed_audited:         # else its refusal's decision record was the closed record too
            self._audit("connection_closed", st, **records.closed_fields(st, duration))

    async def _head(self, c: "_Conn", enough) -> bool:
        """Wait until `enough(buf)` or EOF; False (handled: timeout recorded, or the peer left)."""
        ok = await c.fill(enough, self.gate.header_timeout)
        if ok:
            return True
        if c.timed_out:
            st = c.st
            st.kind, st.denied_reason = "denied", "header_timeout"   # in the connection_closed record
            self._count(st, "deny", "header_timeout", "connect")
            c.finish(None)
        return False

    # ---------------------------------------------------------------- explicit
    async def _explicit(self, c: "_Conn") -> None:
        gate, st = self.gate, c.st
        limit = gate.max_header_bytes
        if not await self._head(c, lambda b: heads.head_end(b) >= 0 or len(b) > limit):
            if c.eof and not c.lost:
                if c.buf:
                    self._hand_over(c)   # a head cut by EOF: mitmproxy answers it as it always did
                else:
                    c.finish(None)
            return
        end = heads.head_end(c.buf)
        connect = heads.parse_connect(bytes(c.buf[:end]), gate.max_header_count) if end >= 0 else None
        if connect is None:
            if end >= 0 and self.plain is not None and self.plain.takes_explicit(bytes(c.buf[:end])):
                await self.plain.serve(c)   # absolute-form http:// requests: egress/fastpath/plain.py
                return
            self._hand_over(c)           # a head we do not parse (or plain HTTP with fast_plain_http off)
            return
        t0 = time.perf_counter()
        auth = connect.proxy_authorization   # two of them: none to use, yet not missing (refused as invalid)
        ident, reason = gate.explicit_identity("" if auth is None and connect.has_proxy_authorization else auth,
                                               c.peer[0])
        if ident is None:
            self._refuse_http(c, Refusal(407, reason, "send Proxy-Authorization: Basic base64(sandbox_id:token)"),
                              stage="connect", extra_headers={"Proxy-Authenticate": 'Basic realm="cubegate"'},
                              method="CONNECT", extra={"target": f"{connect.host}:{connect.port}"})
            return
        st.identity = ident
        verdict, denied = await self.denials.decide(st, connect.host, connect.port, policies=gate.policies,
                                                    guard=gate.guard, resolver=gate.resolver)
        decided_under = gate.policies.current   # the verdict's (no await since it was made)
        decision, refusal = verdict.decision, verdict.refusal
        self.tally.observe(self._latency("connect"), time.perf_counter() - t0)
        if c.lost:
            return
        if denied is not None:           # a policy denial (remembered: egress/fastpath/deny_memo.py)
            self._refuse(c, denied.refusal.reason, stage="connect", status=denied.refusal.status, method="CONNECT",
                         response=denied.page, **denied.fields)
            return
        if refusal is None and decision.action != "allow":
            refusal = records.policy_refusal(decision)
        if refusal is not None:
            fields = records.decision_fields(decision) if decision else {}
            fields.pop("decision", None), fields.pop("reason", None)   # the refusal's (a guard refusal of an allow)
            self._refuse(c, refusal.reason, stage="connect", status=refusal.status, method="CONNECT",
                         response=heads.refusal_response(refusal.status, refusal.reason, refusal.detail, st=st,
                                                         decision=decision), **fields)
            return
        if st.port not in TLS_PORTS or needs_interception(decision, gate.credentials, st.host, st.port):
            self._hand_over(c)           # the CONNECT is replayed: the gate re-decides, claims and audits it
            return
        # Counted once it is a tunnel of ours: a refusal above (closed at once) or a hand-over (the
        # gate claims) never takes the budget, and saves the shared table's two locked updates.
        if not gate.claims.claim(st, ident):
            self._refuse_http(c, Refusal(429, "sandbox_connection_limit",
                                         f"sandbox already holds {gate.max_connections_per_sandbox} connections"),
                              stage="connect", method="CONNECT")
            return
        st.decision = decision
        c.finished_deciding = True
        if not self._audit("decision", st, method="CONNECT", status=200, extra={"intercept": False},
                           **records.decision_fields(decision)):
            st.kind, st.denied_reason = "denied", "audit_unavailable"
            c.finish(heads.refusal_response(503, "audit_unavailable", "audit log not writable"))
            return
        st.tunnel = True
        self._register(c)
        self._count(st, decision.action, decision.reason, "connect")
        del c.buf[:end]
        c.transport.write(heads.ESTABLISHED)
        hello = await self._hello(c)
        if hello is None:
            return
        if hello.state != "tls":
            self._protocol_refusal(c, hello)
            return
        st.sni = hello.sni
        if hello.sni_unread:
            self._refuse(c, "invalid_sni", stage="sni", status=403)
            return
        if hello.sni:
            try:
                sni_host = normalize_host(hello.sni)
            except ValueError as e:
                self._refuse(c, "invalid_sni", stage="sni", status=403, extra={"detail": str(e)[:200]})
                return
            if sni_host != st.host:
                self._refuse(c, "sni_mismatch", stage="sni", status=403)
                return
        await self._pass_through(c, verdict, decided_under)

    async def _hello(self, c: "_Conn") -> heads.Hello | None:
        """The first bytes of a TLS connection, complete (bounded by max_header_bytes and header_timeout)."""
        limit = max(self.gate.max_header_bytes, 16 * 1024 + 5)
        state: list[heads.Hello] = []

        def enough(buf) -> bool:
            h = heads.read_hello(bytes(buf), c.eof)
            if h.state != "incomplete" or len(buf) > limit:
                state.append(h)
                return True
            return False

        if not await self._head(c, enough):
            if c.eof and not c.lost:
                c.finish(None)           # the sandbox hung up before its ClientHello
            return None
        h = state[-1] if state else heads.read_hello(bytes(c.buf), True)
        return heads.Hello("invalid") if h.state == "incomplete" else h

    def _protocol_refusal(self, c: "_Conn", hello: heads.Hello) -> None:
        if hello.state == "invalid":
            self._refuse(c, "invalid_client_hello", stage="protocol")
        elif hello.looks_like_http:
            self._refuse(c, "plaintext_on_tls_port", stage="protocol")
        else:
            self._refuse(c, "non_tls_on_tls_port", stage="protocol")

    # ------------------------------------------------------------- transparent
    async def _transparent(self, c: "_Conn") -> None:
        gate, st = self.gate, c.st
        st.transparent = True
        ident = gate.sandbox_lookup.lookup_by_ip(c.peer[0]) if gate.sandbox_lookup else None
        if ident is None:
            self._refuse(c, "unknown_source", stage="connect")
            return
        st.identity = ident
        # The destination comes from the SNI; the original destination IP is never trusted.
        # Only connections the switch steered (80/443) are served (see the gate's client_connected).
        st.conn_port = st.port = mitm_internals.original_destination(c.transport)[1]
        if st.port not in TLS_PORTS | PLAIN_HTTP_PORTS:
            self._refuse(c, "not_steered", stage="connect")
            return
        if st.port in PLAIN_HTTP_PORTS:
            if self.plain is not None:
                c.timer_cancel()         # plain.py keeps the head's deadline (from the accept) itself
                await self.plain.serve(c)   # decided per request: egress/fastpath/plain.py
            else:
                self._hand_over(c)       # plain HTTP: the gate decides each request
            return
        if not gate.claims.claim(st, ident):
            self._refuse(c, "sandbox_connection_limit", stage="connect")
            return
        hello = await self._hello(c)
        if hello is None:
            return
        if hello.state != "tls":
            self._hand_over(c)           # non-TLS bytes on 443: the gate refuses them as it always did
            return
        st.sni = hello.sni
        if hello.sni_unread:
            self._refuse(c, "invalid_sni", stage="sni", status=403)
            return
        if not hello.sni:
            self._refuse(c, "sni_missing", stage="sni", status=403)
            return
        verdict = await decide_destination(st, hello.sni, st.port, policies=gate.policies, guard=gate.guard,
                                           resolver=gate.resolver, scheme=None, method=None, path=None,
                                           cache=self.decisions)
        decided_under = gate.policies.current   # the verdict's (no await since it was made)
        decision, refusal = verdict.decision, verdict.refusal
        if c.lost:
            return
        if refusal is None and decision.action != "allow":
            refusal = records.policy_refusal(decision)
        if refusal is not None:
            st.decision = decision
            self._refuse(c, refusal.reason, stage="sni", status=refusal.status)
            return
        if needs_interception(decision, gate.credentials, st.host, st.port):
            self._hand_over(c)
            return
        st.decision = decision
        c.finished_deciding = True
        if not self._audit("decision", st, extra={"intercept": False}, **records.decision_fields(decision)):
            st.kind, st.denied_reason = "denied", "audit_unavailable"
            c.finish(None)
            return
        st.tunnel = True
        self._register(c)
        self._count(st, decision.action, decision.reason, "sni")   # explicit mode counts at CONNECT
        await self._pass_through(c, verdict, decided_under)

    # ------------------------------------------------------------ passthrough
    async def _pass_through(self, c: "_Conn", verdict, decided_under) -> None:
        """Connect to the verdict's guarded addresses (never a name resolved again: no rebinding
        window), relay. `decided_under`: the policy object in force when the verdict was made."""
        gate, st = self.gate, c.st
        st.kind = "passthrough"
        c.timer_cancel()
        check = RetryHelloCheck(st.host, bool(st.sni), normalize_host)   # st.host: what the first hello named

        def refused(reason: str) -> None:
            st.denied_reason = reason
            self._audit("decision", st, decision="deny", reason=reason, upstream=st.upstream)
            self._count(st, "deny", reason, "sni")

        if self.splicer is not None:
            relay = SpliceRelay(c.transport, c.count_out, c.count_in, self.idle_timeout, self.splicer,
                                on_spliced=self.outcomes("spliced").inc, hello_check=check, on_refused=refused)
        else:
            relay = Relay(c.transport, c.count_out, c.count_in, self.idle_timeout, check, refused)
        d = await dial(relay.upstream_protocol, verdict.addresses, st.port, gate.connect_timeout, lambda: c.lost)
        transport, connected_ip = d.transport, d.ip
        if transport is None:
            st.denied_reason = st.denied_reason or d.reason
            self._audit("decision", st, decision="deny", reason=d.reason, status=502, extra={"error": d.error})
            self._count(st, "deny", d.reason, "upstream")
            c.finish(None)
            return
        # the address we dialled (a canonical literal, connected to as given): no getpeername needed
        st.upstream = f"{connected_ip}:{st.port}"
        blocked = None
        if not _checked_already(gate, verdict, decided_under):
            blocked = connected_refusal(gate.guard, gate.policies.current, st.sandbox, connected_ip, st.port)
        if blocked is not None or c.lost or c.transport.is_closing():   # closing: revoked while connecting
            transport.abort()
            if blocked is not None:   # should be impossible (the resolver filtered it); close rather than trust
                st.kind, st.denied_reason = "denied", blocked
                self._audit("decision", st, decision="deny", reason=blocked, upstream=st.upstream)
            c.finish(None)
            return
        self._register(c)   # again, with the address connected to (revocable by a deny CIDR added later)
        first = bytes(c.buf)
        c.buf.clear()
        c.relay = relay
        relay.client.eof_pending = c.eof
        self.tally.inc(self.outcomes("relayed"))
        relay.start(first)


def _checked_already(gate, verdict, decided_under) -> bool:
    """The addresses of a resolved verdict passed the resolver's guard and the deny CIDRs of the
    policy it was made under (keep_undenied), and the one dialled is one of them: while that same
    policy object is in force, and the resolver guards with the gate's guard, connected_refusal
    (pure) would answer the same again. A policy swapped in meanwhile is checked (a CIDR it adds)."""
    return (verdict.resolved and gate.policies.current is decided_under
            and getattr(gate.resolver, "guard", None) is gate.guard)


def _cork(transport) -> bool:
    """TCP_CORK: what is written next waits for our FIN, which Linux tacks onto the unsent
    segment: one packet for the peer's kernel and ours, not two. False: not corked."""
    sock = transport.get_extra_info("socket")
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        return True
    except (AttributeError, OSError):
        return False                     # not TCP (a test's socketpair): sent as written


def _send_fin(transport) -> None:
    """shutdown(SHUT_WR) of the transport's socket (uvloop's transport socket has no shutdown):
    the corked page goes out with the FIN at once."""
    sock = transport.get_extra_info("socket")
    s = socket.socket(sock.family, sock.type, sock.proto, sock.fileno())
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass                             # the peer is gone already: the abort follows
    finally:
        s.detach()                       # the transport owns the descriptor


def _send_with_fin(transport, data: bytes) -> bool:
    """Send `data` and close: written on the transport's idle TCP socket with MSG_MORE, then
    shutdown(SHUT_WR), so the page waits for the FIN, which Linux adds to the same segment (what
    _cork + write + _send_fin do, in two syscalls, not four); then the transport is aborted (the
    close sends nothing more). False, nothing sent nor closed: not TCP, or the socket would block."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in _TCP_FAMILIES:
        return False
    s = socket.socket(sock.family, sock.type, sock.proto, sock.fileno())
    try:
        try:
            n = s.send(data, socket.MSG_MORE)
        except BlockingIOError:
            return False
        except OSError:
            transport.abort()            # the peer is gone: nothing to deliver
            return True
        if n < len(data):                # rare (a page is smaller than any send buffer)
            transport.write(data[n:])    # pushes what MSG_MORE held back; the close flushes, then FINs
            transport.close()
            return True
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass                         # the peer is gone already
    finally:
        s.detach()                       # the transport owns the descriptor
    transport.abort()
    return True


def _conn_id() -> str:
    """str(uuid.uuid4()), without the UUID object (new_id: the same 122 random bits)."""
    h = new_id()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _Conn(asyncio.Protocol):
    """A connection's first bytes, collected (bounded) until the fast path has what it needs."""

    __slots__ = ("fp", "transparent", "buf", "eof", "lost", "timed_out", "handed", "finished_deciding",
                 "closed_audited", "per_request", "relay", "timer", "_accept_deadline", "_waiter", "task",
                 "transport", "st", "peer")   # one per accepted connection: no __dict__ each

    def __init__(self, fp: FastPath, transparent: bool) -> None:
        self.fp = fp
        self.transparent = transparent
        self.buf = bytearray()
        self.eof = self.lost = self.timed_out = False
        self.handed = False
        self.finished_deciding = False
        self.closed_audited = False      # a refusal's one record stands for connection_closed too
        self.per_request = False         # plain HTTP (plain.py) took it: records per request, then closed
        self.relay: Relay | None = None
        self.timer = None
        self._accept_deadline = False    # the timer is the head's, armed at the accept
        self._waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.transport = None
        self.st: ConnState | None = None
        self.peer = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername") or ("?", 0)
        self.st = ConnState(conn_id=_conn_id(), client=f"{self.peer[0]}:{self.peer[1]}",
                            started=time.monotonic(), transparent=self.transparent)
        fp = self.fp
        fp.conns.add(self)
        fp.tally.inc(fp.gate.metrics.active_connections)
        # Served from its first event (bytes, EOF, loss, the deadline), not from here: a head that
        # arrives whole is then decided at once (the workers' eager tasks run to their first real
        # wait), with no future to wake. The head's deadline runs from the accept.
        timeout = fp.gate.header_timeout
        if timeout:
            self.timer = asyncio.get_running_loop().call_later(timeout, self._time_out)
            self._accept_deadline = True

    def _event(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.fp.serve(self))   # held: tasks are weakly referenced
        else:
            self._wake()

    def data_received(self, data: bytes) -> None:
        self.st.bytes_out += len(data)
        self.buf += data
        if len(self.buf) > self.fp.gate.max_header_bytes + 16 * 1024 + 5:
            self.transport.pause_reading()   # bounded: nothing more is read before the decision
        self._event()

    def eof_received(self) -> bool:
        self.eof = True
        self._event()
        return True   # keep our write half open: a refusal may still be sent

    def connection_lost(self, exc) -> None:
        self.lost = True
        self._event()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _time_out(self) -> None:
        self.timer = None
        self.timed_out = True
        self._event()

    def timer_cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    async def fill(self, enough, timeout: float | None) -> bool:
        """Wait until enough(buf), EOF, loss or timeout; True only for enough(buf). The first
        wait's deadline is the one armed at the accept (connection_made), later ones get `timeout`."""
        if self._accept_deadline:
            self._accept_deadline = False
            timeout = None               # the accept's timer (or its firing: timed_out) stands
        else:
            self.timer_cancel()
            self.timed_out = False
        try:
            while True:
                if self.buf and enough(self.buf):
                    return True
                if self.eof or self.lost or self.timed_out:
                    return False   # enough() has seen the EOF already (a ClientHello cut short is "invalid")
                loop = asyncio.get_running_loop()
                if timeout and self.timer is None:
                    self.timer = loop.call_later(timeout, self._time_out)   # armed only when waiting
                self._waiter = loop.create_future()
                await self._waiter
        finally:
            self._waiter = None
            self.timer_cancel()

    # byte counters of the relay
    def count_out(self, n: int) -> None:
        self.st.bytes_out += n

    def count_in(self, n: int) -> None:
        self.st.bytes_in += n

    def finish(self, response: bytes | None) -> None:
        """Send `response` (if any) and close; without one, reset (the gate's _kill_client)."""
        t = self.transport
        if t is None or t.is_closing():
            return
        if response and not t.get_write_buffer_size() and _send_with_fin(t, response):
            return
        corked = bool(response) and _cork(t)   # the page and the FIN leave in one segment, not two
        if response:
            t.write(response)
        if t.get_write_buffer_size():
            t.close()
        else:
            if corked:
                # FIN now, not at the close: bytes the sandbox sent meanwhile would make the close
                # a reset, which drops a page still corked
                _send_fin(t)
            t.abort()

    def revoke(self, reason: str) -> None:
        """The policy now denies this connection: reset it (its connection_closed record says why)."""
        st = self.st
        st.kind, st.denied_reason = "denied", reason
        self.fp._count(st, "deny", reason, "revoke")
        self.abort()

    def abort(self) -> None:
        if self.relay is not None:
            self.relay.abort()
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def close_now(self) -> None:
        """Drain's deadline: a relay is flushed and closed, a connection still deciding is reset."""
        if self.relay is not None:
            self.relay.close()
        else:
            self.abort()
