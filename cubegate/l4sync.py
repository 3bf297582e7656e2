"""The policy in force → one sandbox's L4 allow list in the switch (direct paths, not 80/443).

Pure. The switch opens (cidr, port, tcp) past the gateway, so an entry may only be
there when the gateway's own decision (EffectivePolicy.decide: admin policy, grants,
the sandbox's network options) allows every address of the cidr on that port, and so
does the gateway's SSRF guard (netguard.AddressGuard: private, loopback, link-local, CGNAT,
reserved ranges and the gateway's own listeners, unless upstream.allow_cidrs exempts them):
a `cidrs: [0.0.0.0/0]` rule does not open the host's LAN or link-local neighbours:
  1. candidates: the selected policy's allow rules with `cidrs`, and the grants in
     force for the sandbox with `cidrs` (IPv4: sandboxes have no IPv6), × their ports
     (no ports: 0 = any port);
  2. each candidate is cut at every CIDR boundary anything in the decision mentions
     (rules, global denies, grants, network entries, the guard's ranges), so that within
     one piece every address gets the same decision — and one address of it is decided
     for real;
  3. a piece for any port is kept as such only if every port the decision tells apart
     (the ports named anywhere, plus one named nowhere) is allowed; otherwise only the
     named ports that are allowed are kept ("any port but 5432" is not expressible in
     the switch: fail closed).
Bounded: at most MAX_PIECES pieces looked at per candidate and MAX_ENTRIES entries per
sandbox; beyond that the rest is left out (closed), never guessed.
"""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping

from egress.netguard import AddressGuard
from egress.policy import RequestInfo
from egress.policy.effective import EffectivePolicy

log = logging.getLogger("cubegate.l4sync")

MAX_PIECES = 4096
MAX_ENTRIES = 512
IPv4 = ipaddress.IPv4Network


def l4_allow_for(policy, sandbox_id: str, labels: Mapping[str, str], *, guard: AddressGuard,
                 now: float | None = None) -> list[tuple[str, int, str]]:
    if not isinstance(policy, EffectivePolicy):
        policy = EffectivePolicy(policy)      # admin policies alone: no grants, no network options
    labels = dict(labels)
    selected = policy.policy_for(sandbox_id, labels)
    grants = _grants(policy, sandbox_id, labels, now)
    candidates: set[tuple[IPv4, int]] = set()
    for rule in selected.rules if selected is not None else ():
        if rule.action == "allow":
            candidates |= _pairs(rule.match.cidrs, rule.match.ports)
    for g in grants:
        candidates |= _pairs(g.cidrs, g.ports)
    if not candidates:
        return []
    bounds, ports = _boundaries(policy, selected, grants, policy.network_for(sandbox_id))
    guard_nets, guard_ports = guard.ipv4_boundaries()
    bounds = sorted({*bounds, *guard_nets}, key=lambda n: (n.prefixlen, n.network_address))
    ports |= guard_ports
    other = next(p for p in range(1024, 65536) if p not in ports)   # stands for every port named nowhere

    def allowed(addr: str, port: int) -> bool:
        if guard.check(addr, port) is not None:
            return False
        d = policy.decide(RequestInfo(sandbox_id, labels, addr, port, is_ip_literal=True), now)
        return d.allowed and not d.needs_inspection   # no HTTP to inspect on a direct path

    out: set[tuple[str, int, str]] = set()
    for net, port in sorted(candidates, key=lambda c: (c[0].network_address, c[0].prefixlen, c[1])):
        for piece in _pieces(net, bounds):
            rep = str(piece.network_address)
            if port:
                if allowed(rep, port):
                    out.add((str(piece), port, "tcp"))
                continue
            verdicts = {p: allowed(rep, p) for p in (*sorted(ports), other)}
            if all(verdicts.values()):
                out.add((str(piece), 0, "tcp"))
            else:
                out.update((str(piece), p, "tcp") for p, ok in verdicts.items() if ok and p != other)
    entries = sorted(out, key=lambda e: (ipaddress.ip_network(e[0]), e[1]))
    if len(entries) > MAX_ENTRIES:
        log.warning("l4 allow list of %s: %d entries, only the first %d are opened", sandbox_id, len(entries),
                    MAX_ENTRIES)
        entries = entries[:MAX_ENTRIES]
    return entries


def _grants(policy, sandbox_id, labels, now):
    if not policy.grants:
        return []
    return policy.grants.for_sandbox(sandbox_id, labels, policy.clock() if now is None else now)


def _pairs(cidrs, ports) -> set[tuple[IPv4, int]]:
    return {(net, int(p)) for net in cidrs if isinstance(net, IPv4) for p in (sorted(ports) if ports else [0])}


def _boundaries(policy, selected, grants, network) -> tuple[list[IPv4], set[int]]:
    nets: set[IPv4] = set(n for n in policy.global_denied_cidrs if isinstance(n, IPv4))
    ports: set[int] = set()
    for rule in selected.rules if selected is not None else ():
        nets.update(n for n in rule.match.cidrs if isinstance(n, IPv4))
        ports.update(rule.match.ports or ())
    for g in grants:
        nets.update(n for n in g.cidrs if isinstance(n, IPv4))
        ports.update(g.ports or ())
    if network is not None:
        for e in (*network.allow, *network.deny):
            if isinstance(e.net, IPv4):
                nets.add(e.net)
            if e.port is not None:
                ports.add(e.port)
    return sorted(nets, key=lambda n: (n.prefixlen, n.network_address)), ports


def _pieces(net: IPv4, bounds: Iterable[IPv4]) -> list[IPv4]:
    """`net` cut so that no piece straddles a boundary (each piece is inside or outside each)."""
    pieces = [net]
    for b in bounds:
        nxt = []
        for p in pieces:
            if b.prefixlen > p.prefixlen and b.subnet_of(p):
                nxt.extend(p.address_exclude(b))
                nxt.append(b)
            else:
                nxt.append(p)
        pieces = nxt
        if len(pieces) > MAX_PIECES:
            log.warning("l4: %s is cut into more than %d pieces; it is left closed", net, MAX_PIECES)
            return []
    return pieces
