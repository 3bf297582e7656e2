"""One host uid per live sandbox, for both backends.

Derived from the sandbox's cubevs address, which is unique among live sandboxes
on a host: no allocation table, no hash collisions. Distinct uids matter for
per-user kernel limits (inotify instances, RLIMIT_NPROC, mqueue bytes) and so
that a process escaping one sandbox cannot signal or ptrace another's."""
from __future__ import annotations

import ipaddress

UID_BASE = 0x40000000   # far above any /etc/passwd range; + a 32-bit IPv4 still fits uid_t (< 2^32 - 1)


def sandbox_uid(ip: str) -> int:
    return UID_BASE + int(ipaddress.IPv4Address(ip))
