"""Decisions per second of CompiledPolicySet.decide() versus a naive linear scan.

Run: .venv/bin/python bench/bench_policy.py [--seconds 1.5]
Policies are built in code (no YAML) with 10, 1k and 100k rules over random
hosts (70% exact, 30% wildcard, some with methods/paths). Queries are half
hits, half misses. Each measurement is bounded in time and count; the whole
run stays well under 60 s. The naive reference implements the same precedence
by scanning every rule; both are checked to agree before timing.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egress.policy import CompiledPolicySet, Match, Policy, RequestInfo, Rule, normalize_host, parse_host_pattern  # noqa: E402
from egress.policy.hosts import normalize_path, path_prefix_matches  # noqa: E402

SIZES = (10, 1_000, 100_000)
TLDS = ("com", "net", "org", "io", "test")


def _word(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=n))


def build_rules(n: int, rng: random.Random) -> tuple[list[Rule], list[str]]:
    rules, hosts = [], []
    for i in range(n):
        domain = f"{_word(rng)}.{rng.choice(TLDS)}"
        if rng.random() < 0.7:
            host = f"{_word(rng, 5)}.{domain}"
            pattern, example = host, host
        else:
            pattern, example = f"*.{domain}", f"{_word(rng, 4)}.{_word(rng, 3)}.{domain}"
        action = "deny" if rng.random() < 0.2 else "allow"
        methods = frozenset({"GET", "POST"}) if rng.random() < 0.2 else None
        paths = ("/v1/",) if rng.random() < 0.1 else None
        rules.append(Rule(f"r{i}", action, Match(hosts=(parse_host_pattern(pattern),), methods=methods, paths=paths)))
        hosts.append(example)
    return rules, hosts


class NaivePolicy:
    """Reference: same precedence, one pass over every rule per decision."""

    def __init__(self, rules: list[Rule], default: str = "deny"):
        self.rules = rules
        self.default = default

    def decide(self, req: RequestInfo) -> tuple[str, str | None]:
        host = normalize_host(req.host)
        path = normalize_path(req.path)
        best_key, best = None, None
        for order, rule in enumerate(self.rules):
            m = rule.match
            spec = -1
            for p in m.hosts:
                if p.matches(host):
                    s = 1000 if not p.wildcard else p.name.count(".") + 1
                    spec = max(spec, s)
            if spec < 0:
                continue
            if m.ports is not None and req.port not in m.ports:
                continue
            if m.methods is not None and req.method not in m.methods:
                continue
            plen = 0
            if m.paths is not None:
                hits = [len(p) for p in m.paths if path_prefix_matches(p, path)]
                if not hits:
                    continue
                plen = max(hits)
            key = (spec, plen, rule.action == "deny", -order)
            if best_key is None or key > best_key:
                best_key, best = key, rule
        if best is None:
            return self.default, None
        return best.action, best.name


def make_queries(hosts: list[str], rng: random.Random, count: int) -> list[RequestInfo]:
    out = []
    for _ in range(count):
        if rng.random() < 0.5:
            host = rng.choice(hosts)
        else:
            host = f"{_word(rng, 5)}.{_word(rng)}.{rng.choice(TLDS)}"
        method = rng.choice(("GET", "POST", "DELETE"))
        path = rng.choice(("/v1/chat", "/v2/x", "/"))
        out.append(RequestInfo("sb-1", {}, host, 443, "https", method, path))
    return out


def rate(fn, queries, seconds: float, max_count: int) -> float:
    """Decisions per second, bounded by ``seconds`` and ``max_count``."""
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while done < max_count:
        for q in queries:
            fn(q)
            done += 1
            if done >= max_count or (done & 15 == 0 and time.perf_counter() > deadline):
                break
        if time.perf_counter() > deadline:
            break
    return done / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="time box per measurement")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t_all = time.perf_counter()
    print(f"{'rules':>8} {'compile s':>10} {'trie dec/s':>12} {'naive dec/s':>12} {'speedup':>9}")
    for n in SIZES:
        rules, hosts = build_rules(n, rng)
        t0 = time.perf_counter()
        ps = CompiledPolicySet([Policy("bench", tuple(rules))])
        compile_s = time.perf_counter() - t0
        naive = NaivePolicy(rules)
        queries = make_queries(hosts, rng, 2_000)
        for q in queries[:200]:  # agree before we time
            d = ps.decide(q)
            assert (d.action, d.rule) == naive.decide(q), (q, d, naive.decide(q))
        trie_rate = rate(ps.decide, queries, args.seconds, 2_000_000)
        naive_rate = rate(naive.decide, queries, args.seconds, 2_000_000)
        print(f"{n:>8} {compile_s:>10.3f} {trie_rate:>12,.0f} {naive_rate:>12,.0f} {trie_rate / naive_rate:>8.1f}x",
              flush=True)
    print(f"total {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
