"""Prometheus metrics of the gateway, in a registry of its own.

Worker processes (cubegate/worker.py) run with PROMETHEUS_MULTIPROC_DIR set, so their
values live in files; the daemon's /metrics is its own registry plus every worker's
values, summed per series (render_with_workers).

Label values are ids, reasons and actions only: never hosts' secrets, never
header values. Sandbox ids are bounded by the identity store.
"""
from __future__ import annotations

import asyncio
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values

_pid = os.getpid()


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)


def _cached_pid() -> int:
    return _pid


def values_with_cached_pid() -> None:
    """A worker's metric values (multiprocess mode) without a getpid() syscall per update:
    prometheus-client asks for the pid on every inc/observe to notice a fork; here it reads a copy
    that a fork refreshes in the child. Call before the process makes its first metric (two value
    classes would map the same per-process file twice)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        values.ValueClass = values.MultiProcessValue(process_identifier=_cached_pid)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "cubegate_decisions_total", "Policy decisions", ["sandbox", "action", "reason", "stage"], registry=r
        )
        self.decision_latency = Histogram(
            "cubegate_decision_seconds", "Time to reach a decision (policy + identity)", ["stage"],
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1), registry=r,
        )
        self.request_latency = Histogram(
            "cubegate_request_seconds", "Intercepted/plain HTTP request duration through the gateway", ["sandbox"],
            registry=r,
        )
        self.connection_duration = Histogram(
            "cubegate_connection_seconds", "Client connection lifetime", ["kind"], registry=r,
        )
        self.bytes = Counter(
            "cubegate_bytes_total", "Bytes relayed", ["sandbox", "direction"], registry=r
        )
        self.active_connections = Gauge(
            "cubegate_active_connections", "Open client connections", registry=r,
            multiprocess_mode="livesum",   # workers: the sum over the live ones
        )
        self.audit_errors = Counter(
            "cubegate_audit_write_errors_total", "Audit appends that failed (flow refused)", registry=r
        )
        self.audit_refusals_counted = Counter(
            "cubegate_audit_refusals_counted_total",
            "Refusals past a source's per-interval budget: counted into a refusals_counted record, not written one by one",
            registry=r,
        )
        self.fast_path = Counter(
            "cubegate_fast_path_connections_total",
            "Connections the fast path finished itself (relayed, refused) or handed to mitmproxy", ["outcome"],
            registry=r,
        )
        self.policy_reloads = Counter(
            "cubegate_policy_reloads_total", "Policy reload attempts", ["result"], registry=r
        )
        self.injections = Counter(
            "cubegate_injections_total", "Credential injections", ["sandbox", "secret"], registry=r
        )
        self.leaks_blocked = Counter(
            "cubegate_credential_leaks_blocked_total", "Requests blocked because they carried a secret or placeholder to an unbound host",
            ["sandbox"], registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LabelCache:
    """`metric.labels(*values)`, looked up once per distinct values: prometheus-client checks and
    converts the values and takes a lock on every labels() call, several times per connection.
    Holds the same children the metric itself keeps forever (no new bound needed)."""

    __slots__ = ("metric", "children")

    def __init__(self, metric) -> None:
        self.metric = metric
        self.children: dict[tuple, object] = {}

    def __call__(self, *values):
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class MetricBatch:
    """Metric updates of one event-loop tick, applied together when it ends (loop.call_soon): a
    worker's values are mmap'd files (multiprocess mode) and every inc/observe is a locked write,
    several per connection; a tick's refusals of one sandbox and reason become one write per series.
    Deferred by one tick only (a scrape that follows an answer sees it); flush() applies what is
    pending at once (drain, tests). Counters and gauges take inc(child, amount); histograms
    observe(child, value): the same samples as child.observe(value) each (test_metrics_values.py)."""

    __slots__ = ("_counts", "_observed", "_scheduled")

    def __init__(self) -> None:
        self._counts: dict[object, float] = {}
        self._observed: dict[object, list[float]] = {}
        self._scheduled = False

    def inc(self, child, amount: float = 1) -> None:
        counts = self._counts
        counts[child] = counts.get(child, 0) + amount
        if not self._scheduled:
            self._schedule()

    def observe(self, child, value: float) -> None:
        seen = self._observed.get(child)
        if seen is None:
            self._observed[child] = [value]
        else:
            seen.append(value)
        if not self._scheduled:
            self._schedule()

    def _schedule(self) -> None:
        try:
            asyncio.get_running_loop().call_soon(self.flush)
            self._scheduled = True
        except RuntimeError:             # no loop running (a unit test): applied now
            self.flush()

    def flush(self) -> None:
        counts, observed = self._counts, self._observed
        self._counts, self._observed, self._scheduled = {}, {}, False
        for child, amount in counts.items():
            if amount:                   # a gauge's +1 and -1 in one tick: nothing to write
                child.inc(amount)
        for child, seen in observed.items():
            _observe_many(child, seen)


def _observe_many(histogram, amounts: list[float]) -> None:
    """histogram.observe(a) for each a, with one write per bucket hit and one for the sum (its
    _sum, _buckets and _upper_bounds: prometheus-client's Histogram child, pinned by a test)."""
    if len(amounts) == 1:
        histogram.observe(amounts[0])
        return
    histogram._raise_if_not_observable()
    bounds = histogram._upper_bounds
    hits = [0] * len(bounds)
    for amount in amounts:
        for i, bound in enumerate(bounds):
            if amount <= bound:
                hits[i] += 1
                break
    histogram._sum.inc(sum(amounts))
    for i, n in enumerate(hits):
        if n:
            histogram._buckets[i].inc(n)


class WithWorkers:
    """The daemon's `registry` and the workers' values from `multiproc_dir`, read like a registry
    (collect) or rendered: one family per name, samples with the same name and labels summed
    (a `_created` keeps the earliest)."""

    def __init__(self, registry: CollectorRegistry, multiproc_dir: str) -> None:
        self.registry, self.multiproc_dir = registry, multiproc_dir

    def collect(self) -> list:
        from prometheus_client import multiprocess
        from prometheus_client.metrics_core import Metric
        sources = [self.registry]
        if os.path.isdir(self.multiproc_dir):   # not before the first worker starts
            workers = CollectorRegistry()
            multiprocess.MultiProcessCollector(workers, path=self.multiproc_dir)
            sources.append(workers)
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple, list]] = {}
        for reg in sources:
            for fam in reg.collect():
                if fam.name not in families:
                    families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    values[fam.name] = {}
                merged = values[fam.name]
                for sample in fam.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in merged:
                        merged[key] = [sample.name, dict(sample.labels), sample.value]
                    elif sample.name.endswith("_created"):
                        merged[key][2] = min(merged[key][2], sample.value)
                    else:
                        merged[key][2] += sample.value
        for name, fam in families.items():
            for sname, labels, value in values[name].values():
                fam.add_sample(sname, labels, value)
        return list(families.values())

    def render(self) -> bytes:
        out = CollectorRegistry(auto_describe=False)
        out.register(self)
        return generate_latest(out)
