"""When a sandbox was last used: the decision half of auto-pause (no I/O; the clock is passed in).

Signs of use: an API call on the sandbox (begin/end around it: a call in flight
is never idle, however long it runs) and traffic (per-sandbox byte totals from
the switch: any change since the last look counts). A sandbox first seen now
counts as used now, so a daemon restart never pauses everything at once.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable


class Activity:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def touch(self, sandbox_id: str) -> None:
        with self._lock:
            self._last[sandbox_id] = self._clock()

    def begin(self, sandbox_id: str) -> None:
        with self._lock:
            self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
            self._last[sandbox_id] = self._clock()

    def end(self, sandbox_id: str) -> None:
        with self._lock:
            n = self._busy.get(sandbox_id, 0) - 1
            if n > 0:
                self._busy[sandbox_id] = n
            else:
                self._busy.pop(sandbox_id, None)
            self._last[sandbox_id] = self._clock()

    def traffic(self, totals: dict[str, int]) -> None:
        """Byte totals per sandbox (monotonic counters): a change is use."""
        now = self._clock()
        with self._lock:
            for sid, n in totals.items():
                if self._bytes.get(sid) != n:
                    if sid in self._bytes:
                        self._last[sid] = now
                    self._bytes[sid] = n

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            for d in (self._last, self._busy, self._bytes):
                d.pop(sandbox_id, None)

    def idle_for(self, sandbox_id: str) -> float:
        """Seconds since the last use (0 while a call is in flight)."""
        now = self._clock()
        with self._lock:
            if self._busy.get(sandbox_id):
                return 0.0
            return now - self._last.setdefault(sandbox_id, now)

    def due(self, sandbox_ids: Iterable[str], idle_seconds: float) -> list[str]:
        """The sandboxes idle at least `idle_seconds`."""
        return [sid for sid in sandbox_ids if self.idle_for(sid) >= idle_seconds]
