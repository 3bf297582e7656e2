"""The lab's authoritative DNS server (UDP and TCP), driven by a JSON zone file.

    python -m testbed.dnsserver --bind 198.18.0.2 --port 53 --zone zone.json

Zone file::

    {
      "api.allowed.test": ["198.18.0.10"],            # A (and AAAA for v6 entries)
      "ula.evil.test": ["fd00::1"],
      "rebind.allowed.test": {"alternate": ["198.18.0.10", "127.0.0.1"]},
      "slow.test": {"addrs": ["198.18.0.19"], "ttl": 60},
      "*.wild.test": ["198.18.0.10"],                  # every name below wild.test (not wild.test)
      "held.test": {"addrs": ["198.18.0.10"], "delay": 1.5}   # answered 1.5 s late (a hook held)
    }

Plain entries answer with TTL 1; ``alternate`` entries answer one address per
query, rotating (per name and record type), with TTL 0. Unknown names get
NXDOMAIN; known names without an address of the asked type get an empty
NOERROR. The file is re-read when it changes. Every query is logged to stdout.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import threading
import time
from collections import defaultdict

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

DEFAULT_TTL = 1


class ZoneResolver(BaseResolver):
    def __init__(self, zone_path: str) -> None:
        self.zone_path = zone_path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._zone: dict[str, object] = {}
        self._counters: dict[tuple[str, str], int] = defaultdict(int)
        self._reload()

    def _reload(self) -> None:
        try:
            st = os.stat(self.zone_path)
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        if stamp == self._stamp:
            return
        try:
            with open(self.zone_path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            print(f"zone reload failed, keeping old zone: {e}", flush=True)
            return
        self._zone = {k.lower().rstrip("."): v for k, v in raw.items()}
        self._stamp = stamp
        self._counters.clear()
        print(f"zone loaded: {len(self._zone)} names", flush=True)

    def _answers(self, name: str, qtype: str) -> tuple[list[str], int] | None:
        """Addresses (of the asked family) and TTL, or None for NXDOMAIN."""
        entry = self._lookup(name)
        if entry is None:
            return None
        version = 6 if qtype == "AAAA" else 4
        if isinstance(entry, dict) and "alternate" in entry:
            pool = [a for a in entry["alternate"] if ipaddress.ip_address(a).version == version]
            if not pool:
                return [], 0
            i = self._counters[(name, qtype)]
            self._counters[(name, qtype)] = i + 1
            return [pool[i % len(pool)]], 0
        if isinstance(entry, dict):
            addrs, ttl = entry.get("addrs", []), int(entry.get("ttl", DEFAULT_TTL))
        else:
            addrs, ttl = entry, DEFAULT_TTL
        return [a for a in addrs if ipaddress.ip_address(a).version == version], ttl

    def _lookup(self, name: str) -> object | None:
        """The exact entry, else the closest "*.<suffix>" entry (an attacker's authoritative
        server answers every name under its domain)."""
        if name in self._zone:
            return self._zone[name]
        labels = name.split(".")
        for i in range(1, len(labels)):
            entry = self._zone.get("*." + ".".join(labels[i:]))
            if entry is not None:
                return entry
        return None

    def resolve(self, request, handler):
        reply = request.reply()
        qname = str(request.q.qname)
        name = qname.lower().rstrip(".")
        qtype = QTYPE[request.q.qtype]
        with self._lock:
            self._reload()
            found = self._answers(name, qtype) if qtype in ("A", "AAAA") else (
                [] if self._lookup(name) is not None else None)
            entry = self._lookup(name)
        if isinstance(entry, dict) and entry.get("delay"):
            time.sleep(min(float(entry["delay"]), 10.0))   # this query's thread only (ThreadingMixIn)
        if found is None:
            reply.header.rcode = RCODE.NXDOMAIN
            result = "NXDOMAIN"
        else:
            addrs, ttl = found
            for addr in addrs:
                # dnslib cannot parse "::ffff:1.2.3.4": hand it the packed bytes
                packed = list(ipaddress.ip_address(addr).packed)
                rdata = A(packed) if qtype == "A" else AAAA(packed)
                reply.add_answer(RR(qname, QTYPE.reverse[qtype], rdata=rdata, ttl=ttl))
            result = ",".join(addrs) or "NODATA"
        client = handler.client_address[0] if handler else "?"
        print(f"query {qtype} {name} from {client} -> {result}", flush=True)
        return reply


class _QuietLogger(DNSLogger):
    def __init__(self) -> None:
        super().__init__(log="-request,-reply,-truncated,-data,-recv,-send", prefix=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--zone", required=True)
    args = parser.parse_args(argv)

    resolver = ZoneResolver(args.zone)
    servers = [DNSServer(resolver, address=args.bind, port=args.port, logger=_QuietLogger()),
               DNSServer(resolver, address=args.bind, port=args.port, tcp=True, logger=_QuietLogger())]
    for server in servers:
        server.start_thread()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"READY dns {args.bind}:{args.port}", flush=True)
    while not stop.wait(0.2):
        if not all(s.isAlive() for s in servers):
            print("a DNS server thread died", file=sys.stderr, flush=True)
            return 1
    for server in servers:  # serving threads are daemons; just close the sockets
        server.server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
