"""A pool refilled ahead of demand by one niced background thread (the slot pool and the
launcher pool are both this): items are prepared one at a time, handed out at most once
(popped under a lock), discarded when the pool stops. During a burst of starts the
refill waits (`refill_delay`), so the burst gets the CPU and the refill the pause after.
A start is under way from `_pop_for_start` until the caller's `start_done`."""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from contextlib import suppress
from typing import Generic, TypeVar

T = TypeVar("T")


def refill_delay(*, ready: int, low_water: int, starting: int, last_start: float, quiet_s: float,
                 now: float) -> float:
    """Seconds a pool's refill should still wait: 0 once no start has been under way for
    quiet_s, or at once when the pool is down to low_water (sustained load must not drain it)."""
    if ready <= low_water:
        return 0.0
    if starting:
        return quiet_s
    return max(0.0, last_start + quiet_s - now)


class RefillPool(Generic[T]):
    """Subclasses give `_prepare()` (an item, or raise one of `prepare_errors`), `_discard(item)`
    and a `name` for the thread and the log."""
    name = "pool"
    prepare_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, size: int, *, quiet_s: float = 0.2, low_water: int | None = None, retry_s: float = 1.0,
                 log: logging.Logger | None = None):
        self.size, self.quiet_s, self.retry_s = max(0, int(size)), quiet_s, retry_s
        self.low_water = self.size // 4 if low_water is None else max(0, int(low_water))
        self.log = log or logging.getLogger("cubegate.runtime.pool")
        self._ready: collections.deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._starting = 0
        self._last_start = float("-inf")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = self.misses = self.prepared = self.failures = 0

    # ------------------------------------------------------------ subclasses
    def _prepare(self) -> T:
        raise NotImplementedError

    def _discard(self, item: T) -> None:
        raise NotImplementedError

    def discard_leftovers(self) -> int:
        return 0

    # ------------------------------------------------------------ lifecycle
    def start(self):
        self.discard_leftovers()
        if self.size and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, *, drain: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        while drain:
            with self._lock:
                if not self._ready:
                    return
                item = self._ready.popleft()
            self._discard(item)

    # ------------------------------------------------------------ use
    def _pop_for_start(self, *, count: bool = True) -> T | None:
        """A ready item or None; `count`: this call begins a start (once per start)."""
        with self._lock:
            item = self._ready.popleft() if self._ready else None
            if count:
                self._starting += 1
            self._last_start = time.monotonic()
        self._wake.set()
        return item

    def start_done(self) -> None:
        with self._lock:
            self._starting = max(0, self._starting - 1)
            self._last_start = time.monotonic()

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def _has(self, item: T) -> bool:
        with self._lock:
            return item in self._ready

    # ------------------------------------------------------------ refill
    def _refill_delay(self, now: float) -> float:
        with self._lock:
            return refill_delay(ready=len(self._ready), low_water=self.low_water, starting=self._starting,
                                last_start=self._last_start, quiet_s=self.quiet_s, now=now)

    def _run(self) -> None:
        with suppress(OSError):     # background work: sandbox starts get the CPU first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while not self._stop.is_set():
            if self.ready() >= self.size:
                self._wake.wait(timeout=5.0)
                self._wake.clear()
                continue
            wait = self._refill_delay(time.monotonic())
            if wait > 0:
                self._stop.wait(wait)
                continue
            try:
                item = self._prepare()
            except self.prepare_errors as e:
                self.failures += 1
                self.log.warning("%s: cannot prepare an item: %s", self.name, e)
                self._stop.wait(self.retry_s)
                continue
            with self._lock:
                keep = not self._stop.is_set()
                if keep:
                    self._ready.append(item)
                    self.prepared += 1
            if not keep:
                self._discard(item)
