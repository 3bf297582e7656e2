"""The Overview's charts: samples of the daemon's own Prometheus metrics in a bounded ring.

A supervised loop (ConsoleService.sample_loop) reads the registry every
`console.sample_seconds` into a `Sample` of cumulative counters; the ring keeps
15 minutes of them. Everything else here is pure: rates between neighbouring
samples, histogram quantiles (Prometheus' histogram_quantile: linear inside the
bucket) and success ratios over a trailing window.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Iterable

WINDOW_SECONDS = 900.0      # what the charts show
TRAILING_SECONDS = 60.0     # start latency and success rate at a point: starts in the minute before it
QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float                                        # wall clock, seconds
    decisions: dict[str, float]                     # action (allow/deny) -> cumulative count
    bytes: dict[str, float]                         # direction (in/out) -> cumulative bytes
    start_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), all backends
    creations: dict[str, float]                     # result (ok/capacity/error) -> cumulative count


def sample_from(families: Iterable, t: float) -> Sample:
    """A Sample from `registry.collect()` (prometheus_client metric families)."""
    decisions: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    creations: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for fam in families:
        for s in fam.samples:
            if s.name == "cubegate_decisions_total":
                _add(decisions, s.labels.get("action", "?"), s.value)
            elif s.name == "cubegate_bytes_total":
                _add(nbytes, s.labels.get("direction", "?"), s.value)
            elif s.name == "cubegate_sandbox_creations_total":
                _add(creations, s.labels.get("result", "?"), s.value)
            elif s.name == "cubegate_sandbox_start_seconds_bucket":
                _add(buckets, float(s.labels["le"]), s.value)
    return Sample(t, decisions, nbytes, tuple(sorted(buckets.items())), creations)


def _add(d: dict, key, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


class Ring:
    """The last WINDOW_SECONDS of samples (bounded by count too)."""

    def __init__(self, interval: float, window: float = WINDOW_SECONDS):
        self.interval = interval
        self._samples: deque[Sample] = deque(maxlen=int(math.ceil(window / interval)) + 1)

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)

    def samples(self) -> list[Sample]:
        return list(self._samples)

    def __len__(self) -> int:
        return len(self._samples)


def _delta(new: dict, old: dict) -> dict:
    # a counter never goes down in one process; a negative step (a reset) counts as nothing
    return {k: max(0.0, v - old.get(k, 0.0)) for k, v in new.items()}


def bucket_delta(new: tuple, old: tuple) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, max(0.0, c - before.get(le, 0.0))) for le, c in new]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile over (upper bound, cumulative count) pairs; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):          # above the highest finite bound: that bound is all we know
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _ratio(d: dict) -> float | None:
    total = sum(d.values())
    return None if total <= 0 else d.get("ok", 0.0) / total


def _rnd(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def series(samples: list[Sample], top_denied: list[tuple[str, int]] | None = None) -> dict:
    """What the Overview draws: one point per sample after the first."""
    out: dict = {"t": [], "decisions": {"allow": [], "deny": []}, "bytes": {"in": [], "out": []},
                 "start_latency": {name: [] for name, _ in QUANTILES}, "success_rate": [],
                 "window": {}, "top_denied": [{"host": h, "count": n} for h, n in (top_denied or [])]}
    for i in range(1, len(samples)):
        prev, cur = samples[i - 1], samples[i]
        dt = cur.t - prev.t
        if dt <= 0:
            continue
        out["t"].append(round(cur.t, 3))
        dec = _delta(cur.decisions, prev.decisions)
        for action in ("allow", "deny"):
            out["decisions"][action].append(round(dec.get(action, 0.0) / dt, 3))
        nb = _delta(cur.bytes, prev.bytes)
        for direction in ("in", "out"):
            out["bytes"][direction].append(round(nb.get(direction, 0.0) / dt, 1))
        base = _trailing_base(samples, i)
        starts = bucket_delta(cur.start_buckets, base.start_buckets)
        for name, q in QUANTILES:
            out["start_latency"][name].append(_rnd(quantile(q, starts)))
        out["success_rate"].append(_rnd(_ratio(_delta(cur.creations, base.creations))))
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        starts = bucket_delta(last.start_buckets, first.start_buckets)
        created = _delta(last.creations, first.creations)
        out["window"] = {"seconds": round(last.t - first.t, 1),
                         **{name: _rnd(quantile(q, starts)) for name, q in QUANTILES},
                         "starts": int(starts[-1][1]) if starts else 0,
                         "creations": int(sum(created.values())), "success_rate": _rnd(_ratio(created))}
    return out


def _trailing_base(samples: list[Sample], i: int) -> Sample:
    """The sample TRAILING_SECONDS before samples[i] (or the oldest one)."""
    t = samples[i].t - TRAILING_SECONDS
    j = i - 1
    while j > 0 and samples[j - 1].t >= t:
        j -= 1
    return samples[j]
