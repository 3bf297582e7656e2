"""A pool of ready network slots: namespace + veth + address + map entries prepared ahead,
so a sandbox start does not pay the ~30 ms switch attach.

- A slot is prepared under a random one-use token (cubevs Switch.prepare_slot) and
  handed out at most once: `take` pops it under a lock and the switch renames its
  registry row atomically (claim_slot); a slot whose claim fails is destroyed, never
  put back.
- A destroyed sandbox's network is torn down, never returned: no address, MAC,
  counter or conntrack state of one sandbox reaches another (the address may be
  reused later like any freed address, its datapath number never is).
- Refilled by one background thread; an empty pool falls back to attaching inline.
  A slot costs ~12 ms of CPU to prepare, about as much as the rest of a start: during
  a burst of starts the refill waits (until no start has been under way for `quiet_s`,
  or the pool is down to `low_water`), so the burst gets the CPU and the refill the
  pause after. A start is under way from `take` until the caller's `start_done`.
- Slots left by a previous daemon are destroyed at start (`discard_leftovers`).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time

log = logging.getLogger("cubegate.runtime.pool")


def refill_delay(*, ready: int, low_water: int, starting: int, last_start: float, quiet_s: float,
                 now: float) -> float:
    """Seconds a pool's refill should still wait: 0 once no start has been under way for
    quiet_s, or at once when the pool is down to low_water (sustained load must not drain
    it). Shared by the slot pool and the launcher pool (launchpool.py)."""
    if ready <= low_water:
        return 0.0
    if starting:
        return quiet_s
    return max(0.0, last_start + quiet_s - now)


class SlotPool:
    def __init__(self, switch, size: int, *, retry_s: float = 1.0, quiet_s: float = 0.2,
                 low_water: int | None = None):
        self.switch, self.size, self.retry_s = switch, max(0, int(size)), retry_s
        self.quiet_s = quiet_s
        self.low_water = self.size // 4 if low_water is None else max(0, int(low_water))
        self._last_start = float("-inf")
        self._starting = 0
        self._ready: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = self.misses = self.prepared = self.failures = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "SlotPool":
        self.discard_leftovers()
        if self.size and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slot-pool", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, drain: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if drain:
            while True:
                with self._lock:
                    if not self._ready:
                        break
                    token = self._ready.popleft()
                self._discard(token)

    def discard_leftovers(self) -> int:
        n = 0
        for token in self.switch.slots():
            with self._lock:
                if token in self._ready:
                    continue
            self._discard(token)
            n += 1
        return n

    # ------------------------------------------------------------ use
    def take(self, sandbox_id: str, *, l4_allow=()):
        """The sandbox's network: a prepared slot if one is ready, else attached now.
        The caller calls start_done() once the start is over (whatever its outcome)."""
        counted = False
        while True:
            with self._lock:
                token = self._ready.popleft() if self._ready else None
                if not counted:
                    self._starting += 1
                    counted = True
                self._last_start = time.monotonic()
            self._wake.set()
            if token is None:
                self.misses += 1
                return self.switch.attach_sandbox(sandbox_id, l4_allow=l4_allow)
            try:
                net = self.switch.claim_slot(token, sandbox_id, l4_allow=l4_allow)
            except Exception as e:  # noqa: BLE001 - a bad slot is destroyed, the next one tried
                log.warning("pool: slot claim failed (%s); discarding it", e)
                self._discard(token)
                if self.switch.sandbox(sandbox_id) is not None:
                    raise                       # the id is taken: not the slot's fault
                continue
            self.hits += 1
            return net

    def start_done(self) -> None:
        with self._lock:
            self._starting = max(0, self._starting - 1)
            self._last_start = time.monotonic()

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    # ------------------------------------------------------------ refill
    def _run(self) -> None:
        try:    # refilling is background work: sandbox starts get the CPU first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
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
                net = self.switch.prepare_slot()
            except Exception as e:  # noqa: BLE001 - address pool full, netlink error: retry later
                self.failures += 1
                log.warning("pool: cannot prepare a slot: %s", e)
                self._stop.wait(self.retry_s)
                continue
            with self._lock:
                if self._stop.is_set():
                    stale = net.sandbox_id
                else:
                    self._ready.append(net.sandbox_id)
                    self.prepared += 1
                    stale = None
            if stale:
                self._discard(stale)

    def _refill_delay(self, now: float) -> float:
        with self._lock:
            return refill_delay(ready=len(self._ready), low_water=self.low_water, starting=self._starting,
                                last_start=self._last_start, quiet_s=self.quiet_s, now=now)

    def _discard(self, token: str) -> None:
        try:
            self.switch.detach_sandbox(token)
        except Exception as e:  # noqa: BLE001
            log.error("pool: cannot remove slot %s: %s", token, e)
