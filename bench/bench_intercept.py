#!/usr/bin/env python3
"""What one sandbox can do to the shared gateway (issue #10 item 3), measured.

  1. gateway RSS growth while three sandbox clients download 256 MiB each through
     it (plain HTTP, curl, bodies not kept), sampled from /proc every 20 ms;
  2. another sandbox's latency (hey, small plain-HTTP requests) without and with a
     gzip bomb (1 MiB → 1 GiB decoded) being fetched in a loop on an injected flow.

Upstream: testbed/hostile.py in the lab; gateway: a real `cubegate run`.
  .venv/bin/python bench/bench_intercept.py [--mib 256] [--requests 400]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hey  # noqa: E402
from testbed.hostile import ensure_hostile  # noqa: E402
from testbed.lab import Lab  # noqa: E402
from tests.gateway.harness import Gateway  # noqa: E402

KEY = "hK9/x2Qv/sk-live-bench-7f3a9c1e"
POLICY = """\
name: bench
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [hostile.allowed.test, sink.allowed.test], ports: [443, 80]}
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def downloads(gw: Gateway, lab: Lab, n: int, mib: int) -> dict:
    size = mib << 20
    base = rss_kib(gw.proc.pid)
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(gw.proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    procs = [lab.spawn_gw(["curl", "-s", "-o", "/dev/null", "-w", "%{size_download}", "-x", gw.proxy_url("sb-1"),
                           f"http://sink.allowed.test/bytes/dl{i}?n={size}"], lab_dns=False,
                          stdout=subprocess.PIPE, text=True) for i in range(n)]
    got = [int((p.communicate(timeout=300)[0] or "0").strip() or 0) for p in procs]
    wall = time.monotonic() - t0
    stop.set()
    sampler.join()
    return {"downloads": n, "mib_each": mib, "bytes_ok": all(g == size for g in got),
            "rss_before_mib": round(base / 1024, 1), "rss_peak_mib": round(peak[0] / 1024, 1),
            "rss_growth_mib": round((peak[0] - base) / 1024, 1), "wall_s": round(wall, 2),
            "throughput_mib_s": round(n * mib / wall, 1)}


def victim_latency(gw: Gateway, lab: Lab, requests: int, bomb: bool) -> dict:
    stop = threading.Event()
    bombs = [0]

    def bomb_loop() -> None:
        while not stop.is_set():
            lab.run_gw(["curl", "-s", "-o", "/dev/null", "--max-time", "20", "--cacert", str(gw.ca_cert),
                        "-x", gw.proxy_url("sb-1"), "https://hostile.allowed.test/bomb/b?mib=1024"],
                       lab_dns=False, capture_output=True, timeout=30)
            bombs[0] += 1

    t = None
    if bomb:
        t = threading.Thread(target=bomb_loop, daemon=True)
        t.start()
        time.sleep(1.0)   # the bomb is being decoded when the victim starts
    argv = hey.argv("http://sink.allowed.test/small", requests=requests, concurrency=4,
                    proxy=gw.proxy_url("sb-2"), keepalive=True, csv=True)
    r = lab.run_gw(argv, lab_dns=False, capture_output=True, text=True, timeout=300)
    stop.set()
    if t is not None:
        t.join(40)
    res = hey.parse_csv(r.stdout, hey.sent_count(requests, 4))
    return {"bomb": bomb, "bombs_fetched": bombs[0], "requests": requests, "failed": res.failed,
            "p50_ms": round(res.p(50) * 1000, 2), "p99_ms": round(res.p(99) * 1000, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--downloads", type=int, default=3)
    ap.add_argument("--requests", type=int, default=400)
    args = ap.parse_args()
    if not shutil.which("hey"):
        print("needs hey (apt install hey)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="cg-bench-intercept-"))
    out: dict = {}
    with Lab(workdir=work / "lab") as lab:
        ensure_hostile(lab)
        gw = Gateway(lab, work / "gw", {"bench.yaml": POLICY}, sandboxes={"sb-1": {}, "sb-2": {}})
        gw.cli("vault", "init")
        gw.cli("vault", "secret", "put", "acme", "hkey", input=KEY + "\n")
        gw.cli("vault", "binding", "add", "--id", "b-hostile", "--tenant", "acme", "--secret", "hkey",
               "--host", "hostile.allowed.test", "--port", "443", "--header", "Authorization",
               "--format", "Bearer {secret}")
        gw.start()
        try:
            out["downloads"] = downloads(gw, lab, args.downloads, args.mib)
            out["victim_quiet"] = victim_latency(gw, lab, args.requests, bomb=False)
            out["victim_bomb"] = victim_latency(gw, lab, args.requests, bomb=True)
            bombs = [r for r in gw.audit_records() if r.get("reason") == "body_too_large"]
            out["bomb_refusals_audited"] = len(bombs)
        finally:
            gw.stop()
    q, b = out["victim_quiet"], out["victim_bomb"]
    out["victim_p99_ratio"] = round(b["p99_ms"] / q["p99_ms"], 2) if q["p99_ms"] else None
    print(json.dumps(out, indent=1))
    d = out["downloads"]
    print(f"\n| measure | value |\n|---|---:|\n"
          f"| gateway RSS growth, {d['downloads']} x {d['mib_each']} MiB downloads | {d['rss_growth_mib']} MiB "
          f"(before {d['rss_before_mib']}, peak {d['rss_peak_mib']}; bytes intact: {d['bytes_ok']}) |\n"
          f"| another sandbox p50 / p99, quiet | {q['p50_ms']} / {q['p99_ms']} ms |\n"
          f"| same during gzip bombs ({b['bombs_fetched']} fetched, {out['bomb_refusals_audited']} refused) | "
          f"{b['p50_ms']} / {b['p99_ms']} ms ({out['victim_p99_ratio']}x p99) |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
