"""What the sandbox resolver counts and limits, in bounded memory. Pure: no I/O, the
caller passes the clock (monotonic seconds).

NewNameLimiter — labels under an allowed wildcard are a data channel to that domain's
authoritative server (``<data>.x.github.test``). Per (sandbox, scope) — the scope is the
wildcard pattern that allowed the name — at most ``limit`` distinct names are admitted in
any sliding window of ``window`` seconds. An admitted name stays admitted until its
window ends (repeats are free); then it counts as new again. State per key is at most
``limit`` names, and the number of keys is capped.

AnswerAggregator — allowed answers are audited as one record per (sandbox, name) per
interval with counters, not one per query; refusals by the limiter as one record per
(sandbox, scope). Tracked keys are capped: beyond the cap queries are only counted
(per sandbox, itself capped) instead of growing the state. Other refusals (names the
policy never allows, SSRF answers) are written one by one, but at most
``MAX_DENIALS_PER_INTERVAL`` per sandbox and interval: beyond that they are counted into
one record at the interval's end (a sandbox flooding random names would otherwise fill
the audit log and push every sandbox's older records out of its rotation) — the
gateway's own rule for its refusals, egress.refusal_budget.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from egress.refusal_budget import CountedRefusals, RefusalBudget

WINDOW_SECONDS = 60.0
MAX_LIMITER_KEYS = 50_000       # (sandbox, scope) pairs: sandboxes x wildcard rules in their policy
MAX_AGGREGATE_KEYS = 20_000     # (sandbox, name) + (sandbox, scope) pairs per interval
MAX_QTYPES_PER_NAME = 8         # distinct qtypes counted by name per key; the rest as OTHER
MAX_OVERFLOW_SANDBOXES = 1_000  # sandboxes named in the overflow counts; the rest as "*"
MAX_DENIALS_PER_INTERVAL = 50   # refusals written one by one per sandbox and interval; the rest counted
_SWEEP_EVERY = 1.0              # at most one full sweep per second when the key cap is hit

NEW, KNOWN, LIMITED, FULL = "new", "known", "limited", "full"


class NewNameLimiter:
    def __init__(self, limit: int, *, window: float = WINDOW_SECONDS, max_keys: int = MAX_LIMITER_KEYS):
        if limit < 1 or window <= 0 or max_keys < 1:
            raise ValueError("limit and max_keys must be >= 1, window > 0")
        self.limit, self.window, self.max_keys = limit, window, max_keys
        self._admitted: dict[tuple[str, str], OrderedDict[str, float]] = {}   # name -> admitted at
        self._last_sweep = float("-inf")

    def admit(self, sandbox: str, scope: str, name: str, now: float) -> str:
        """NEW (admitted now), KNOWN (admitted earlier in its window), LIMITED (``limit`` names
        already admitted in the window) or FULL (too many keys: refused, fail closed)."""
        key = (sandbox, scope)
        names = self._admitted.get(key)
        if names is None:
            if len(self._admitted) >= self.max_keys:
                if now - self._last_sweep >= _SWEEP_EVERY:
                    self.sweep(now)
                if len(self._admitted) >= self.max_keys:
                    return FULL
            names = self._admitted[key] = OrderedDict()
        self._expire(names, now)
        if name in names:
            return KNOWN
        if len(names) >= self.limit:
            return LIMITED
        names[name] = now
        return NEW

    def _expire(self, names: OrderedDict[str, float], now: float) -> None:
        while names:
            first = next(iter(names.values()))
            if now - first < self.window:
                break
            names.popitem(last=False)

    def sweep(self, now: float) -> None:
        """Drop expired names and keys left empty (called on every flush and at the key cap)."""
        self._last_sweep = now
        for key in list(self._admitted):
            names = self._admitted[key]
            self._expire(names, now)
            if not names:
                del self._admitted[key]

    def forget(self, sandbox: str) -> None:
        """The sandbox is gone: its windows too (a reused id starts with none)."""
        for key in [k for k in self._admitted if k[0] == sandbox]:
            del self._admitted[key]

    @property
    def keys(self) -> int:
        return len(self._admitted)


@dataclass
class NameCounts:
    queries: int = 0
    answers: int = 0                     # answer records sent back
    qtypes: dict[str, int] = field(default_factory=dict)
    scope: str | None = None             # the wildcard that allowed it (None: an exact host rule)

    def qtypes_text(self) -> str:
        return ",".join(f"{t}={n}" for t, n in sorted(self.qtypes.items()))


@dataclass
class LimitedCounts:
    refused: int = 0
    first_name: str = ""


@dataclass
class Interval:
    """What one interval saw, ready to become audit records."""
    names: dict[tuple[str, str], NameCounts]           # (sandbox, name)
    limited: dict[tuple[str, str], LimitedCounts]      # (sandbox, scope)
    overflow: dict[str, int]                           # sandbox ("*" past the cap) -> untracked queries
    denied: dict[tuple[str, str], CountedRefusals] = field(default_factory=dict)   # source with counted refusals

    def __bool__(self) -> bool:
        return bool(self.names or self.limited or self.overflow or self.suppressed)

    @property
    def suppressed(self) -> dict[tuple[str, str], CountedRefusals]:
        """Sources (("sandbox", id), or egress.refusal_budget.OTHER_SOURCE past the cap) with
        refusals that were only counted (one record each)."""
        return self.denied


class AnswerAggregator:
    def __init__(self, *, max_keys: int = MAX_AGGREGATE_KEYS):
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._reset()

    def _reset(self) -> None:
        self._names: dict[tuple[str, str], NameCounts] = {}
        self._limited: dict[tuple[str, str], LimitedCounts] = {}
        self._overflow: dict[str, int] = {}
        self._refusals = RefusalBudget(MAX_DENIALS_PER_INTERVAL, max_sources=MAX_OVERFLOW_SANDBOXES,
                                       max_keys=MAX_QTYPES_PER_NAME)

    def _room(self) -> bool:
        return len(self._names) + len(self._limited) < self.max_keys

    def _overflowed(self, sandbox: str) -> None:
        if sandbox not in self._overflow and len(self._overflow) >= MAX_OVERFLOW_SANDBOXES:
            sandbox = "*"
        self._overflow[sandbox] = self._overflow.get(sandbox, 0) + 1

    def answered(self, sandbox: str, name: str, qtype: str, answers: int, scope: str | None) -> bool:
        """Count one allowed query; False when it was only counted as overflow."""
        key = (sandbox, name)
        c = self._names.get(key)
        if c is None:
            if not self._room():
                self._overflowed(sandbox)
                return False
            c = self._names[key] = NameCounts(scope=scope)
        c.queries += 1
        c.answers += answers
        if qtype not in c.qtypes and len(c.qtypes) >= MAX_QTYPES_PER_NAME:
            qtype = "OTHER"
        c.qtypes[qtype] = c.qtypes.get(qtype, 0) + 1
        return True

    def limited(self, sandbox: str, scope: str, name: str) -> bool:
        """Count one refusal by the limiter; True for the first of this interval for
        (sandbox, scope): the caller writes that one at once, so the refusal is visible now."""
        key = (sandbox, scope)
        c = self._limited.get(key)
        if c is None:
            if not self._room():
                self._overflowed(sandbox)
                return False
            c = self._limited[key] = LimitedCounts(first_name=name)
        c.refused += 1
        return c.refused == 1

    def denied(self, sandbox: str, name: str, reason: str) -> bool:
        """One refusal; True while the sandbox has had fewer than MAX_DENIALS_PER_INTERVAL this
        interval (the caller writes it at once), else it is only counted."""
        return self._refusals.admit(("sandbox", sandbox), reason, name)

    def drain(self) -> Interval:
        """Everything counted since the last drain; the counters start again from zero."""
        out = Interval(self._names, self._limited, self._overflow, self._refusals.drain())
        self._reset()
        return out

    @property
    def keys(self) -> int:
        return len(self._names) + len(self._limited)
