"""http://cubegate.internal/ — what a sandbox may ask the gateway about itself.

Served by the gate (egress/gate.py, plain HTTP only) to the sandbox that sends
the request, identified as for any other request (proxy credential, or source
address in transparent mode); the sandbox resolver answers the name, with the
gateway's address, to sandboxes only. A sandbox reads its own recent denials
and its own access requests and files new ones; it can never approve anything
nor read any policy. Filing is rate-limited per sandbox, size-limited, and
capped in pending requests.

    GET  /v1/denials            this sandbox's recent denials (newest first)
    GET  /v1/access-requests    this sandbox's access requests
    POST /v1/access-requests    {"host": "...", "port": 443, "reason": "why"}  → 201
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from egress.identity import Identity
from egress.policy import normalize_host

MAX_BODY = 4096


class RateLimit:
    """Per-sandbox token bucket (bounded: least recently used sandboxes forgotten first)."""

    def __init__(self, per_minute: int, max_keys: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.max_keys, self.clock = per_minute / 60.0, float(per_minute), max_keys, clock
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> bool:
        now = self.clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.pop(next(iter(self._buckets)))
        return ok

    def forget(self, key: str) -> None:
        self._buckets.pop(key, None)


def _public(req: dict) -> dict:
    """What the sandbox sees of its own request (who decided stays with the admins)."""
    return {k: req[k] for k in ("id", "host", "port", "reason", "state", "created", "expires")}


class AgentEndpoint:
    max_body = MAX_BODY

    def __init__(self, *, denials, access, notify: Callable[[dict], None], requests_per_minute: int,
                 max_pending: int, max_reason_chars: int):
        self.denials, self.access, self.notify = denials, access, notify
        self.limit = RateLimit(requests_per_minute)
        self.max_pending, self.max_reason_chars = max_pending, max_reason_chars

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: its filing budget too (a reused id starts afresh)."""
        self.limit.forget(sandbox_id)

    def answer(self, identity: Identity, method: str, path: str, body: bytes) -> tuple[int, dict]:
        path = path.split("?", 1)[0]
        sandbox = identity.sandbox_id
        if path in ("/", "/v1"):
            return 200, {"sandbox": sandbox, "endpoints": ["GET /v1/denials", "GET /v1/access-requests",
                                                           "POST /v1/access-requests {host, port, reason}"]}
        if path == "/v1/denials" and method == "GET":
            return 200, {"sandbox": sandbox, "denials": self.denials.recent(sandbox)}
        if path == "/v1/access-requests" and method == "GET":
            return 200, {"sandbox": sandbox, "requests": [_public(r) for r in self.access.list(sandbox=sandbox)]}
        if path == "/v1/access-requests" and method == "POST":
            return self._file(identity, body)
        if path in ("/v1/denials", "/v1/access-requests"):
            return 405, {"error": "method_not_allowed", "message": f"{method} is not served here"}
        return 404, {"error": "not_found", "message": "see GET http://cubegate.internal/"}

    def _file(self, identity: Identity, body: bytes) -> tuple[int, dict]:
        try:
            doc = json.loads(body or b"null")
        except (ValueError, RecursionError):
            return 400, {"error": "invalid", "message": "body must be JSON: {\"host\", \"port\", \"reason\"}"}
        if not isinstance(doc, dict) or set(doc) - {"host", "port", "reason"}:
            return 400, {"error": "invalid", "message": "body must be an object with host, port and reason only"}
        host, port, reason = doc.get("host"), doc.get("port", 443), doc.get("reason", "")
        try:
            host = normalize_host(host) if isinstance(host, str) and len(host) <= 253 else None
        except ValueError:
            host = None
        if host is None:
            return 400, {"error": "invalid", "message": "host must be a host name"}
        if type(port) is not int or not 0 < port < 65536:
            return 400, {"error": "invalid", "message": "port must be 1-65535"}
        if not isinstance(reason, str) or len(reason) > self.max_reason_chars:
            return 400, {"error": "invalid", "message": f"reason must be text of at most {self.max_reason_chars} chars"}
        sandbox = identity.sandbox_id
        same = self.access.pending_for(sandbox, host, port)
        if same:
            return 200, {"request": _public(same[0]), "message": "already pending"}
        if len(self.access.pending_for(sandbox)) >= self.max_pending:
            return 429, {"error": "too_many_pending", "message": f"at most {self.max_pending} pending requests"}
        if not self.limit.take(sandbox):
            return 429, {"error": "rate_limited", "message": "too many requests; try again in a minute"}
        req = self.access.file(sandbox, dict(identity.labels), host, port, reason)
        self.notify(req)
        return 201, {"request": _public(req), "message": "filed; an admin decides"}
