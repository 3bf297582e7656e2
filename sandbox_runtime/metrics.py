"""Runtime metrics: start latency, creation results, live sandboxes, memory per sandbox,
host capacity. Memory and capacity are read from the kernel at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class RuntimeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.start_seconds = Histogram("cubegate_sandbox_start_seconds",
                                       "Create request to agent answered and network attached",
                                       ["backend"], buckets=START_BUCKETS, registry=r)
        self.creations = Counter("cubegate_sandbox_creations", "Sandbox creations by result",
                                 ["backend", "result"], registry=r)   # ok | capacity | error
        self.execs = Counter("cubegate_sandbox_execs", "Exec calls by result", ["backend", "result"], registry=r)
        self.auto_pauses = Counter("cubegate_sandbox_auto_pauses", "Sandboxes frozen for idleness",
                                   ["backend"], registry=r)
        self.auto_resumes = Counter("cubegate_sandbox_auto_resumes", "Idle-paused sandboxes woken by a call",
                                    ["backend"], registry=r)
        self.snapshots = Counter("cubegate_sandbox_snapshots", "Snapshots taken", ["backend"], registry=r)
        self._manager = None

    def bind(self, manager) -> None:
        """Scrape-time gauges read the manager (and through it cgroups / /proc)."""
        self._manager = manager
        self.registry.register(_Collector(manager))


class _Collector:
    def __init__(self, manager):
        self.m = manager

    def collect(self):
        live = GaugeMetricFamily("cubegate_sandboxes_live", "Sandboxes by backend and state",
                                 labels=["backend", "state"])
        mem = GaugeMetricFamily("cubegate_sandbox_memory_bytes",
                                "Memory in use per sandbox, measured (cgroup usage or VM RSS)",
                                labels=["sandbox", "backend"])
        cap = GaugeMetricFamily("cubegate_host_capacity", "Host budget for sandboxes", labels=["resource"])
        used = GaugeMetricFamily("cubegate_host_reserved", "Budget reserved by live sandboxes' limits",
                                 labels=["resource"])
        avail = GaugeMetricFamily("cubegate_host_memory_available_bytes", "MemAvailable from /proc/meminfo")
        paused = GaugeMetricFamily("cubegate_sandboxes_paused", "Paused sandboxes by who paused them (api | idle)",
                                   labels=["backend", "by"])
        snap = self.m.snapshot_for_metrics()
        for (backend, by), n in sorted(snap["paused_by"].items()):
            paused.add_metric([backend, by], n)
        for (backend, state), n in sorted(snap["counts"].items()):
            live.add_metric([backend, state], n)
        for sid, backend, nbytes in snap["memory"]:
            mem.add_metric([sid, backend], nbytes)
        b, u = snap["budget"], snap["reserved"]
        cap.add_metric(["memory_bytes"], b.memory_mb * 1024 * 1024)
        cap.add_metric(["cpus"], b.cpus)
        cap.add_metric(["sandboxes"], b.max_sandboxes)
        used.add_metric(["memory_bytes"], u.memory_mb * 1024 * 1024)
        used.add_metric(["cpus"], u.cpus)
        used.add_metric(["sandboxes"], u.sandboxes)
        if b.pids is not None:
            cap.add_metric(["pids"], b.pids)
            used.add_metric(["pids"], u.pids)
        if snap["mem_available_mb"] is not None:
            avail.add_metric([], snap["mem_available_mb"] * 1024 * 1024)
        yield from (live, mem, cap, used, avail, paused)
