"""Pure pieces shared by both backends: reasons, verdicts, L4 rule parsing."""
from __future__ import annotations

import ipaddress

from .bpf_loader import ALLOW_REASONS, REASONS

PROTOS = {"tcp": 6, "udp": 17, "icmp": 1}
PROTO_NAMES = {v: k for k, v in PROTOS.items()}
WEB_PORTS = (80, 443)


def verdict_of(reason: str) -> str:
    return "allow" if reason in ALLOW_REASONS else "drop"


def normalize_l4(rules) -> tuple[tuple[str, int, str], ...]:
    """Validate (cidr, port, proto) rules; port 0 = any port. Raises ValueError."""
    out = []
    for rule in rules:
        if len(rule) != 3:
            raise ValueError(f"l4 rule must be (cidr, port, proto): {rule!r}")
        cidr, port, proto = rule
        net = ipaddress.IPv4Network(str(cidr), strict=False)
        port = int(port)
        proto = str(proto).lower()
        if proto not in PROTOS:
            raise ValueError(f"l4 rule proto must be one of {sorted(PROTOS)}: {rule!r}")
        if not 0 <= port <= 65535 or (proto == "icmp" and port != 0):
            raise ValueError(f"l4 rule port out of range: {rule!r}")
        out.append((str(net), port, proto))
    return tuple(out)


__all__ = ["REASONS", "ALLOW_REASONS", "PROTOS", "PROTO_NAMES", "verdict_of", "normalize_l4"]
