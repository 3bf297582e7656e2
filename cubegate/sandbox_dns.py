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
- other query types for an allowed name: empty NOERROR; opcodes other than
  QUERY: NOTIMP.

Allowed answers are not audited (one record per lookup would double the log;
the connection that follows is audited by the gate). If a deny record cannot
be written the answer is SERVFAIL (fail closed, like the gate).

The sandbox never talks to an upstream DNS server itself: names it cannot
resolve here it cannot exfiltrate data through.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord

from egress.audit.record import make_record
from egress.netguard import DestinationBlocked, DestinationUnresolvable

log = logging.getLogger("cubegate.dns")

TTL = 30
_MAX_TCP_MSG = 65535


class SandboxDns:
    def __init__(self, *, lookup: Any, policies: Any, resolver: Any, audit: Any, ttl: int = TTL):
        self.lookup = lookup            # .lookup_by_ip(ip) -> Identity | None  (None: every query REFUSED)
        self.policies = policies        # PolicyStore (.current: CompiledPolicySet)
        self.resolver = resolver        # egress.netguard.GuardedResolver
        self.audit = audit              # AuditLog (.append(record))
        self.ttl = ttl
        self._transport: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.AbstractServer | None = None
        self._pending: set[asyncio.Task] = set()
        self._lost: asyncio.Future | None = None

    # ---------------------------------------------------------------- serving
    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._lost = loop.create_future()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _UdpProtocol(self), local_addr=(host, port))
        self._tcp = await asyncio.start_server(self._tcp_client, host, port)
        log.info("sandbox DNS on %s:%s (udp+tcp)", host, port)

    async def serve(self) -> None:
        """Runs while the resolver serves (the daemon supervises it); raises when its UDP socket is lost."""
        await self._lost

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

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    async def _udp_query(self, data: bytes, addr: tuple) -> None:
        reply = await self.handle(data, addr[0], addr[1])
        if reply is not None and self._transport is not None:
            if len(reply) > 512:  # no EDNS: truncate, the client retries over TCP
                r = DNSRecord.parse(reply)
                r.rr = []
                r.header.tc = 1
                reply = r.pack()
            self._transport.sendto(reply, addr)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
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
            reply.header.rcode = RCODE.REFUSED
            return reply.pack()
        client = f"{client_ip}:{client_port}"
        policies = self.policies.current
        if policies is None or not qname or not policies.name_may_resolve(ident.sandbox_id, ident.labels, qname):
            reply.header.rcode = RCODE.NXDOMAIN if self._deny(ident, client, qname, "dns_not_allowed", q.qtype) \
                else RCODE.SERVFAIL
            return reply.pack()
        if q.qtype not in (QTYPE.A, QTYPE.AAAA):
            return reply.pack()  # allowed name, no data of that type here
        try:
            addrs = await self.resolver.resolve(qname)
        except DestinationBlocked as e:
            # Every address is private/loopback/...: the sandbox learns none of them.
            if not self._deny(ident, client, qname, f"ssrf_{e.reason}", q.qtype):
                reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        except DestinationUnresolvable as e:
            if e.detail == "NXDOMAIN":
                reply.header.rcode = RCODE.NXDOMAIN
            elif e.detail != "no A or AAAA records":
                reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        except Exception as e:  # never let one query kill the server
            log.warning("sandbox DNS: resolving %s failed: %s", qname, e)
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        want = socket.AF_INET if q.qtype == QTYPE.A else socket.AF_INET6
        for family, ip in addrs:
            if family == want:
                rdata = A(ip) if family == socket.AF_INET else AAAA(ip)
                reply.add_answer(RR(q.qname, q.qtype, rdata=rdata, ttl=self.ttl))
        return reply.pack()

    def _deny(self, ident, client: str, qname: str, reason: str, qtype: int) -> bool:
        """Audit a refused lookup; False if the record could not be written."""
        try:
            rec = make_record("dns", sandbox=ident.sandbox_id, client=client, host=qname,
                              decision="deny", reason=reason, extra={"qtype": QTYPE.get(qtype, str(qtype))})
            self.audit.append(rec)
            return True
        except Exception as e:
            log.error("sandbox DNS: audit append failed, answering SERVFAIL: %s", e)
            return False


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: SandboxDns):
        self.server = server

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.server._spawn(self.server._udp_query(data, addr))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._socket_lost(exc)


async def start_for(daemon) -> SandboxDns | None:
    """Start the sandbox resolver for a Daemon if settings.dns.listen_host is set."""
    s = daemon.settings.dns
    if not s.listen_host:
        return None
    srv = SandboxDns(lookup=getattr(daemon.gate, "sandbox_lookup", None), policies=daemon.policies,
                     resolver=daemon.resolver, audit=daemon.audit)
    await srv.start(s.listen_host, s.port)
    return srv


async def stop_for(srv: SandboxDns | None) -> None:
    if srv is not None:
        await srv.stop()
