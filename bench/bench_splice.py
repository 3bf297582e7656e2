"""Kernel splice (proxy.kernel_splice=auto) against the userspace relay, in one run.

Run (root; builds a lab, removes it and every process at the end, also on failure):

    flock /work/bench.lock .venv/bin/python bench/bench_splice.py [--downloads 3] [--mib 256]
        [--requests 2000] [--concurrency 10] [--modes off,auto] [--keep]

One cubegate (workers=1, fast path) per mode, nginx (apt nginx-light) in the lab's
"internet" namespace as the upstream, clients in the gw namespace:

  download   curl through the proxy (CONNECT, TLS passthrough), --mib MiB from nginx,
             --downloads times in a row: MiB/s and CPU per MiB
  ka         hey -c N keep-alive passthrough requests ("ok"): CPU per request

CPU is read from /proc before and after each row: the gateway's process tree, and
the kernel threads (kworker/*, ksoftirqd/*) — a splice moves the relay's work into
the kernel: the sockmap backlog runs on a kworker, the verdict in softirq (of
whichever task the packet arrived in, often the sender's: not all of it is seen
here). Also the machine's busy CPU (/proc/stat), which includes everyone's noise.
The gateway's spliced-connection counter is checked for mode auto (every relayed
connection spliced) and off (none).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from contextlib import nullcontext  # noqa: E402

from bench import hey, nginx_upstream, pyspy  # noqa: E402
from bench.nginx_upstream import NginxUpstream  # noqa: E402
from bench.proctree import _stat_fields, tree_cpu_seconds, tree_pids  # noqa: E402
from bench.proxies import CUBEGATE_POLICY, INJECTED_AUTH, PASS_HOST  # noqa: E402
from testbed.lab import Lab  # noqa: E402
from tests.gateway.harness import Gateway  # noqa: E402

UPSTREAM_IP = "198.18.0.30"
_TICK = os.sysconf("SC_CLK_TCK")


class BigNginx(NginxUpstream):
    """The bench's nginx with one more location: /big, a file of `mib` MiB (sendfile)."""

    def __init__(self, *a, mib: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.mib = mib

    def start(self) -> "BigNginx":
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "big.bin", "wb") as f:
            block = os.urandom(1024 * 1024)
            for _ in range(self.mib):
                f.write(block)
        saved = nginx_upstream.CONF
        nginx_upstream.CONF = saved.replace(
            "location / {{", "location = /big {{ alias {dir}/big.bin; default_type application/octet-stream; }}\n"
                             "        location / {{", 1)
        try:
            return super().start()
        finally:
            nginx_upstream.CONF = saved


def kthread_cpu_seconds() -> float:
    ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = open(f"/proc/{name}/stat", "rb").read().decode(errors="replace")
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        if comm.startswith(("kworker", "ksoftirqd")):
            f = raw[raw.rindex(")") + 2:].split()
            ticks += int(f[11]) + int(f[12])
    return ticks / _TICK


def tree_sys_seconds(root: int) -> float:
    """stime (+cstime) of the tree: kernel work done in the gateway's own context."""
    ticks = 0
    for pid in tree_pids(root):
        f = _stat_fields(pid)
        if f:
            ticks += int(f[12]) + int(f[14])
    return ticks / _TICK


def busy_cpu_seconds() -> float:
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]
    return (sum(f[:8]) - idle) / _TICK


class Meter:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> "Meter":
        time.sleep(0.3)
        self.g0, self.s0, self.k0, self.b0, self.t0 = (tree_cpu_seconds(self.pid), tree_sys_seconds(self.pid),
                                                       kthread_cpu_seconds(), busy_cpu_seconds(), time.monotonic())
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.monotonic() - self.t0
        time.sleep(0.3)      # closing connections, audit
        self.gw = tree_cpu_seconds(self.pid) - self.g0
        self.sys = tree_sys_seconds(self.pid) - self.s0
        self.kt = kthread_cpu_seconds() - self.k0
        self.busy = busy_cpu_seconds() - self.b0


def outcome_count(gw: Gateway, outcome: str) -> float:
    _, body = gw.ops_status("/metrics")
    m = re.search(r'^cubegate_fast_path_connections_total\{outcome="%s"\} (\S+)$' % outcome, body, re.M)
    return float(m.group(1)) if m else 0.0


def spliced_count(gw: Gateway) -> tuple[float, float]:
    """(tunnels spliced, tunnels relayed) so far."""
    return outcome_count(gw, "spliced"), outcome_count(gw, "relayed")


def _delta(gw: Gateway, before: tuple[float, float]) -> str:
    now = spliced_count(gw)
    return f"{now[0] - before[0]:.0f}/{now[1] - before[1]:.0f}"


