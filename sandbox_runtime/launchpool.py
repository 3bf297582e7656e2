"""A pool of parked launchers (launcher.py), each already in cgroups of its own.

- Each launcher gets fresh cgroups named `_launcher-<random token>` (never a sandbox id:
  ids have no '_'), created for it and never reused. `take` pops one under a lock: it
  is handed out once. The caller renames its cgroups to the sandbox's id and sets the
  sandbox's limits before it claims (namespace.py); anything failing there discards it.
- A launcher taken is the sandbox's (its bwrap, after the claim): destroying the sandbox
  kills it and removes its cgroups like any other, nothing goes back to the pool.
- A daemon that dies leaves nothing claimable: parked launchers read EOF and exit, the
  pool itself is memory only; their empty cgroups are removed at the next start
  (`discard_leftovers`).
- Refilled by one niced background thread with the slot pool's policy (netpool.refill_delay):
  a burst of starts gets the CPU, the refill the pause after.
- cgroup v1 only (v2 has no rename): elsewhere the pool stays empty and every start
  spawns its launcher in the sandbox's cgroups.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime.backend import SandboxError
from sandbox_runtime.cgroups import SandboxCgroups, detect
from sandbox_runtime.launcher import Launcher, LauncherError
from sandbox_runtime.netpool import refill_delay

log = logging.getLogger("cubegate.runtime.launchers")

PREFIX = "_launcher-"
PARK_TIMEOUT_S = 5.0


@dataclass
class Pooled:
    launcher: Launcher
    cgroups: SandboxCgroups       # named PREFIX + token until the taker renames them

    def discard(self) -> None:
        self.launcher.discard()
        if not self.cgroups.remove():
            self.cgroups.kill_all()
            self.cgroups.remove()


class LauncherPool:
    def __init__(self, agent_binary: Path, group: str, size: int, *, quiet_s: float = 0.2,
                 low_water: int | None = None, retry_s: float = 1.0):
        self.agent_binary, self.group = Path(agent_binary), group
        self.size = max(0, int(size)) if detect()[0] == "v1" else 0
        self.quiet_s, self.retry_s = quiet_s, retry_s
        self.low_water = self.size // 4 if low_water is None else max(0, int(low_water))
        self._ready: collections.deque[Pooled] = collections.deque()
        self._lock = threading.Lock()
        self._starting = 0
        self._last_start = float("-inf")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = self.misses = self.prepared = self.failures = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "LauncherPool":
        self.discard_leftovers()
        if self.size and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="launcher-pool", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        while True:
            with self._lock:
                if not self._ready:
                    return
                item = self._ready.popleft()
            item.discard()

    def discard_leftovers(self) -> int:
        """Pooled cgroups of a previous daemon of this instance (their launchers exit on EOF)."""
        with self._lock:
            mine = {str(p) for it in self._ready for p in it.cgroups.paths.values()}
        n = 0
        for cg in SandboxCgroups.named(PREFIX, group=self.group):
            if mine & set(cg.paths.values()):
                continue
            cg.kill_all()
            cg.remove()
            n += 1
        return n

    # ------------------------------------------------------------ use
    def take(self) -> Pooled | None:
        """A parked launcher for one start, or None (the caller spawns one). The caller calls
        start_done() once the start is over, whatever its outcome."""
        with self._lock:
            item = self._ready.popleft() if self._ready else None
            self._starting += 1
            self._last_start = time.monotonic()
        self._wake.set()
        if item is None:
            self.misses += 1
        else:
            self.hits += 1
        return item

    def start_done(self) -> None:
        with self._lock:
            self._starting = max(0, self._starting - 1)
            self._last_start = time.monotonic()

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    # ------------------------------------------------------------ refill
    def _prepare(self) -> Pooled:
        cg = SandboxCgroups.create(PREFIX + secrets.token_hex(8), None, group=self.group)
        try:
            launcher = Launcher(self.agent_binary, cg.procs_files())
        except OSError as e:
            cg.remove()
            raise SandboxError(f"cannot start a launcher: {e}") from None
        item = Pooled(launcher, cg)
        try:
            launcher.wait_parked(PARK_TIMEOUT_S)
        except LauncherError:
            item.discard()
            raise
        return item

    def _run(self) -> None:
        with suppress(OSError):     # background work: sandbox starts get the CPU first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while not self._stop.is_set():
            if self.ready() >= self.size:
                self._wake.wait(timeout=5.0)
                self._wake.clear()
                continue
            with self._lock:
                wait = refill_delay(ready=len(self._ready), low_water=self.low_water, starting=self._starting,
                                    last_start=self._last_start, quiet_s=self.quiet_s, now=time.monotonic())
            if wait > 0:
                self._stop.wait(wait)
                continue
            try:
                item = self._prepare()
            except (SandboxError, LauncherError) as e:
                self.failures += 1
                log.warning("launcher pool: cannot park a launcher: %s", e)
                self._stop.wait(self.retry_s)
                continue
            with self._lock:
                keep = not self._stop.is_set()
                if keep:
                    self._ready.append(item)
                    self.prepared += 1
            if not keep:
                item.discard()
