"""egress.metrics.values_with_cached_pid: the pid prometheus-client files a worker's values under
is this process's, and a forked child's own (a stale pid would make two processes share one file)."""
from __future__ import annotations

import os

from egress import metrics


def test_cached_pid_is_this_process_and_a_forked_child_gets_its_own():
    assert metrics._cached_pid() == os.getpid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:                       # the child: report what the cache says, exit at once
        os.close(r)
        os.write(w, f"{metrics._cached_pid()} {os.getpid()}".encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        cached, actual = map(int, f.read().split())
    os.waitpid(child, 0)
    assert cached == actual == child != os.getpid()
    assert metrics._cached_pid() == os.getpid()


def test_value_class_is_swapped_only_in_multiprocess_mode(monkeypatch):
    from prometheus_client import values
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)     # restored after the test
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    before = values.ValueClass
    metrics.values_with_cached_pid()
    assert values.ValueClass is before
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent-unused")
    metrics.values_with_cached_pid()
    assert values.ValueClass is not before and values.ValueClass._multiprocess


def _samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in registry.collect() for s in fam.samples if not s.name.endswith("_created")}


def test_a_batch_writes_the_same_samples_as_each_update_would():
    """MetricBatch (one tick's updates, applied together) against the same updates made one by one;
    this also fails when prometheus-client's Histogram internals that _observe_many uses move."""
    import asyncio
    one_by_one, batched = metrics.GatewayMetrics(), metrics.GatewayMetrics()
    durations = [0.0, 1e-6, 0.004, 0.005, 0.2, 3.0, 7.5, 11.0, 1e9]

    def updates(m, inc, observe):
        for d in durations:
            inc(m.decisions.labels("sb-1", "deny", "default_deny", "connect"), 1)
            inc(m.active_connections, 1)
            observe(m.connection_duration.labels("denied"), d)
            observe(m.decision_latency.labels("connect"), d / 1000)
            inc(m.active_connections, -1)
        inc(m.active_connections, 1)
        inc(m.audit_refusals_counted, 3)

    updates(one_by_one, lambda c, n: c.inc(n), lambda c, v: c.observe(v))

    async def in_one_tick():
        batch = metrics.MetricBatch()
        updates(batched, batch.inc, batch.observe)
        assert _samples(batched.registry)[("cubegate_active_connections", ())] == 0   # not written yet
        await asyncio.sleep(0)                                                      # the tick ends
        await asyncio.sleep(0)

    asyncio.run(in_one_tick())
    want = _samples(one_by_one.registry)
    assert want[("cubegate_connection_seconds_count", (("kind", "denied"),))] == len(durations)
    assert _samples(batched.registry) == want
