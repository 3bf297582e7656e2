"""DNS for sandboxes: answers only names the sandbox's policy allows.

A sandbox (identified by its source address through the cubevs registry, the
same lookup transparent mode uses) gets:

- REFUSED when the source address is not a known sandbox;
- NXDOMAIN, plus an audit record (event "dns", decision deny, reason
  "dns_not_allowed"), when its policy could never allow a request to the name;
- for an allowed name, the A/AAAA addresses the gateway's own GuardedResolver
  returns (private/loopback/metadata addresses already removed), TTL 30, no
  CNAMEs; an allowed name whose every address is refused by the guard gets an
  empty NOERROR answer and a deny audit record (reason ssrf_<guard reason>, as the gate);
  addresses in a deny CIDR of the policy (global, or the sandbox's network-options deny
  address entries for every port) are dropped too, and none left is the same empty answer
  with reason resolved_global_deny / resolved_sandbox_network_deny;
- other query types for an allowed name: empty NOERROR; opcodes other than
  QUERY: NOTIMP.

Allowed answers are audited aggregated (cubegate.dns_accounting): one record
per (sandbox, name) per ``audit_interval`` — decision allow, reason
"dns_allowed", extra queries/answers/qtypes/scope/since — written at the end of
each interval and at stop. Names allowed by a wildcard (not by an exact host
rule) are limited per sandbox and wildcard to ``max_new_names`` distinct new
names per minute; beyond it: NXDOMAIN, never forwarded upstream, reason
"dns_name_rate_limited" (the first refusal per sandbox and wildcard in an
interval at once, then one record per interval with the count). If a record
cannot be written the answer is SERVFAIL (fail closed, like the gate); after a
failed interval flush, allowed names get SERVFAIL until the records are written;
if the flusher itself dies (a bug), every query is SERVFAIL and serve() raises (the
daemon's supervisor turns /readyz 503; nothing restarts a task that died on a bug).

The sandbox never talks to an upstream DNS server itself: names it cannot
resolve here it cannot exfiltrate data through. What remains open (an allowed
wildcard whose authoritative server an attacker runs): see README "Sandbox DNS".
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
import time
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from prometheus_client import CollectorRegistry, Counter

from cubegate.dns_accounting import (FULL, LIMITED, MAX_DENIALS_PER_INTERVAL, AnswerAggregator, Interval,
                                     NewNameLimiter)
from egress.audit.record import make_record, now_ts
from egress.destination import AGENT_HOST, keep_undenied
from egress.netguard import DestinationBlocked, DestinationUnresolvable

log = logging.getLogger("cubegate.dns")

TTL = 30
_MAX_TCP_MSG = 65535
_RETRY_SECONDS = 1.0     # a failed flush is retried this often (allowed names get SERVFAIL meanwhile)
_MAX_UNWRITTEN = 50_000  # records kept for a retry while the audit log fails


class DnsMetrics:
    def __init__(self, registry: CollectorRegistry | None):
        r = registry or CollectorRegistry()
        self.queries = Counter("cubegate_dns_queries_total", "Sandbox DNS queries by outcome",
                               ["sandbox", "result"], registry=r)
        self.overflow = Counter("cubegate_dns_audit_overflow_total",
                                "Allowed DNS queries counted only in the overflow record (aggregation key cap)",
                                ["sandbox"], registry=r)
        self.records = Counter("cubegate_dns_audit_records_total", "DNS audit records written, by kind",
                               ["kind"], registry=r)


class SandboxDns:
    # Bounded work per source address (a sandbox) and in all: a query flood or a pile of idle TCP
    # connections cannot grow memory, file descriptors or upstream DNS load without limit.
    MAX_INFLIGHT_PER_SOURCE = 32     # UDP queries being answered at once; more are dropped (clients retry)
    MAX_INFLIGHT = 2048
    MAX_TCP_PER_SOURCE = 4           # open TCP connections; a new one beyond is closed at once
    MAX_TCP = 512

    def __init__(self, *, lookup: Any, policies: Any, resolver: Any, audit: Any, ttl: int = TTL,
                 audit_interval: float = 60.0, max_new_names: int = 120,
                 metrics_registry: CollectorRegistry | None = None, agent_addr: str | None = None):
        self.lookup = lookup            # .lookup_by_ip(ip) -> Identity | None  (None: every query REFUSED)
        self.policies = policies        # PolicyStore (.current: CompiledPolicySet)
        self.resolver = resolver        # egress.netguard.GuardedResolver
        self.audit = audit              # AuditLog (.append(record))
        self.ttl = ttl
        self.agent_addr = agent_addr    # cubegate.internal → this (the gateway), for sandboxes only
        self.audit_interval = audit_interval
        self.metrics = DnsMetrics(metrics_registry)
        self.aggregator = AnswerAggregator()
        self.limiter = NewNameLimiter(max_new_names)
        self._since = now_ts()           # start of the current aggregation interval
        self._unwritten: collections.deque[dict] = collections.deque()  # of a failed flush, retried first
        self._transport: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.AbstractServer | None = None
        self._flusher: asyncio.Task | None = None
        self._audit_dead: str | None = None   # why the flusher stopped; set: every query is SERVFAIL
        self._pending: set[asyncio.Task] = set()
        self._udp_inflight: collections.Counter[str] = collections.Counter()
        self._tcp_open: collections.Counter[str] = collections.Counter()
        self._lost: asyncio.Future | None = None

    # ---------------------------------------------------------------- serving
    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._lost = loop.create_future()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _UdpProtocol(self), local_addr=(host, port))
        self._tcp = await asyncio.start_server(self._tcp_client, host, port)
        self._flusher = loop.create_task(self._flush_loop(), name="dns-audit-flush")
        self._flusher.add_done_callback(self._flusher_ended)
        log.info("sandbox DNS on %s:%s (udp+tcp)", host, port)

    async def serve(self) -> None:
        """Runs while the resolver serves (the daemon supervises it); raises when its UDP socket is lost."""
        await self._lost

    def _flusher_ended(self, task: asyncio.Task) -> None:
        """The audit flusher stopped (a bug while building records): serve() raises, so the daemon's
        supervisor names it on /readyz, and every query is SERVFAIL from now on (fail closed:
        an allowed answer that cannot be audited is not given)."""
        if task.cancelled() and self._flusher is None:
            return                                   # stop() ended it
        exc = None if task.cancelled() else task.exception()
        self._audit_dead = f"{type(exc).__name__}: {exc}" if exc is not None else "stopped"
        log.error("sandbox DNS: audit flusher died (%s), answering SERVFAIL", self._audit_dead)
        self._socket_lost(RuntimeError(f"sandbox DNS audit flusher died: {self._audit_dead}"))

    def _socket_lost(self, exc: Exception | None) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_exception(exc or ConnectionError("sandbox DNS UDP socket closed"))

    async def stop(self) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
        for t in list(self._pending):
            t.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        if self._flusher is not None:
            flusher, self._flusher = self._flusher, None
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        try:
            await self.flush()   # the last interval's counters are written at shutdown too
        except Exception:        # noqa: BLE001 - the same bug that killed the flusher: stop anyway
            log.exception("sandbox DNS: the last interval's audit records could not be built")

    # ------------------------------------------------------------- aggregated audit
    async def _flush_loop(self) -> None:
        next_flush = time.monotonic() + self.audit_interval
        while True:
            wait = next_flush - time.monotonic()
            if self._unwritten:
                wait = min(wait, _RETRY_SECONDS)
            await asyncio.sleep(max(0.0, wait))
            if time.monotonic() >= next_flush:
                next_flush = time.monotonic() + self.audit_interval
                await self.flush()
            elif self._unwritten:
                await self._write_pending()

    async def flush(self) -> bool:
        """End the interval: its counters become records (written now). False if some could not be."""
        interval, since = self.aggregator.drain(), self._since
        self._since = now_ts()
        self.limiter.sweep(time.monotonic())
        self._unwritten.extend(self._interval_records(interval, since))
        dropped = 0
        while len(self._unwritten) > _MAX_UNWRITTEN:  # bounded even while the log keeps failing
            self._unwritten.popleft()
            dropped += 1
        if dropped:
            log.error("sandbox DNS: %d aggregated audit records dropped (audit log failing)", dropped)
        return await self._write_pending()

    async def _write_pending(self) -> bool:
        written = 0
        while self._unwritten:
            rec = self._unwritten[0]
            try:
                self.audit.append(rec)
            except Exception as e:  # noqa: BLE001 - fail closed below, retry later
                log.error("sandbox DNS: aggregated audit append failed, allowed names get SERVFAIL: %s", e)
                return False
            self._unwritten.popleft()
            self.metrics.records.labels(rec["reason"]).inc()
            written += 1
            if written % 256 == 0:
                await asyncio.sleep(0)   # thousands of names: let the gateway's flows run in between
        return True

    def _interval_records(self, it: Interval, since: str) -> list[dict]:
        base = {"since": since, "interval_s": self.audit_interval}
        out = []
        for (sandbox, name), c in it.names.items():
            out.append(make_record("dns", sandbox=sandbox, host=name, decision="allow", reason="dns_allowed",
                                   extra={**base, "queries": c.queries, "answers": c.answers,
                                          "qtypes": c.qtypes_text(), "scope": c.scope}))
        for (sandbox, scope), c in it.limited.items():
            out.append(make_record("dns", sandbox=sandbox, host=scope, decision="deny",
                                   reason="dns_name_rate_limited",
                                   extra={**base, "refused": c.refused, "first_name": c.first_name,
                                          "limit_per_minute": self.limiter.limit}))
        for (kind, sandbox), c in it.suppressed.items():
            out.append(make_record("dns", sandbox=sandbox if kind == "sandbox" else None,
                                   decision="deny", reason="dns_denials_counted",
                                   extra={**base, "refused": c.counted, "written": c.written,
                                          "counts": c.counts_text(), "max_written": MAX_DENIALS_PER_INTERVAL}))
        for sandbox, n in it.overflow.items():
            out.append(make_record("dns", sandbox=None if sandbox == "*" else sandbox,
                                   reason="dns_audit_overflow",
                                   extra={**base, "queries": n, "max_keys": self.aggregator.max_keys}))
        return out

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    def _udp_received(self, data: bytes, addr: tuple) -> None:
        ip = addr[0]
        if self._udp_inflight[ip] >= self.MAX_INFLIGHT_PER_SOURCE or len(self._pending) >= self.MAX_INFLIGHT:
            self.metrics.queries.labels("", "dropped_busy").inc()
            return
        self._udp_inflight[ip] += 1
        self._spawn(self._udp_query(data, addr))

    async def _udp_query(self, data: bytes, addr: tuple) -> None:
        try:
            reply = await self.handle(data, addr[0], addr[1])
        finally:
            _decrement(self._udp_inflight, addr[0])
        if reply is not None and self._transport is not None:
            if len(reply) > 512:  # no EDNS: truncate, the client retries over TCP
                r = DNSRecord.parse(reply)
                r.rr = []
                r.header.tc = 1
                reply = r.pack()
            self._transport.sendto(reply, addr)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        if self._tcp_open[peer[0]] >= self.MAX_TCP_PER_SOURCE or sum(self._tcp_open.values()) >= self.MAX_TCP:
            self.metrics.queries.labels("", "tcp_refused_busy").inc()
            writer.transport.abort()
            return
        self._tcp_open[peer[0]] += 1
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), timeout=10)
                (n,) = struct.unpack("!H", head)
                data = await asyncio.wait_for(reader.readexactly(n), timeout=10)
                reply = await self.handle(data, peer[0], peer[1])
                if reply is None:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            _decrement(self._tcp_open, peer[0])
            writer.close()

    # --------------------------------------------------------------- answering
    async def handle(self, data: bytes, client_ip: str, client_port: int) -> bytes | None:
        """One DNS message in, one out (None: unparseable, dropped)."""
        try:
            req = DNSRecord.parse(data)
        except Exception:
            return None
        if req.header.qr:  # a response, not a query
            return None
        reply = req.reply()   # sets qr, aa, ra, copies id and questions
        reply.header.aa = 0
        if req.header.opcode != 0:
            reply.header.rcode = RCODE.NOTIMP
            return reply.pack()
        if len(req.questions) != 1:
            reply.header.rcode = RCODE.FORMERR
            return reply.pack()
        q = req.questions[0]
        qname = str(q.qname).rstrip(".").lower()
        ident = self.lookup.lookup_by_ip(client_ip) if self.lookup is not None else None
        if ident is None:
            self.metrics.queries.labels("", "refused").inc()
            reply.header.rcode = RCODE.REFUSED
            return reply.pack()
        sandbox = ident.sandbox_id
        if self._audit_dead is not None:   # nothing answered can be audited any more
            self.metrics.queries.labels(sandbox, "audit_failed").inc()
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        client = f"{client_ip}:{client_port}"
        qtype = QTYPE.get(q.qtype, str(q.qtype))
        if qname == AGENT_HOST and self.agent_addr is not None:
            self.metrics.queries.labels(sandbox, "agent_endpoint").inc()
            if q.qtype == QTYPE.A:
                reply.add_answer(RR(q.qname, QTYPE.A, rdata=A(self.agent_addr), ttl=self.ttl))
            return reply.pack()
        policies = self.policies.current
        if policies is None or not qname or not policies.name_may_resolve(sandbox, ident.labels, qname):
            self.metrics.queries.labels(sandbox, "not_allowed").inc()
            reply.header.rcode = RCODE.NXDOMAIN if self._deny(ident, client, qname, "dns_not_allowed", q.qtype) \
                else RCODE.SERVFAIL
            return reply.pack()
        if self._unwritten:   # the last interval's records are not written yet: answer nothing new
            self.metrics.queries.labels(sandbox, "audit_failed").inc()
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        scope = policies.resolve_scope(sandbox, ident.labels, qname)
        if scope is not None:
            verdict = self.limiter.admit(sandbox, scope, qname, time.monotonic())
            if verdict in (LIMITED, FULL):
                self.metrics.queries.labels(sandbox, "rate_limited").inc()
                ok = True
                if self.aggregator.limited(sandbox, scope, qname):
                    reason = "dns_name_rate_limited" if verdict == LIMITED else "dns_limiter_full"
                    ok = self._deny(ident, client, qname, reason, q.qtype,
                                    scope=scope, limit_per_minute=self.limiter.limit)
                reply.header.rcode = RCODE.NXDOMAIN if ok else RCODE.SERVFAIL
                return reply.pack()
        if q.qtype not in (QTYPE.A, QTYPE.AAAA):
            self._answered(sandbox, qname, qtype, 0, scope)
            return reply.pack()  # allowed name, no data of that type here
        try:
            addrs = await self.resolver.resolve(qname)
        except DestinationBlocked as e:
            # Every address is private/loopback/...: the sandbox learns none of them.
            self.metrics.queries.labels(sandbox, "ssrf_blocked").inc()
            if not self._deny(ident, client, qname, f"ssrf_{e.reason}", q.qtype):
                reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        except DestinationUnresolvable as e:
            if e.detail == "NXDOMAIN":
                reply.header.rcode = RCODE.NXDOMAIN
            elif e.detail != "no A or AAAA records":
                reply.header.rcode = RCODE.SERVFAIL
            self._answered(sandbox, qname, qtype, 0, scope)
            return reply.pack()
        except Exception as e:  # never let one query kill the server
            log.warning("sandbox DNS: resolving %s failed: %s", qname, e)
            self._answered(sandbox, qname, qtype, 0, scope)
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        addrs, denied = keep_undenied(policies, sandbox, None, addrs, None)
        if denied is not None:
            # Every address is in a deny CIDR of the policy: the sandbox learns none of them (the
            # gateway would refuse the connect anyway, on every path).
            self.metrics.queries.labels(sandbox, "denied_address").inc()
            if not self._deny(ident, client, qname, denied.reason, q.qtype, rule=denied.rule):
                reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        want = socket.AF_INET if q.qtype == QTYPE.A else socket.AF_INET6
        for family, ip in addrs:
            if family == want:
                rdata = A(ip) if family == socket.AF_INET else AAAA(ip)
                reply.add_answer(RR(q.qname, q.qtype, rdata=rdata, ttl=self.ttl))
        self._answered(sandbox, qname, qtype, len(reply.rr), scope)
        return reply.pack()

    def _answered(self, sandbox: str, qname: str, qtype: str, answers: int, scope: str | None) -> None:
        self.metrics.queries.labels(sandbox, "allowed").inc()
        if not self.aggregator.answered(sandbox, qname, qtype, answers, scope):
            self.metrics.overflow.labels(sandbox).inc()

    def _deny(self, ident, client: str, qname: str, reason: str, qtype: int, **extra) -> bool:
        """Audit a refused lookup (past the sandbox's per-interval share: counted into one record
        at the interval's end); False if the record could not be written."""
        if not self.aggregator.denied(ident.sandbox_id, qname, reason):
            self.metrics.records.labels("dns_denials_counted").inc()
            return True
        try:
            rec = make_record("dns", sandbox=ident.sandbox_id, client=client, host=qname,
                              decision="deny", reason=reason, extra={"qtype": QTYPE.get(qtype, str(qtype)), **extra})
            self.audit.append(rec)
            self.metrics.records.labels(reason).inc()
            return True
        except Exception as e:
            log.error("sandbox DNS: audit append failed, answering SERVFAIL: %s", e)
            return False


def _decrement(counter: collections.Counter, key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]      # bounded: only sources with work in progress are kept


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: SandboxDns):
        self.server = server

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.server._udp_received(data, addr)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._socket_lost(exc)


async def start_for(daemon) -> SandboxDns | None:
    """Start the sandbox resolver for a Daemon if settings.dns.listen_host is set."""
    s = daemon.settings.dns
    if not s.listen_host:
        return None
    srv = SandboxDns(lookup=getattr(daemon, "sandbox_lookup", None), policies=daemon.policies,
                     resolver=daemon.resolver, audit=daemon.audit, audit_interval=s.audit_interval_seconds,
                     max_new_names=s.max_new_names_per_minute, metrics_registry=daemon.metrics.registry,
                     agent_addr=s.listen_host if getattr(daemon, "agent_endpoint", None) else None)
    await srv.start(s.listen_host, s.port)
    return srv


async def stop_for(srv: SandboxDns | None) -> None:
    if srv is not None:
        await srv.stop()
