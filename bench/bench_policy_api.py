"""Issue #13 figures: decision cost with many per-sandbox network policies, and the time from an
approved access request to the first allowed connection through the real gateway.

Run: .venv/bin/python bench/bench_policy_api.py [--seconds 1.0] [--no-lab] [--rounds 8]
(the lab part needs root: it starts the standard lab and a gateway, as the tests do).
Every loop is bounded in count and time.
"""
from __future__ import annotations

import argparse
import base64
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egress.policy import CompiledPolicySet, Match, Policy, RequestInfo, Rule, parse_host_pattern  # noqa: E402
from egress.policy.effective import EffectivePolicy  # noqa: E402
from egress.policy.grants import GrantIndex  # noqa: E402
from egress.policy.network import parse_network  # noqa: E402


def decision_cost(n_sandboxes: int, seconds: float, max_calls: int = 2_000_000) -> float:
    """ns per decide() for sandboxes that each carry network options, with n_sandboxes of them loaded."""
    base = CompiledPolicySet([Policy("p", rules=tuple(
        Rule(f"r{i}", "allow", Match(hosts=(parse_host_pattern(f"h{i}.example.com"),), ports=frozenset({443})))
        for i in range(50)))])
    nets = {f"sb-{i}": parse_network({"allow": [f"h{i % 50}.example.com:443", "*.cdn.test"],
                                      "deny": ["10.0.0.0/8"]}) for i in range(n_sandboxes)}
    eff = EffectivePolicy(base, GrantIndex(()), nets)
    reqs = [RequestInfo(f"sb-{i % n_sandboxes}", {}, f"h{(i * 7) % 50}.example.com", 443) for i in range(1000)]
    calls, t0 = 0, time.perf_counter()
    while calls < max_calls and time.perf_counter() - t0 < seconds:
        for r in reqs:
            eff.decide(r)
        calls += len(reqs)
    return (time.perf_counter() - t0) / calls * 1e9


def approval_latency(rounds: int) -> list[dict]:
    """Sandbox files a request at cubegate.internal (explicit proxy), an admin approves it through the
    policy API, then CONNECTs are tried back to back until one is 200."""
    import httpx

    from testbed.lab import Lab
    from tests.gateway.harness import Gateway

    hosts = ["spare1.test", "spare2.test", "x.github.test", "a.b.github.test", "github.test",
             "evil-github.test", "redirect.allowed.test", "echo.allowed.test"][:rounds]
    out = []
    with tempfile.TemporaryDirectory() as tmp, Lab(workdir=tmp) as lab:
        gw = Gateway(lab, Path(tmp) / "gw", {"main.yaml": "name: main\ndefault: deny\nrules: []\n"},
                     settings_extra={"access": {"requests_per_minute": 600}})
        gw.start()
        try:
            token = (gw.state_dir / "admin.token").read_text().strip()
            auth = base64.b64encode(f"sb-1:{gw.tokens['sb-1']}".encode()).decode()

            def connect(host: str) -> int:
                with socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=5) as s:
                    s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Basic "
                              f"{auth}\r\n\r\n".encode())
                    return int(s.recv(64).split()[1])

            def one(host: str) -> dict:
                proxy = f"http://sb-1:{gw.tokens['sb-1']}@127.0.0.1:{gw.proxy_port}"
                with httpx.Client(proxy=proxy, trust_env=False, timeout=10) as c:
                    rid = c.post("http://cubegate.internal/v1/access-requests",
                                 json={"host": host, "port": 443, "reason": "bench"}).json()["request"]["id"]
                assert connect(host) == 403
                t0 = time.perf_counter()
                r = httpx.post(f"http://127.0.0.1:{gw.proxy_port + 3}/v1/access-requests/{rid}/approve",
                               headers={"Authorization": f"Bearer {token}"}, json={"scope": "sandbox"},
                               trust_env=False, timeout=10)
                t_ack = time.perf_counter()
                assert r.status_code == 200, r.text
                tries = 0
                while connect(host) != 200 and tries < 1000:
                    tries += 1
                t_ok = time.perf_counter()
                return {"host": host, "approve_ms": (t_ack - t0) * 1e3, "to_first_allowed_ms": (t_ok - t0) * 1e3,
                        "after_ack_ms": (t_ok - t_ack) * 1e3, "refused_after_ack": tries}
            for h in hosts:
                out.append(lab.call_gw(one, h))
        finally:
            gw.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-lab", action="store_true")
    a = ap.parse_args()
    runs = {10: [], 10_000: []}
    for _ in range(3):          # interleaved, best of three: the machine is shared and noisy
        for n in runs:
            runs[n].append(decision_cost(n, a.seconds))
    c10, c10k = min(runs[10]), min(runs[10_000])
    print(f"decide() with per-sandbox network options: 10 sandboxes {c10:.0f} ns, 10,000 sandboxes {c10k:.0f} ns, "
          f"ratio {c10k / c10:.2f}")
    if a.no_lab:
        return
    rows = approval_latency(a.rounds)
    for r in rows:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
    first = [r["to_first_allowed_ms"] for r in rows]
    print(f"approve -> first allowed CONNECT: p50 {statistics.median(first):.1f} ms, max {max(first):.1f} ms "
          f"(the approve call itself p50 {statistics.median(r['approve_ms'] for r in rows):.1f} ms); "
          f"CONNECTs refused after the approve returned: {sum(r['refused_after_ack'] for r in rows)}")


if __name__ == "__main__":
    main()
