"""Server-side login sessions for browser apps: random ids, idle and absolute expiry, CSRF token.

The cookie carries only a random session id; the store keeps the SHA-256 of
it (a leaked memory dump or log line holds no usable id) together with who
logged in, a CSRF token and when the session was last used. Bounded: at most
`max_sessions` live at once (the least recently used goes first), and at most
`max_per_actor` of one actor (its own oldest goes first: one token logging in over
and over cannot push everyone else's sessions out). Pure apart from the clock,
which tests pass in.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from typing import Any, Callable


@dataclasses.dataclass
class Session:
    actor: str                  # who logged in (an id that may be shown and audited)
    scope: str                  # what they may do ("admin", "read", ...): the app decides
    csrf: str                   # sent back on every state change (form field or header)
    created: float
    last_seen: float
    data: dict[str, Any] = dataclasses.field(default_factory=dict)   # the app's small per-session state

    def csrf_ok(self, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.csrf.encode(), presented.encode())


def _key(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()


class SessionStore:
    def __init__(self, *, idle_seconds: float, max_age_seconds: float, max_sessions: int = 256,
                 max_per_actor: int = 16, clock: Callable[[], float] = time.monotonic):
        if idle_seconds <= 0 or max_age_seconds <= 0 or max_sessions <= 0 or max_per_actor <= 0:
            raise ValueError("idle_seconds, max_age_seconds, max_sessions and max_per_actor must be positive")
        self.idle_seconds, self.max_age_seconds, self.max_sessions = idle_seconds, max_age_seconds, max_sessions
        self.max_per_actor = max_per_actor
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def create(self, actor: str, scope: str) -> tuple[str, Session]:
        """A new session (never reuses an id: no fixation); returns (id for the cookie, session)."""
        now = self._clock()
        self._expire(now)
        own = [k for k, s in self._sessions.items() if s.actor == actor]   # least recently used first
        for k in own[:max(0, len(own) - self.max_per_actor + 1)]:
            del self._sessions[k]
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        session_id = secrets.token_urlsafe(32)
        session = Session(actor, scope, secrets.token_urlsafe(32), now, now)
        self._sessions[_key(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None, *, touch: bool = True) -> Session | None:
        """The live session, or None (unknown, idle too long, or too old). touch=False: a background
        request (a poll, a stream) that must not keep an unattended session alive."""
        if not session_id:
            return None
        now = self._clock()
        key = _key(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        if self._expired(session, now):
            del self._sessions[key]
            return None
        if touch:
            session.last_seen = now
            self._sessions.move_to_end(key)
        return session

    def end(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(_key(session_id), None)

    def end_where(self, pred: Callable[[Session], bool]) -> int:
        """End every session `pred` selects (e.g. all sessions of a revoked token)."""
        gone = [k for k, s in self._sessions.items() if pred(s)]
        for k in gone:
            del self._sessions[k]
        return len(gone)

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._sessions)

    def _expired(self, s: Session, now: float) -> bool:
        return now - s.last_seen >= self.idle_seconds or now - s.created >= self.max_age_seconds

    def _expire(self, now: float) -> None:
        for k in [k for k, s in self._sessions.items() if self._expired(s, now)]:
            del self._sessions[k]
