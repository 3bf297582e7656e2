"""Create-to-first-command latency: the E2B SDK against cubegate vs cubegate's own API, same run.

One daemon on a cubevs switch in a private lab (namespace backend). Each round: create a
sandbox, run `true` in it, stop the clock, kill it. E2B path: `Sandbox.create()` +
`commands.run("true")` (the real SDK: REST create, then envd Start stream). cubegate path:
`POST /v1/sandboxes` + `POST /v1/sandboxes/{id}/exec`. Bounded: ROUNDS per level, TIME_CAP_S.

    .venv/bin/python bench/bench_e2b.py [--conc 1,10] [--rounds 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TIME_CAP_S = 300.0
TPORT, API_PORT, E2B_PORT = 18274, 18273, 18275


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def inner(conc_levels: list[int], rounds: int) -> dict:
    """Runs in the gw namespace (the daemon's loopback API is there)."""
    import httpx
    from e2b import Sandbox
    token = os.environ["E2B_API_KEY"]
    deadline = time.monotonic() + TIME_CAP_S

    def e2b_one(_):
        t0 = time.monotonic()
        sbx = Sandbox.create(timeout=120)
        sbx.commands.run("true")
        dt = time.monotonic() - t0
        sbx.kill()
        return dt

    def own_one(_):
        h = {"Authorization": f"Bearer {token}"}
        sid = "bn" + uuid.uuid4().hex[:12]
        with httpx.Client(base_url=f"http://127.0.0.1:{API_PORT}/v1", headers=h, timeout=120) as c:
            t0 = time.monotonic()
            r = c.post("/sandboxes", json={"id": sid, "tenant": "bench"})
            r.raise_for_status()
            r = c.post(f"/sandboxes/{sid}/exec", json={"argv": ["true"]})
            r.raise_for_status()
            dt = time.monotonic() - t0
            c.delete(f"/sandboxes/{sid}")
        return dt

    out = {}
    for conc in conc_levels:
        for name, fn in (("cubegate_api", own_one), ("e2b_sdk", e2b_one)):
            n = max(rounds, conc)
            if time.monotonic() > deadline:
                break
            with ThreadPoolExecutor(conc) as pool:
                t0 = time.monotonic()
                lat = list(pool.map(fn, range(n)))
                wall = time.monotonic() - t0
            out[f"{name}@{conc}"] = {"n": n, "p50_ms": round(statistics.median(lat) * 1000, 1),
                                     "p95_ms": round(pct(lat, 95) * 1000, 1), "max_ms": round(max(lat) * 1000, 1),
                                     "per_s": round(n / wall, 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", default="1,10")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner", action="store_true")
    a = ap.parse_args()
    levels = [int(x) for x in a.conc.split(",")]
    if a.inner:
        print(json.dumps(inner(levels, a.rounds)))
        return 0
    from testbed.lab import Lab
    from tests.gateway.switchlab import HUB_IP, switch_lab
    settings = {"dns": {"listen_host": HUB_IP, "port": 53},
                "runtime": {"enabled": True, "api_port": API_PORT, "memory_mb": 4096, "cpus": 8.0, "max_sandboxes": 32,
                            "host_reserve_mb": 256, "default_memory_mb": 64},
                "e2b": {"enabled": True, "port": E2B_PORT, "tenant": "bench"}}
    policy = "name: bench\ntenant: bench\napplies_to: {labels: {tenant: bench}}\ndefault: deny\nrules: []\n"
    with tempfile.TemporaryDirectory() as tmp, Lab(workdir=tmp) as lab:
        with switch_lab(lab, Path(tmp) / "sw", policy, sandbox=None, tport=TPORT, prefix="be",
                        settings_extra=settings) as (gw, _, _):
            key = (gw.state_dir / "runtime" / "api.token").read_text().strip()
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
                   "E2B_API_URL": f"http://127.0.0.1:{E2B_PORT}", "E2B_SANDBOX_URL": f"http://127.0.0.1:{E2B_PORT}",
                   "E2B_API_KEY": key, "PYTHONPATH": str(REPO)}
            r = lab.run_gw([sys.executable, str(Path(__file__).resolve()), "--inner", "--conc", a.conc,
                            "--rounds", str(a.rounds)], lab_dns=False, env=env, timeout=TIME_CAP_S + 60)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{'path@conc':<22}{'n':>4}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}{'per s':>8}")
    for k, v in res.items():
        print(f"{k:<22}{v['n']:>4}{v['p50_ms']:>10}{v['p95_ms']:>10}{v['max_ms']:>10}{v['per_s']:>8}")
    for conc in levels:
        a_, b_ = res.get(f"cubegate_api@{conc}"), res.get(f"e2b_sdk@{conc}")
        if a_ and b_:
            print(f"conc {conc}: E2B SDK p50 = {b_['p50_ms'] / a_['p50_ms']:.2f} x cubegate API p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
