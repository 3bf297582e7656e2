"""Sandbox start latency and idle memory, per backend (root; a private hub namespace).

Through the real SandboxManager: admission, cubevs attach (eBPF), backend start,
agent answered. Reference in the same run: a bare `bwrap ... true` (namespace
backend: what bubblewrap alone costs) and a cold QEMU boot (microvm: what the
snapshot saves). Results as ratios to the reference.

    .venv/bin/python bench/bench_sandbox.py [--backends namespace,microvm] [--conc 1,10,50] [--quick]
        [--pool N]          keep N network slots and N parked launchers ready (runtime.pool_size);
                            each round starts with full pools (the refill between rounds is not timed)
        [--template NAME]   namespace sandboxes on a built template (cubegate template build NAME)
        [--phases]          per row, where a start's time goes (sandbox_runtime.phases): median
                            wall and thread CPU per phase
CPU ms/start: this process (all threads, the pool's refill included) + the sandboxes'
cgroups (launcher, bwrap, agent) over the round, per start — steadier than
latency on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cubevs import datapath, libbpf, netns  # noqa: E402
from cubevs.switch import Switch  # noqa: E402
from sandbox_runtime import phases  # noqa: E402
from sandbox_runtime.backend import Limits  # noqa: E402
from sandbox_runtime.capacity import Budget, meminfo_mb  # noqa: E402
from sandbox_runtime.manager import CreateRequest, SandboxManager  # noqa: E402
from sandbox_runtime.state import StateStore  # noqa: E402

TIME_CAP_S = 240.0


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def bare_bwrap_ms(n: int = 10) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
                        "--dev", "/dev", "true"], check=True)
        out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


class Env:
    def __init__(self, backends: list[str], pool_size: int = 0, template: str | None = None):
        self.tag = "cb" + secrets.token_hex(3)
        self.hub = self.tag + "h"
        self.tmp = Path(tempfile.mkdtemp(prefix=self.tag))
        netns.create(self.hub)
        self.sw = Switch(hub_netns=self.hub, state_dir=self.tmp / "cubevs", bpffs_dir=self.tmp / "bpf",
                         netns_prefix=self.tag + "s")
        impls = {}
        for b in backends:
            if b == "namespace":
                from sandbox_runtime.namespace import NamespaceBackend
                from sandbox_runtime.templates import TemplateStore
                cache = os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates")
                impls[b] = NamespaceBackend(self.tmp / "ns", templates=TemplateStore(cache), launchers=pool_size)
            else:
                from sandbox_runtime.microvm.backend import MicrovmBackend
                from sandbox_runtime.microvm.assets import default_assets_dir
                impls[b] = MicrovmBackend(self.tmp / "vm", default_assets_dir())
        mem = meminfo_mb()["MemTotal"] - 1024
        from sandbox_runtime.netpool import SlotPool
        self.pool = SlotPool(self.sw, pool_size).start() if pool_size else None
        self.template = template
        self.mgr = SandboxManager(switch=self.sw, backends=impls, state=StateStore(self.tmp / "state.sqlite3"),
                                  pool=self.pool,
                                  # CPU budget not binding here: this measures start, not admission
                                  budget=Budget(memory_mb=mem, cpus=1000.0, max_sandboxes=1000))

    def close(self):
        if self.pool is not None:
            with suppress(Exception):
                self.pool.stop()
        for r in self.mgr.list():
            with suppress(Exception):
                self.mgr.destroy(r["id"])
        for b in self.mgr.backends.values():
            with suppress(Exception):
                getattr(b, "close", lambda: None)()     # parked launchers end, their cgroups go
        with suppress(Exception):
            self.sw.close()
        for name in os.listdir(netns.NETNS_RUN_DIR):
            if name.startswith(self.tag):
                netns.remove(name)
        if (self.tmp / "bpf").is_dir():
            with suppress(Exception):
                datapath.remove_pins(self.tmp / "bpf")
                libbpf.umount_bpffs(self.tmp / "bpf")
        shutil.rmtree(self.tmp, ignore_errors=True)


def _own_cpu_s() -> float:
    """getrusage, not os.times(): times() counts in clock ticks (10 ms), coarser than a start."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def phase_table(traces: list[dict]) -> dict[str, tuple[float, float]]:
    """{phase: (median wall ms, median thread-CPU ms)}, plus "other" (total minus the named ones)."""
    cols: dict[str, list[tuple[int, int]]] = {}
    for t in traces:
        ph = dict(t["phases"])
        tw, tc = ph.get("total", (0, 0))
        named = [v for k, v in ph.items() if k != "total" and "." not in k]   # "a.b" is inside "a"
        ph["other"] = (tw - sum(w for w, _ in named), tc - sum(c for _, c in named))
        for k, v in ph.items():
            cols.setdefault(k, []).append(v)
    return {k: (statistics.median(w for w, _ in v) / 1e6, statistics.median(c for _, c in v) / 1e6)
            for k, v in cols.items()}


