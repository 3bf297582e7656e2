"""How many refusals one source may have written one by one. Pure: no I/O, no clock.

A sandbox opening refused connections in a loop would otherwise write one audit record
per refusal and, with a bounded retention, rotate every other sandbox's older records
away. Per source (a sandbox's identity, or before identification the client address) the
first ``per_interval`` refusals of an interval are written as usual; the rest are only
counted per (reason, host) and written as one summary record per source when the
interval is drained (and at shutdown), so every refusal is still accounted for.

Bounded memory: at most ``max_sources`` sources of each kind are tracked per interval
(refusals of further sources are counted under ``OTHER_SOURCE``, never written one by one:
fail closed on the log's size; per kind, so client addresses, which a sandbox may vary,
never crowd identified sandboxes out of their own records), and at most ``max_keys`` (reason, host) pairs per source
(further hosts under ``(reason, OTHER)``: reasons are a fixed set, egress/reasons.py, so
the totals per reason stay exact).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_REFUSALS_PER_INTERVAL = 200   # per source: a working agent's refusals all visible, a flood bounded
DEFAULT_INTERVAL_SECONDS = 60.0
OTHER = "*"
OTHER_SOURCE = ("*", "*")     # (kind, value) of sources past the cap


@dataclass
class CountedRefusals:
    written: int = 0                                    # written one by one this interval
    counted: int = 0                                    # past the budget: only counted
    by_key: dict[tuple[str, str], int] = field(default_factory=dict)   # (reason, host) -> n

    def counts_text(self, max_len: int = 2000) -> str:
        """`reason@host=n,...`, largest first, for the summary record (whose strings are capped
        in length): pairs that would not fit are folded into `*@*`."""
        parts, folded, used = [], 0, 0
        for (r, h), n in sorted(self.by_key.items(), key=lambda kv: (-kv[1], kv[0])):
            part = f"{r}@{h}={n}"
            if used + len(part) + 1 > max_len - 16:
                folded += n
                continue
            parts.append(part)
            used += len(part) + 1
        if folded:
            parts.append(f"{OTHER}@{OTHER}={folded}")
        return ",".join(parts)


class RefusalBudget:
    def __init__(self, per_interval: int, *, max_sources: int = 10_000, max_keys: int = 32):
        if per_interval < 0 or max_sources < 1 or max_keys < 1:
            raise ValueError("per_interval must be >= 0, max_sources and max_keys >= 1")
        self.per_interval, self.max_sources, self.max_keys = per_interval, max_sources, max_keys
        self._sources: dict[tuple[str, str], CountedRefusals] = {}
        self._per_kind: dict[str, int] = {}

    def admit(self, source: tuple[str, str], reason: str | None, host: str | None) -> bool:
        """One refusal by `source` ("sandbox", id) or ("client", address): True when it is to be
        written now, False when it was counted into the interval's summary instead."""
        c = self._sources.get(source)
        if c is None:
            kind = source[0]
            if self._per_kind.get(kind, 0) >= self.max_sources:
                source = OTHER_SOURCE
            elif source != OTHER_SOURCE:
                self._per_kind[kind] = self._per_kind.get(kind, 0) + 1
            c = self._sources.setdefault(source, CountedRefusals())
        if source != OTHER_SOURCE and c.written < self.per_interval:
            c.written += 1
            return True
        key = (reason or OTHER, host or "")
        if key not in c.by_key and len(c.by_key) >= self.max_keys:
            key = (key[0], OTHER)
        c.by_key[key] = c.by_key.get(key, 0) + 1
        c.counted += 1
        return False

    def drain(self) -> dict[tuple[str, str], CountedRefusals]:
        """Sources with counted refusals since the last drain; every counter starts again."""
        out = {s: c for s, c in self._sources.items() if c.counted}
        self._sources, self._per_kind = {}, {}
        return out

    @property
    def sources(self) -> int:
        return len(self._sources)
