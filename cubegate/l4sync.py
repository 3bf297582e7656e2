"""Policy `cidrs` allow rules → the switch's per-sandbox L4 allow list.

Pure translation: an allow rule with `cidrs` (IPv4) and `ports` opens exactly
those (cidr, port, tcp) tuples in the eBPF/nftables switch; no `ports` means
any port (0). Deny rules add nothing: the switch is default-deny for
everything but DNS to us and 80/443 (which are steered to the gateway).
"""
from __future__ import annotations

import ipaddress
from typing import Mapping


def l4_allow_for(compiled, sandbox_id: str, labels: Mapping[str, str]) -> list[tuple[str, int, str]]:
    policy = compiled.policy_for(sandbox_id, labels)
    if policy is None:
        return []
    out: set[tuple[str, int, str]] = set()
    for rule in policy.rules:
        if rule.action != "allow" or not rule.match.cidrs:
            continue
        for net in rule.match.cidrs:
            if not isinstance(net, ipaddress.IPv4Network):
                continue  # sandboxes have no IPv6
            for port in sorted(rule.match.ports) if rule.match.ports else [0]:
                out.add((str(net), int(port), "tcp"))
    return sorted(out)
