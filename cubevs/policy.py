"""Pure pieces shared by both backends: protocols, L4 rule parsing (reasons: switch_schema)."""
from __future__ import annotations

import ipaddress

PROTOS = {"tcp": 6, "udp": 17, "icmp": 1}
PROTO_NAMES = {v: k for k, v in PROTOS.items()}
WEB_PORTS = (80, 443)


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


__all__ = ["PROTOS", "PROTO_NAMES", "WEB_PORTS", "normalize_l4"]
