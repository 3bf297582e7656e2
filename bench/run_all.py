"""Run every benchmark in sequence, each bounded in time, printing its output as it goes.

    .venv/bin/python bench/run_all.py [--quick]

bench_gateway and bench_cubevs need root (namespaces). A benchmark past its time
box gets SIGINT (so its context managers remove namespaces and processes), then
SIGKILL 20 s later. Exit status is non-zero if any benchmark failed or timed out.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRACE_S = 20.0

# (script, time box in seconds, extra args in --quick mode)
BENCHES = [
    ("bench_policy.py", 120.0, []),
    ("bench_gateway.py", 480.0, ["--requests", "200"]),
    ("bench_inject.py", 120.0, ["--requests", "200"]),
    ("bench_cubevs.py", 300.0, ["--quick"]),
    ("bench_sandbox.py", 300.0, ["--quick"]),
    ("bench_capacity.py", 420.0, ["--quick"]),
    ("soak.py", 400.0, ["--sandboxes", "100", "--duration", "30"]),
]


def run_one(script: str, limit: float, extra: list[str]) -> int:
    argv = [sys.executable, str(HERE / script), *extra]
    print(f"\n===== {script} {' '.join(extra)} (time box {limit:.0f} s) =====", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=HERE.parent, stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        print(f"!! {script} exceeded {limit:.0f} s; interrupting", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rc = 124
    print(f"===== {script}: exit {rc} in {time.monotonic() - t0:.1f} s =====", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs (see BENCHES)")
    args = ap.parse_args()
    failed = []
    for script, limit, quick_args in BENCHES:
        rc = run_one(script, limit, quick_args if args.quick else [])
        if rc != 0:
            failed.append(f"{script} (exit {rc})")
    print("\nall benchmarks ok" if not failed else "\nfailed: " + ", ".join(failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
