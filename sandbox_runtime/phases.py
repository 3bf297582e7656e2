"""Where a sandbox start's time goes: named phases of one create, timed with
perf_counter_ns (wall) and thread_time_ns (this thread's CPU; children's CPU is not
in it). Off by default, then every call is a no-op; bench/bench_sandbox.py --phases
turns it on and prints the breakdown.

    with phases.trace(sandbox_id):          # manager.create
        with phases.phase("attach"): ...    # anywhere below it, same thread
    phases.take()                           # [{"id": ..., "phases": {name: (wall_ns, cpu_ns)}}]
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time

MAX_TRACES = 10_000      # bounded: a bench run that forgets to take() does not grow forever

_enabled = False
_local = threading.local()
_done: collections.deque = collections.deque(maxlen=MAX_TRACES)


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on
    _done.clear()


@contextlib.contextmanager
def trace(key: str):
    if not _enabled:
        yield
        return
    cur = {"id": key, "phases": {}}
    _local.cur = cur
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    try:
        yield
    finally:
        cur["phases"]["total"] = (time.perf_counter_ns() - t0, time.thread_time_ns() - c0)
        _local.cur = None
        _done.append(cur)


@contextlib.contextmanager
def phase(name: str):
    cur = getattr(_local, "cur", None) if _enabled else None
    if cur is None:
        yield
        return
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    try:
        yield
    finally:
        w, c = cur["phases"].get(name, (0, 0))
        cur["phases"][name] = (w + time.perf_counter_ns() - t0, c + time.thread_time_ns() - c0)


def take() -> list[dict]:
    out = list(_done)
    _done.clear()
    return out
