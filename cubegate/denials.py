"""Each sandbox's recent denials, in memory, for the sandbox itself (cubegate.internal/v1/denials).

Fed by every audit record the gate and the sandbox resolver write (a tap on
the audit log): bounded per sandbox (a ring) and in the number of sandboxes
(least recently denied dropped first). Only what the sandbox itself sent or
asked for is kept: destination, reason, rule and policy name, never another
sandbox's records and never a header or body.
"""
from __future__ import annotations

import collections
import threading

KEPT_FIELDS = ("ts", "event", "host", "port", "method", "path", "reason", "rule", "policy", "status")


class DenialRing:
    def __init__(self, per_sandbox: int = 50, max_sandboxes: int = 10_000):
        self.per_sandbox, self.max_sandboxes = per_sandbox, max_sandboxes
        self._rings: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._lock = threading.Lock()

    def observe(self, rec: dict) -> None:
        sandbox = rec.get("sandbox")
        if not sandbox or rec.get("decision") != "deny" or rec.get("event") not in ("decision", "request", "dns"):
            return
        entry = {k: rec.get(k) for k in KEPT_FIELDS if rec.get(k) is not None}
        with self._lock:
            ring = self._rings.get(sandbox)
            if ring is None:
                ring = self._rings[sandbox] = collections.deque(maxlen=self.per_sandbox)
                while len(self._rings) > self.max_sandboxes:
                    self._rings.popitem(last=False)
            else:
                self._rings.move_to_end(sandbox)
            ring.append(entry)

    def recent(self, sandbox_id: str) -> list[dict]:
        with self._lock:
            return list(reversed(self._rings.get(sandbox_id, ())))   # newest first

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._rings.pop(sandbox_id, None)


class TappedAudit:
    """The audit log, with every appended record also shown to `tap` (after it was written)."""

    def __init__(self, inner, tap):
        self._inner, self._tap = inner, tap

    def append(self, rec: dict):
        out = self._inner.append(rec)
        self._tap(rec)
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)