def run_level(env: Env, backend: str, conc: int, rounds: int, limits: Limits, deadline: float) -> dict:
    lat, failures, mem_cg, traces, cpu_ms, cpu_split = [], 0, [], [], [], []
    phases.take()
    seq = 0
    for _ in range(rounds):
        if time.monotonic() > deadline:
            break
        ids = [f"b{backend[0]}{conc}-{seq + i}" for i in range(conc)]
        seq += conc
        avail0 = meminfo_mb()["MemAvailable"]
        if env.pool is not None:            # start each round with a full pool (bounded wait)
            until = time.monotonic() + 30
            launchers = env.mgr.backends[backend].launchers if backend == "namespace" else None
            while (env.pool.ready() < env.pool.size or (launchers and launchers.ready() < launchers.size)) \
                    and time.monotonic() < until:
                time.sleep(0.05)
        template = env.template if backend == "namespace" else None

        def one(sid):
            t0 = time.perf_counter()
            env.mgr.create(CreateRequest(sandbox_id=sid, tenant="bench", backend=backend, limits=limits,
                                         template=template))
            return (time.perf_counter() - t0) * 1000

        t0, cpu0 = time.perf_counter(), _own_cpu_s()
        with ThreadPoolExecutor(conc) as ex:
            futs = [ex.submit(one, s) for s in ids]
            for f in futs:
                try:
                    lat.append(f.result())
                except Exception as e:  # noqa: BLE001
                    failures += 1
                    print(f"  create failed: {e}", flush=True)
        wall = time.perf_counter() - t0
        own_cpu = _own_cpu_s() - cpu0
        sb_cpu = 0.0
        for s in ids:       # what each sandbox's processes spent starting (the launcher joins first)
            with suppress(Exception):
                sb_cpu += env.mgr.get(s)["usage"]["cpu_seconds"]
        cpu_ms.append((own_cpu + sb_cpu) * 1000 / max(1, conc))
        cpu_split.append((own_cpu * 1000 / max(1, conc), sb_cpu * 1000 / max(1, conc)))
        traces += phases.take()
        time.sleep(1.0)   # let them settle to idle
        for r in env.mgr.list():
            with suppress(Exception):
                mem_cg.append(env.mgr.get(r["id"])["usage"]["memory_bytes"])
        host_per_sb = (avail0 - meminfo_mb()["MemAvailable"]) / max(1, conc - failures)
        for s in ids:
            with suppress(Exception):
                env.mgr.destroy(s)
    if not lat:
        return {"backend": backend, "conc": conc, "n": 0, "failures": failures}
    return {"backend": backend, "conc": conc, "n": len(lat), "failures": failures, "phases": phase_table(traces),
            "p50": pct(lat, 50), "p95": pct(lat, 95), "p99": pct(lat, 99), "wall_s": wall,
            "starts_per_s": conc / wall if wall else float("nan"), "cpu_ms": statistics.median(cpu_ms),
            "cpu_daemon_ms": statistics.median(d for d, _ in cpu_split),
            "cpu_sandbox_ms": statistics.median(s for _, s in cpu_split),
            "mem_mb": statistics.median(mem_cg) / 2**20 if mem_cg else float("nan"), "host_mb": host_per_sb}