def download_row(lab, gw: Gateway, mode: str, downloads: int, mib: int) -> dict:
    argv = ["-s", "-x", gw.proxy_url("sb-1"), "--cacert", str(lab.ca.bundle_path), "-o", "/dev/null",
            "-w", "%{http_code} %{size_download}\n"]
    s0 = spliced_count(gw)
    with Meter(gw.proc.pid) as m:
        for _ in range(downloads):
            r = lab.curl(*argv, f"https://{PASS_HOST}/big", cacert=False, lab_dns=False, timeout=120)
            code, size = r.stdout.split()
            assert code == "200" and int(size) == mib * 1024 * 1024, (r.stdout, r.stderr[-300:])
    total = downloads * mib
    return {"row": "download", "mode": mode, "units": f"{total} MiB", "MiB/s": total / m.wall,
            "gw_ms": m.gw * 1000 / total, "gw_sys_ms": m.sys * 1000 / total, "kthreads_ms": m.kt * 1000 / total, "busy_ms": m.busy * 1000 / total,
            "per": "MiB", "spliced": _delta(gw, s0)}


def ka_row(lab, gw: Gateway, mode: str, requests: int, concurrency: int, profile_to: Path | None = None) -> dict:
    sent = hey.sent_count(requests, concurrency)
    argv = hey.argv(f"https://{PASS_HOST}/", requests=requests, concurrency=concurrency,
                    proxy=gw.proxy_url("sb-1"), keepalive=True, csv=True)
    s0 = spliced_count(gw)
    with (pyspy.Recorder(gw.proc.pid, profile_to) if profile_to else nullcontext()), Meter(gw.proc.pid) as m:
        out = lab.run_gw(argv, lab_dns=False, timeout=30 + requests * 0.1)
    assert out.returncode == 0, out.stderr[-500:]
    res = hey.parse_csv(out.stdout, sent)
    assert res.failed == 0 and res.status_counts.get(200) == sent, (res.status_counts, res.errors)
    return {"row": "keep-alive", "mode": mode, "units": f"{sent} req", "req/s": res.rps,
            "gw_ms": m.gw * 1000 / sent, "gw_sys_ms": m.sys * 1000 / sent, "kthreads_ms": m.kt * 1000 / sent, "busy_ms": m.busy * 1000 / sent,
            "per": "req", "spliced": _delta(gw, s0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--downloads", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["off", "auto"])
    ap.add_argument("--keep", action="store_true", help="keep the gateways' logs and state (prints where)")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy the keep-alive rows into this directory")
    args = ap.parse_args(argv)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    assert args.requests <= 5000 and args.downloads * args.mib <= 4096, "keep a bench run short"
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="cgsplice-"))
    os.chmod(workdir, 0o755)
    try:
        with Lab() as lab:
            up = BigNginx(lab, workdir / "nginx", UPSTREAM_IP, [PASS_HOST], INJECTED_AUTH, mib=args.mib)
            up.start()
            try:
                for mode in args.modes:
                    gw = Gateway(lab, workdir / f"gw-{mode}", {"bench.yaml": CUBEGATE_POLICY},
                                 sandboxes={"sb-1": {}},
                                 settings_extra={"policy_poll_seconds": 1.0,
                                                 "proxy": {"workers": 1, "kernel_splice": mode}})
                    gw.start()
                    try:
                        for measure in (lambda: download_row(lab, gw, mode, args.downloads, args.mib),
                                        lambda: ka_row(lab, gw, mode, args.requests, args.concurrency,
                                                       args.profile / f"ka-{mode}.txt" if args.profile else None)):
                            row = measure()
                            rows.append(row)
                            print(row, flush=True)
                    finally:
                        gw.stop()
            finally:
                up.stop()
    finally:
        if args.keep:
            print("kept:", *workdir.glob("gw-*/gateway.log"))
        else:
            subprocess.run(["rm", "-rf", str(workdir)], check=False)
    print()
    print("| row | kernel_splice | work | throughput | gateway CPU (of it sys) | kthreads CPU | machine busy CPU | "
          "tunnels spliced/relayed |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        tp = f"{r['MiB/s']:.0f} MiB/s" if "MiB/s" in r else f"{r['req/s']:.0f} req/s"
        print(f"| {r['row']} | {r['mode']} | {r['units']} | {tp} | {r['gw_ms']:.3f} ({r['gw_sys_ms']:.3f}) ms/{r['per']} | "
              f"{r['kthreads_ms']:.3f} ms/{r['per']} | {r['busy_ms']:.3f} ms/{r['per']} | {r['spliced']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
