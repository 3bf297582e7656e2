"""Global denies that are always on, whatever the policy files say.

Names: cloud instance-metadata endpoints and names that by definition mean
"this machine". We deliberately do NOT deny all of ``*.internal``: operators
may allow their own internal APIs, and private addresses are refused after
resolution by egress/netguard.py anyway (the authoritative SSRF check).

CIDRs: only the metadata addresses; the gateway adds its own private-range
list (netguard) on top of ``CompiledPolicySet.global_denied_cidrs``.
"""

from __future__ import annotations

BUILTIN_DENIED_DOMAINS: tuple[str, ...] = (
    "metadata",  # GCE short name (search-domain expansion)
    "metadata.google.internal",  # GCE
    "*.metadata.google.internal",
    "metadata.goog",  # GCE alias
    "instance-data",  # AWS short name
    "instance-data.ec2.internal",  # AWS
    "localhost",  # RFC 6761: always loopback
    "*.localhost",
)

BUILTIN_DENIED_CIDRS: tuple[str, ...] = (
    "169.254.169.254/32",  # AWS, GCP, Azure, OpenStack, Oracle IMDS
    "169.254.170.2/32",  # AWS ECS task metadata
    "fd00:ec2::254/128",  # AWS IMDS over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
)