def print_phases(rows: list[dict]) -> None:
    print("\nphases (median per start, ms: wall / this thread's CPU)")
    for r in rows:
        ph = r.get("phases") or {}
        if not ph:
            continue
        order = sorted((k for k in ph if k not in ("total", "other")), key=lambda k: -ph[k][0])
        cells = [f"{k} {ph[k][0]:.1f}/{ph[k][1]:.1f}" for k in [*order, "other", "total"] if k in ph]
        print(f"{r['backend']:<10} c{r['conc']:<4} " + "  ".join(cells))
        print(f"{'':<10} {'':<5} CPU ms/start: daemon (all threads, refills included) {r['cpu_daemon_ms']:.1f}, "
              f"sandbox cgroups (launcher, bwrap, agent) {r['cpu_sandbox_ms']:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="namespace,microvm")
    ap.add_argument("--conc", default="1,10,50")
    ap.add_argument("--quick", action="store_true", help="namespace: 1,10,50 once; microvm: 1,10")
    ap.add_argument("--pool", type=int, default=0, help="prepared network slots (runtime.pool_size)")
    ap.add_argument("--template", default=None, help="namespace sandboxes on this built template")
    ap.add_argument("--phases", action="store_true", help="print where each row's start time goes")
    a = ap.parse_args()
    phases.enable(a.phases)
    backends = [b for b in a.backends.split(",") if b]
    env = Env(backends, a.pool, a.template)
    deadline = time.monotonic() + TIME_CAP_S
    try:
        rows = []
        for b in backends:
            ok, why = env.mgr.backends[b].available()
            if not ok:
                print(f"{b}: not available: {why}")
                continue
            ref = bare_bwrap_ms() if b == "namespace" else None
            if b == "microvm":
                ref = env.mgr.backends[b].cold_boot_ms() if hasattr(env.mgr.backends[b], "cold_boot_ms") else None
            # Real quotas: a tiny CFS quota (e.g. 0.02 CPU) would measure the throttling, not the start.
            limits = Limits(memory_mb=64, cpus=0.5, pids=64, disk_mb=16) if b == "namespace" else \
                Limits(memory_mb=256, cpus=1.0, pids=256, disk_mb=64)
            for c in (int(x) for x in a.conc.split(",")):
                if b == "microvm" and a.quick and c > 10:
                    continue
                rounds = 1 if (a.quick or c > 1) else (10 if b == "namespace" else 3)
                r = run_level(env, b, c if c > 1 else 1, rounds, limits, deadline)
                r["ref_ms"] = ref
                rows.append(r)
                print(r, flush=True)
        print(f"\npool {a.pool}, template {a.template or '-'}")
        print("backend     conc    n  fail   p50 ms   p95 ms   p99 ms  p50/ref  starts/s  CPU ms/start  idle MB (cgroup)  host MB/sandbox")
        for r in rows:
            if not r.get("n"):
                print(f"{r['backend']:<10} {r['conc']:>5} {0:>4} {r['failures']:>5}   (no sandbox started)")
                continue
            ratio = f"{r['p50'] / r['ref_ms']:.1f}x" if r.get("ref_ms") else "-"
            print(f"{r['backend']:<10} {r['conc']:>5} {r['n']:>4} {r['failures']:>5} {r['p50']:>8.1f} {r['p95']:>8.1f} "
                  f"{r['p99']:>8.1f} {ratio:>8} {r['starts_per_s']:>9.1f} {r['cpu_ms']:>13.1f} {r['mem_mb']:>17.1f} {r['host_mb']:>16.1f}")
        if a.phases:
            print_phases(rows)
        print("reference: namespace = bare `bwrap --unshare-all true` median "
              f"{next((r['ref_ms'] for r in rows if r['backend'] == 'namespace'), float('nan')):.1f} ms; "
              "microvm = cold boot of the same guest (if the backend reports it)")
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
