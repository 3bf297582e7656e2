"""Deny at CONNECT: CPU per refusal of this checkout's gateway next to another checkout's, in one lab.

    flock /work/bench.lock .venv/bin/python bench/bench_deny_ab.py --against DIR [--rounds 3] [--requests 2000]

DIR is another source tree of cubegate (e.g. `git archive <commit> | tar -x -C DIR`); both
gateways run at once (workers=1, the same policy and settings as bench_gateway.py's deny row)
with squid as the reference, and each round measures squid, the other tree and this one one
after another, so the three figures of a round share the machine's load. Per figure: CPU per
refusal (utime+stime of the proxy's whole process tree from /proc, daemon included, in 10 ms
ticks), its user/sys split, and hey's req/s. Round 0 of a fresh gateway includes its first
refusals_written_per_interval (200) records written one by one; later rounds are counted only
(the refusal budget), as a flood is.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import hey  # noqa: E402
from bench.proctree import _stat_fields, tree_pids  # noqa: E402
from bench.proxies import DENIED_HOST, Cubegate, Squid  # noqa: E402
from testbed.lab import Lab  # noqa: E402


def _ticks(root: int) -> tuple[int, int]:
    user = system = 0
    for pid in tree_pids(root):
        f = _stat_fields(pid)
        if f:   # utime stime cutime cstime
            user += int(f[11]) + int(f[13])
            system += int(f[12]) + int(f[14])
    return user, system


def _round(proxy, requests: int) -> str:
    argv = hey.argv(f"https://{DENIED_HOST}/", requests=requests, concurrency=10, proxy=proxy.url,
                    keepalive=False, csv=False)
    sent = hey.sent_count(requests, 10)
    u0, s0 = _ticks(proxy.pid)
    out = proxy.lab.run_gw(argv, lab_dns=False, timeout=30 + requests * 0.1)
    time.sleep(0.6)                      # the proxy finishes closing (and the daemon indexes)
    u1, s1 = _ticks(proxy.pid)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    rps = next((line.split()[-1] for line in out.stdout.splitlines() if "Requests/sec" in line), "?")
    user, system = (u1 - u0) * tick_ms / sent, (s1 - s0) * tick_ms / sent
    return f"{user + system:.3f} ms/refusal (user {user:.3f}, sys {system:.3f}), {float(rps):,.0f} req/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="the other source tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    import tests.gateway.harness as harness   # the gateway runs from harness.REPO (its cwd)
    with Lab() as lab:
        work = Path(tempfile.mkdtemp(prefix="cgdenyab-"))
        os.chmod(work, 0o755)            # squid drops privileges and writes below it
        squid = Squid(lab, work / "squid")
        harness.REPO = args.against.resolve()
        other = Cubegate(lab, work / "other", 1, set_workers=True)
        proxies = [("squid", squid), (f"cubegate {args.against}", other)]
        try:
            other.start()
            harness.REPO = REPO
            this = Cubegate(lab, work / "this", 1, set_workers=True)
            proxies.append((f"cubegate {REPO}", this))
            this.start()
            squid.start()
            time.sleep(1.0)
            for r in range(args.rounds):
                for name, proxy in proxies:
                    print(f"round {r} {name}: {_round(proxy, args.requests)}", flush=True)
        finally:
            for _, proxy in proxies:
                proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
