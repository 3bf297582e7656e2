"""The resource limits every sandbox starts with, whatever the daemon's own are.

A launcher (launcher.py) is a child of the daemon, and rlimits pass through fork, exec and
the drop to the sandbox's uid: without this a sandbox got the daemon's, which the daemon
raises (RLIMIT_NOFILE to its hard limit: 524288 under a systemd unit, up to nr_open) and
which a unit may set anywhere (LimitMEMLOCK=infinity is common for eBPF loaders, LimitCORE=
infinity for debugging). Nothing inside the sandbox can raise a hard limit again (no
CAP_SYS_RESOURCE in the host's user namespace). They are ceilings: one the daemon has
lower already stays lower.

What the cgroup bounds (memory, pids, CPU) is left to it; these bound what no cgroup does:
- NOFILE: open files are a host-wide count (fs.file-max); a sandbox holds at most
  pids.max x NOFILE hard of them.
- CORE 0: a crash dump is written by the host's core_pattern, which may be a host program
  writing to the host's disk (systemd-coredump, apport), not the sandbox's tmpfs.
- MEMLOCK: pinned memory the host cannot reclaim, nor swap.
- RTPRIO, NICE 0: no real-time scheduling, no priority above the default, which
  would take CPU from the gateway beyond what the CPU quota sees first.
"""
from __future__ import annotations

import resource

MIB = 1 << 20
SANDBOX_RLIMITS: dict[int, tuple[int, int]] = {
    resource.RLIMIT_NOFILE: (1024, 4096),
    resource.RLIMIT_CORE: (0, 0),
    resource.RLIMIT_MEMLOCK: (8 * MIB, 8 * MIB),
    resource.RLIMIT_RTPRIO: (0, 0),
    resource.RLIMIT_NICE: (0, 0),
    resource.RLIMIT_MSGQUEUE: (819200, 819200),   # the kernel's default: POSIX mqueue bytes per uid
    resource.RLIMIT_STACK: (8 * MIB, resource.RLIM_INFINITY),
}


def _lower(a: int, b: int) -> int:
    return b if a == resource.RLIM_INFINITY else a if b == resource.RLIM_INFINITY else min(a, b)


def ceiling(wanted: tuple[int, int], current: tuple[int, int]) -> tuple[int, int]:
    """`wanted`, but never above `current`'s hard limit: a limit the daemon itself has lower
    stays (raising one needs CAP_SYS_RESOURCE, which a container may not give)."""
    hard = _lower(wanted[1], current[1])
    return _lower(wanted[0], hard), hard


def confine(pid: int) -> None:
    """Give process `pid` (not yet running anything of a sandbox) the sandbox's limits.
    OSError if the kernel refuses one: the caller must not start the sandbox then."""
    for which, wanted in SANDBOX_RLIMITS.items():
        resource.prlimit(pid, which, ceiling(wanted, resource.prlimit(pid, which)))
