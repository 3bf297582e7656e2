"""Hold the policy in force and swap it atomically on a successful reload.

A broken file never replaces a working policy: reload() reports why and the
old CompiledPolicySet stays in force. watch() polls file stats (no inotify
dependency); the daemon also calls reload() on SIGHUP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .compiled import CompiledPolicySet
from .errors import PolicyError
from .loader import load_policy_dir, load_policy_files, policy_files_in

log = logging.getLogger(__name__)

ChangeCallback = Callable[[CompiledPolicySet, CompiledPolicySet], None]  # (old, new)


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    error: str | None  # PolicyError text (FILE:LINE: ...) when not ok
    digest: str  # digest of the policy in force after the call
    changed: bool = False  # a new policy set was swapped in


class PolicyStore:
    """``source`` is a policy directory, a single file, or a list of files.

    The constructor loads once and raises PolicyError if that fails: the
    daemon must not start without a policy (fail closed).
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike]):
        self._source = source
        self._lock = threading.Lock()
        self._callbacks: list[ChangeCallback] = []
        self._current = self._load()
        self._stamp = self._fingerprint()
        self._pending: tuple | None = None   # stats seen changed once, not yet stable (settle)
        self.last_error: str | None = None

    @property
    def current(self) -> CompiledPolicySet:
        return self._current

    @property
    def digest(self) -> str:
        return self._current.digest

    def on_change(self, callback: ChangeCallback) -> ChangeCallback:
        """Register ``callback(old, new)``, called after each successful swap."""
        self._callbacks.append(callback)
        return callback

    def _paths(self) -> list[Path]:
        src = self._source
        if isinstance(src, (str, os.PathLike)):
            p = Path(src)
            return policy_files_in(p) if p.is_dir() else [p]
        return [Path(s) for s in src]

    def _load(self) -> CompiledPolicySet:
        src = self._source
        if isinstance(src, (str, os.PathLike)) and Path(src).is_dir():
            return load_policy_dir(src)
        return load_policy_files(self._paths())

    def _fingerprint(self) -> tuple:
        """Cheap change detector: names, sizes and mtimes of the files."""
        try:
            out = []
            for p in self._paths():
                try:
                    st = p.stat()
                    out.append((str(p), st.st_mtime_ns, st.st_size, st.st_ino))
                except OSError:
                    out.append((str(p), None, None, None))
            return tuple(out)
        except OSError:
            return ()

    def reload(self) -> ReloadResult:
        """Load and compile again; swap only on success. Never raises PolicyError."""
        return self._reload(None)

    def _reload(self, expect: tuple | None) -> ReloadResult | None:
        with self._lock:
            for _ in range(3):
                stamp = self._fingerprint()
                if expect is not None and stamp != expect:
                    self._pending = stamp   # changed again since the settled look: not yet
                    return None
                self._stamp = stamp
                try:
                    new = self._load()
                except PolicyError as exc:
                    new, error = None, exc
                # A file rewritten while we read it may have been read half-way: read again.
                if self._fingerprint() == self._stamp:
                    break
            else:
                self._stamp = ()     # still changing: keep the old policy, look again next poll
                return ReloadResult(True, None, self._current.digest, False)
            if new is None:
                exc = error
                self.last_error = str(exc)
                log.error("policy reload failed, keeping digest %s in force:\n%s", self._current.digest[:12], exc)
                return ReloadResult(False, str(exc), self._current.digest, False)
            self.last_error = None
            old = self._current
            if new.digest == old.digest:
                return ReloadResult(True, None, old.digest, False)
            self._current = new
        log.info("policy reloaded: digest %s -> %s", old.digest[:12], new.digest[:12])
        for cb in list(self._callbacks):
            try:
                cb(old, new)
            except Exception:  # a listener must not undo a good reload
                log.exception("policy change callback failed")
        return ReloadResult(True, None, new.digest, True)

    def check_for_changes(self, *, settle: bool = False, quiet_seconds: float = 0.25) -> ReloadResult | None:
        """Reload if the files' stats changed since the last look; else None.

        settle=True (the daemon's poller): reload only once no file was modified for
        `quiet_seconds` and the new stats were seen on two looks in a row, so a file
        being written in pieces (`cat > f`, an editor writing in place, a writer that
        stalls between its writes) is not loaded half-way; a half-written file can be
        a valid, different policy. Atomic replacement (write + rename) is still the
        way to publish a policy: it needs no waiting at all.
        """
        fp = self._fingerprint()
        if fp == self._stamp:
            self._pending = None
            return None
        if settle and _newest_mtime_age(fp) < quiet_seconds:
            return None           # still being written (or just was): look again next poll
        if settle and fp != self._pending:
            self._pending = fp
            return None
        self._pending = None
        return self._reload(fp if settle else None)

    async def watch(self, interval: float = 1.0) -> None:
        """Poll for changes until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.check_for_changes()
            except Exception:  # keep watching; the old policy stays in force
                log.exception("policy watch iteration failed")


def _newest_mtime_age(fp: tuple) -> float:
    """Seconds since the most recent modification among the fingerprinted files."""
    mtimes = [m for (_, m, _, _) in fp if m is not None]
    return (time.time_ns() - max(mtimes)) / 1e9 if mtimes else float("inf")
