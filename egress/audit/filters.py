"""Query filters shared by the SQLite index and the in-memory tail.

Times: RFC3339 with a zone ("2024-05-01T10:00:00Z", "...+02:00") or relative
to now ("30s", "15m", "2h", "1d", "1w"). Host: exact (case-insensitive) or
"*.suffix", which matches subdomains of suffix but not suffix itself (the
same meaning as a wildcard in a policy).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from .record import DECISIONS, EVENTS, parse_ts

_RELATIVE_RE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(value: str | datetime, *, now: datetime | None = None) -> datetime:
    """Parse RFC3339 or a relative age ("15m" = 15 minutes ago) into an aware UTC datetime."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("datetime filter must be timezone-aware")
        return value.astimezone(timezone.utc)
    if not isinstance(value, str):
        raise ValueError(f"bad time {value!r}")
    m = _RELATIVE_RE.match(value)
    if m:
        now = now or datetime.now(timezone.utc)
        return now - timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])
    text = value.strip()
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"bad time {value!r}: use RFC3339 (2024-05-01T10:00:00Z) or an age like 15m, 2h, 1d"
        ) from None
    if dt.tzinfo is None:
        raise ValueError(f"time {value!r} has no timezone: add Z or +hh:mm")
    return dt.astimezone(timezone.utc)


def to_epoch_ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def normalize_host_pattern(pattern: str) -> tuple[str, bool]:
    """-> (host or ".suffix" lowercased, is_suffix)."""
    p = pattern.strip().lower().rstrip(".")
    if p.startswith("*."):
        suffix = p[1:]
        if len(suffix) < 2 or "*" in suffix:
            raise ValueError(f"bad host pattern {pattern!r}")
        return suffix, True
    if not p or "*" in p:
        raise ValueError(f"bad host pattern {pattern!r}: exact host or *.suffix")
    return p, False


@dataclass(frozen=True)
class RecordFilter:
    sandbox: str | None = None
    host: str | None = None
    decision: str | None = None
    reason: str | None = None
    event: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    @classmethod
    def build(
        cls,
        *,
        sandbox: str | None = None,
        host: str | None = None,
        decision: str | None = None,
        reason: str | None = None,
        event: str | None = None,
        since: str | datetime | None = None,
        until: str | datetime | None = None,
        now: datetime | None = None,
    ) -> "RecordFilter":
        if decision is not None and decision not in DECISIONS:
            raise ValueError(f"decision must be one of {sorted(DECISIONS)}, got {decision!r}")
        if event is not None and event not in EVENTS:
            raise ValueError(f"event must be one of {sorted(EVENTS)}, got {event!r}")
        if host is not None:
            normalize_host_pattern(host)  # validate early
        now = now or datetime.now(timezone.utc)
        since_ms = to_epoch_ms(parse_time(since, now=now)) if since is not None else None
        until_ms = to_epoch_ms(parse_time(until, now=now)) if until is not None else None
        return cls(sandbox, host, decision, reason, event, since_ms, until_ms)

    def matches(self, record: dict[str, Any]) -> bool:
        for name in ("sandbox", "decision", "reason", "event"):
            want = getattr(self, name)
            if want is not None and record.get(name) != want:
                return False
        if self.host is not None:
            h = record.get("host")
            if not isinstance(h, str):
                return False
            h = h.lower().rstrip(".")
            pat, is_suffix = normalize_host_pattern(self.host)
            if (is_suffix and not h.endswith(pat)) or (not is_suffix and h != pat):
                return False
        if self.since_ms is not None or self.until_ms is not None:
            ts_ms = to_epoch_ms(parse_ts(record["ts"]))
            if self.since_ms is not None and ts_ms < self.since_ms:
                return False
            if self.until_ms is not None and ts_ms > self.until_ms:
                return False
        return True
