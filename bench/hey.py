"""Run `hey` (apt: hey, a Go load generator) and parse what it prints.

Two output modes, each used where it is the one that carries the answer:

  -o csv    one line per *answered* request (timings, status code, start
            offset): exact p50/p99 for any count. Requests that failed are
            absent from it, so it is used for rows that expect answers.
  summary   totals, req/s and the error distribution, but percentiles only
            at 0.1 ms and none for n < 100 (hey prints "0% in 0.0000").
            Used for rows that expect refusals (a CONNECT answered 403 is an
            error to Go's client: no timings exist for it).

hey does not verify TLS certificates (InsecureSkipVerify); callers check
with curl what the path really is (passthrough or intercepted).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["HeyResult", "argv", "parse_csv", "parse_summary", "percentile"]

CSV_HEADER = "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset"


@dataclass(frozen=True)
class HeyResult:
    sent: int                          # requests hey issued (n rounded down to a multiple of c)
    answered: int                      # requests that got an HTTP response
    wall_s: float                      # first request start -> last response end (or hey's Total)
    status_counts: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)   # message -> count (summary mode only)
    latencies_s: tuple[float, ...] = ()

    @property
    def failed(self) -> int:
        return self.sent - self.answered

    @property
    def rps(self) -> float:
        return self.sent / self.wall_s if self.wall_s > 0 else 0.0

    def p(self, pct: float) -> float | None:
        return percentile(self.latencies_s, pct)


def argv(url: str, *, requests: int, concurrency: int, proxy: str | None, keepalive: bool,
         csv: bool, timeout_s: int = 10) -> list[str]:
    out = ["hey", "-n", str(requests), "-c", str(concurrency), "-t", str(timeout_s)]
    if proxy:
        out += ["-x", proxy]
    if not keepalive:
        out.append("-disable-keepalive")
    if csv:
        out += ["-o", "csv"]
    return [*out, url]


def sent_count(requests: int, concurrency: int) -> int:
    """hey gives each of c workers n // c requests and drops the remainder."""
    return (requests // concurrency) * concurrency


def percentile(values: tuple[float, ...] | list[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(s)))
    return s[rank - 1]


def parse_csv(text: str, sent: int) -> HeyResult:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if not lines or lines[0] != CSV_HEADER:
        raise ValueError(f"not hey csv output: {text[:200]!r}")
    lat: list[float] = []
    status: dict[int, int] = {}
    start, end = math.inf, 0.0
    for line in lines[1:]:
        cols = line.split(",")
        if len(cols) != 8:
            raise ValueError(f"bad hey csv line: {line!r}")
        rt, code, offset = float(cols[0]), int(cols[6]), float(cols[7])
        lat.append(rt)
        status[code] = status.get(code, 0) + 1
        start, end = min(start, offset), max(end, offset + rt)
    wall = end - start if lat else 0.0
    return HeyResult(sent=sent, answered=len(lat), wall_s=wall, status_counts=status,
                     latencies_s=tuple(lat))


_TOTAL = re.compile(r"^\s*Total:\s+([0-9.]+) secs", re.M)
_STATUS = re.compile(r"^\s*\[(\d{3})\]\s+(\d+) responses", re.M)
_ERROR = re.compile(r"^\s*\[(\d+)\]\s+(.+)$")


def parse_summary(text: str, sent: int) -> HeyResult:
    m = _TOTAL.search(text)
    if not m or "Summary:" not in text:
        raise ValueError(f"not hey summary output: {text[:200]!r}")
    status = {int(code): int(n) for code, n in _STATUS.findall(text)}
    errors: dict[str, int] = {}
    _, _, err_part = text.partition("Error distribution:")
    for line in err_part.splitlines():
        e = _ERROR.match(line)
        if e:
            errors[e.group(2).strip()] = int(e.group(1))
    return HeyResult(sent=sent, answered=sum(status.values()), wall_s=float(m.group(1)),
                     status_counts=status, errors=errors)
