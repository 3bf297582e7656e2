"""Admission by real capacity: a host budget of memory and CPU, never overcommitted.

Two checks, both must pass:
- reservations: the sum of the limits of live sandboxes plus the new one stays
  within the budget (the limits are hard cgroup limits, so this is what the
  sandboxes may really use);
- the kernel: MemAvailable (measured now) must still cover the new sandbox's
  memory limit plus the host reserve — a budget set too high in the settings
  cannot make the host swap or OOM;
- tasks: the pids limits of live sandboxes stay within `Budget.pids` (by default half of
  the host's task space, min(kernel.pid_max, kernel.threads-max)): every task of every
  sandbox takes a pid of the host, and a host without one can start nothing (the daemon,
  the gateway's workers, the other sandboxes). 32768 here: 128 sandboxes of 256 pids.

A third when a tenant share is set (`tenant_share`): one tenant's sandboxes, the new one
included, hold at most that fraction of the budget (count, memory, CPUs), so a tenant with
a valid key cannot take the whole host from the others.

Pure decision (`admit`) with the kernel reading passed in, so it is testable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .backend import Limits, SandboxError

MB = 1024 * 1024


class CapacityError(SandboxError):
    """Creating this sandbox would exceed the host's budget."""


@dataclass(frozen=True)
class Budget:
    memory_mb: int
    cpus: float
    max_sandboxes: int = 1000
    host_reserve_mb: int = 512     # never handed out: the gateway and the host need it
    pids: int | None = None        # tasks all sandboxes may hold (their pids limits); None: not checked


@dataclass(frozen=True)
class Usage:
    sandboxes: int = 0
    memory_mb: int = 0
    cpus: float = 0.0
    pids: int = 0


def reserved(limits: list[Limits]) -> Usage:
    return Usage(len(limits), sum(lim.memory_mb for lim in limits), round(sum(lim.cpus for lim in limits), 6),
                 sum(lim.pids for lim in limits))


def admit(budget: Budget, used: Usage, want: Limits, mem_available_mb: int | None, *,
          tenant: str | None = None, tenant_used: Usage | None = None, tenant_share: float | None = None) -> None:
    """Raise CapacityError with the exact shortfall, or return (admitted). tenant_used: what
    `tenant`'s sandboxes hold; tenant_share: the fraction of the budget one tenant may hold."""
    if want.memory_mb <= 0 or want.cpus <= 0 or want.pids <= 0 or want.disk_mb <= 0:
        raise CapacityError("limits must be positive (memory_mb, cpus, pids, disk_mb)")
    if tenant_share is not None and tenant_share < 1.0:
        _admit_share(budget, tenant_used or Usage(), want, tenant, tenant_share)
    if used.sandboxes + 1 > budget.max_sandboxes:
        raise CapacityError(f"host is full: {used.sandboxes} of {budget.max_sandboxes} sandboxes in use")
    if used.memory_mb + want.memory_mb > budget.memory_mb:
        raise CapacityError(f"not enough memory: {want.memory_mb} MB asked, "
                            f"{budget.memory_mb - used.memory_mb} MB of {budget.memory_mb} MB budget left")
    if used.cpus + want.cpus > budget.cpus + 1e-9:
        raise CapacityError(f"not enough CPU: {want.cpus:g} asked, "
                            f"{budget.cpus - used.cpus:g} of {budget.cpus:g} CPUs budget left")
    if budget.pids is not None and used.pids + want.pids > budget.pids:
        raise CapacityError(f"not enough tasks: {want.pids} pids asked, "
                            f"{budget.pids - used.pids} of {budget.pids} left for sandboxes")
    if mem_available_mb is not None and mem_available_mb - budget.host_reserve_mb < want.memory_mb:
        raise CapacityError(f"not enough free memory on the host: {mem_available_mb} MB available, "
                            f"{budget.host_reserve_mb} MB reserved for the host, {want.memory_mb} MB asked")


def tenant_cap(budget: Budget, share: float) -> Usage:
    """What one tenant may hold of `budget` (at least one sandbox's worth of count)."""
    return Usage(max(1, int(budget.max_sandboxes * share)), int(budget.memory_mb * share),
                 round(budget.cpus * share, 6), int(budget.pids * share) if budget.pids is not None else 0)


def _admit_share(budget: Budget, used: Usage, want: Limits, tenant: str | None, share: float) -> None:
    cap, who = tenant_cap(budget, share), f"tenant {tenant!r}" if tenant else "this tenant"
    why = f"(runtime.tenant_share {share:g} of the host)"
    if used.sandboxes + 1 > cap.sandboxes:
        raise CapacityError(f"{who} holds {used.sandboxes} of its {cap.sandboxes} sandboxes {why}")
    if used.memory_mb + want.memory_mb > cap.memory_mb:
        raise CapacityError(f"{who} holds {used.memory_mb} MB of its {cap.memory_mb} MB; "
                            f"{want.memory_mb} MB asked {why}")
    if used.cpus + want.cpus > cap.cpus + 1e-9:
        raise CapacityError(f"{who} holds {used.cpus:g} of its {cap.cpus:g} CPUs; {want.cpus:g} asked {why}")
    if budget.pids is not None and used.pids + want.pids > cap.pids:
        raise CapacityError(f"{who} holds {used.pids} of its {cap.pids} pids; {want.pids} asked {why}")


def meminfo_mb(path: str = "/proc/meminfo") -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) // 1024   # kB → MB
    return out


def host_tasks(proc: str = "/proc/sys/kernel") -> int:
    """The host's task space: a new task needs a pid (pid_max) and a thread slot (threads-max)."""
    with open(f"{proc}/pid_max") as a, open(f"{proc}/threads-max") as b:
        return min(int(a.read()), int(b.read()))


def default_budget(memory_mb: int | None = None, cpus: float | None = None,
                   max_sandboxes: int = 1000, host_reserve_mb: int = 512, pids: int | None = None) -> Budget:
    """Unset values come from the machine: all memory but the reserve, all CPUs, half the
    host's task space."""
    if memory_mb is None:
        memory_mb = max(0, meminfo_mb()["MemTotal"] - host_reserve_mb)
    if cpus is None:
        cpus = float(len(os.sched_getaffinity(0)))
    if pids is None:
        pids = host_tasks() // 2
    return Budget(int(memory_mb), float(cpus), int(max_sandboxes), int(host_reserve_mb), int(pids))
