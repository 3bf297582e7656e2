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
