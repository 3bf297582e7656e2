"""Capacity under real load: browser sandboxes, one after another, until admission refuses.

One daemon (transparent gateway, cubevs switch, runtime API, vault) in a private lab; nginx
serves a page with 40 resources on three HTTPS hosts (bench/capacity_site.py; one host
intercepted with an injected credential, two passed through). Each round: create a
namespace sandbox on the `browser` template (POST /v1/sandboxes), trust the lab's CA in its
NSS database (the gateway's CA is there already), start chromium in it and leave it
running — the page loads itself `--rounds` times (the first on new connections, the rest on
the browser's kept-alive ones) and stays open, as an agent's browser would. Then the next
sandbox, until the runtime answers 429 (or --max, or --time-cap).

Measured, per sandbox: page-load times (the page's own PerformanceNavigationTiming:
navigation start → end of the load event, sent as a beacon through the gateway; read from
nginx's log), memory from the kernel (the sandbox's memory cgroup: usage and memory.stat,
after its loads and again at the end with every browser still running), host MemAvailable
before and after, and the gateway's CPU during the page loads (utime+stime over the daemon's
process tree from /proc, leaving out every process inside a sandbox cgroup).

    flock /work/bench.lock .venv/bin/python bench/bench_capacity.py [--quick] [--max N]

Settings (reported with the table): per-sandbox limits --sandbox-mb/--sandbox-cpus, the
runtime's budget --budget-mb (runtime.memory_mb) / --budget-cpus (runtime.cpus). Every sandbox
is destroyed at the end, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.capacity_site import HOSTS, INTERCEPTED, RESOURCES, Site, parse_beacons  # noqa: E402
from bench.proctree import tree_cpu_seconds, tree_pids  # noqa: E402

TPORT, API_PORT = 18284, 18283
SECRET = "sk-live-capacity-bench-5f4e3d2c1b0a"
TENANT = "bench"
CHROMIUM = ["/usr/lib/chromium/chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-dev-shm-usage", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-default-browser-check", "--user-data-dir=/tmp/chromium"]
POLICY = f"""\
name: capacity
tenant: {TENANT}
applies_to: {{labels: {{tenant: {TENANT}}}}}
default: deny
rules:
  - name: shop
    action: allow
    match: {{hosts: [{", ".join(HOSTS)}], ports: [443]}}
"""
CGROUP = Path("/sys/fs/cgroup")
MB = 1024 * 1024


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------- kernel readings

def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def sandbox_memory(sid: str) -> dict[str, float]:
    """MB from the sandbox's memory cgroup: usage (v1 usage_in_bytes / v2 memory.current),
    anon (rss), file (page cache), shmem (its tmpfs layer), peak."""
    v1 = list((CGROUP / "memory" / "cubegate").glob(f"*/{sid}"))
    if v1:
        d = v1[0]
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        kmem = d / "memory.kmem.usage_in_bytes"     # v1: kernel memory, also counted in usage
        oom = dict(line.split() for line in (d / "memory.oom_control").read_text().splitlines())
        return {"usage": int((d / "memory.usage_in_bytes").read_text()) / MB,
                "anon": int(stat["total_rss"]) / MB, "file": int(stat["total_cache"]) / MB,
                "shmem": int(stat.get("total_shmem", 0)) / MB,
                "kernel": int(kmem.read_text()) / MB if kmem.exists() else float("nan"),
                "peak": int((d / "memory.max_usage_in_bytes").read_text()) / MB, "oom_kills": int(oom.get("oom_kill", 0))}
    (d,) = list((CGROUP / "cubegate").glob(f"*/{sid}"))
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    peak = d / "memory.peak"
    events = dict(line.split() for line in (d / "memory.events").read_text().splitlines())
    return {"usage": int((d / "memory.current").read_text()) / MB, "anon": int(stat["anon"]) / MB,
            "file": int(stat["file"]) / MB, "shmem": int(stat["shmem"]) / MB,
            "kernel": (int(stat.get("kernel", 0)) or int(stat.get("slab", 0)) + int(stat.get("kernel_stack", 0))) / MB,
            "peak": int(peak.read_text()) / MB if peak.exists() else float("nan"),
            "oom_kills": int(events.get("oom_kill", 0))}


def sandbox_processes(sid: str) -> list[str]:
    """comm of every process in the sandbox's memory (v1) or unified (v2) cgroup."""
    dirs = list((CGROUP / "memory" / "cubegate").glob(f"*/{sid}")) or \
        list((CGROUP / "cubegate").glob(f"*/{sid}"))
    out = []
    for d in dirs:
        for pid in (d / "cgroup.procs").read_text().split():
            try:
                out.append(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                pass
    return out


def in_a_sandbox(pid: int) -> bool:
    try:
        return "/cubegate/" in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def gateway_rss_mb(root_pid: int) -> float:
    """VmRSS summed over the daemon's tree, sandboxes left out (shared pages count per process)."""
    total = 0
    for pid in tree_pids(root_pid, skip=in_a_sandbox):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def gateway_cpu(root_pid: int) -> float:
    """CPU seconds of the daemon's tree (control plane + data-plane workers), sandboxes left out."""
    return tree_cpu_seconds(root_pid, skip=in_a_sandbox)


# ---------------------------------------------------------------- one run

class Bench:
    def __init__(self, a, lab, gw, site: Site):
        self.a, self.lab, self.gw, self.site = a, lab, gw, site
        self.token = (gw.state_dir / "runtime" / "api.token").read_text().strip()
        self.lab_ca = base64.b64encode(Path(lab.ca.bundle_path).read_bytes()).decode()
        self.created: list[str] = []
        self.log_offset = site.log_lines(0)[1]

    def api(self, method: str, path: str, **kw):
        import httpx
        from testbed.netns import call_in_netns
        kw.setdefault("timeout", 120)
        return call_in_netns(self.lab.gw_ns, lambda: httpx.request(
            method, f"http://127.0.0.1:{API_PORT}/v1{path}", headers={"Authorization": f"Bearer {self.token}"},
            **kw), timeout=kw["timeout"] + 10)

    def exec(self, sid: str, script: str, timeout: float = 60) -> dict:
        r = self.api("POST", f"/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", script], "timeout": timeout})
        r.raise_for_status()
        out = r.json()
        if out["exit_code"] != 0:
            raise RuntimeError(f"{sid}: {script[:60]!r} → {out['exit_code']}: {(out['stderr'] or '')[-500:]}")
        return out

    def create(self, sid: str):
        return self.api("POST", "/sandboxes", json={
            "id": sid, "tenant": TENANT, "template": "browser", "files": {"lab-ca.pem": self.lab_ca},
            "limits": {"memory_mb": self.a.sandbox_mb, "cpus": self.a.sandbox_cpus, "pids": 1024, "disk_mb": 256}})

    def wait_beacons(self, sid: str, rounds: int, timeout: float, on_first=None) -> list:
        """Beacons of this sandbox's page loads; on_first() runs when the first one is seen."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(got) < rounds:
            lines, self.log_offset = self.site.log_lines(self.log_offset)
            self.lines.extend(lines)
            for b in parse_beacons(lines):
                if b.sandbox == sid:
                    if not got and on_first is not None:
                        on_first()
                    got[b.round] = b
            time.sleep(0.1)
        return [got[r] for r in sorted(got)]

    def run(self) -> dict:
        a = self.a
        self.lines: list[list[str]] = []
        root = self.gw.proc.pid
        deadline = time.monotonic() + a.time_cap
        c0 = gateway_cpu(root)
        time.sleep(3.0)
        idle_cpu_per_s = (gateway_cpu(root) - c0) / 3.0
        mem0, rss0 = mem_available_mb(), gateway_rss_mb(root)
        rows, refusal, stopped = [], None, None
        for i in range(a.max):
            if time.monotonic() > deadline:
                stopped = f"--time-cap {a.time_cap:g} s"
                break
            sid = f"cap{i:02d}-{uuid.uuid4().hex[:6]}"
            avail0 = mem_available_mb()
            t0 = time.monotonic()
            r = self.create(sid)
            create_s = time.monotonic() - t0
            if r.status_code != 201:
                refusal = {"n": i + 1, "status": r.status_code, "body": r.json() if r.content else None}
                break
            self.created.append(sid)
            self.exec(sid, "certutil -A -d sql:/workspace/.pki/nssdb -n lab-ca -t C,, -i /workspace/lab-ca.pem")
            url = f"https://www.shop.test{self.site.page}?sb={sid}&r=1&n={a.rounds}"
            cpu0, t1 = gateway_cpu(root), time.monotonic()
            # setsid -f: chromium leaves the exec's process group, so it outlives the exec (the
            # agent kills an exec's group only on timeout); it is the sandbox's resident workload
            self.exec(sid, f"setsid -f {' '.join(CHROMIUM)} '{url}' >/tmp/chromium.log 2>&1 </dev/null")
            first: list[float] = []
            beacons = self.wait_beacons(sid, a.rounds, timeout=min(120.0, max(5.0, deadline - time.monotonic())),
                                        on_first=lambda: first.append(gateway_cpu(root)))
            window_s, cpu = time.monotonic() - t1, gateway_cpu(root) - cpu0
            if len(beacons) < a.rounds:
                log = self.exec(sid, "tail -c 1500 /tmp/chromium.log; true")["stdout"]
                raise RuntimeError(f"{sid}: {len(beacons)} of {a.rounds} page loads in {window_s:.0f} s; "
                                   f"chromium: {log}")
            time.sleep(a.settle)
            rows.append({"sid": sid, "create_s": create_s, "beacons": beacons, "window_s": window_s,
                         "gw_cpu_s": cpu, "gw_cpu_first_s": first[0] - cpu0, "mem": sandbox_memory(sid),
                         "mem_available_drop": avail0 - mem_available_mb()})
            print(f"  {i + 1:>2} {sid}: create {create_s * 1000:.0f} ms, loads "
                  f"{', '.join(f'{b.load_ms:.0f}' for b in beacons)} ms, {rows[-1]['mem']['usage']:.0f} MB, "
                  f"gateway {cpu * 1000:.0f} ms CPU", flush=True)
        else:
            stopped = f"--max {a.max}"
        # the end state, every browser still running
        time.sleep(a.settle)
        final = {row["sid"]: {"mem": sandbox_memory(row["sid"]), "procs": sandbox_processes(row["sid"])}
                 for row in rows}
        lines, self.log_offset = self.site.log_lines(self.log_offset)
        self.lines.extend(lines)
        return {"rows": rows, "refusal": refusal, "stopped": stopped, "idle_cpu_per_s": idle_cpu_per_s,
                "bytes_per_load": self.site.bytes_per_load,
                "mem_available_before": mem0, "mem_available_after": mem_available_mb(), "final": final,
                "gateway_rss_before": rss0, "gateway_rss_after": gateway_rss_mb(root),
                "requests": self.requests()}

    def requests(self) -> dict:
        """Per host: requests, and how many carried the injected credential (nginx's view)."""
        out: dict[str, dict[str, int]] = {}
        for f in self.lines:
            if len(f) >= 4 and f[1] != "/beacon":
                h = out.setdefault(f[0], {"requests": 0, "injected": 0, "non_200": 0})
                h["requests"] += 1
                h["injected"] += f[3] == "injected"
                h["non_200"] += f[2] != "200"
        return out

    def cleanup(self) -> list[str]:
        left = []
        for sid in self.created:
            try:
                r = self.api("DELETE", f"/sandboxes/{sid}", timeout=60)
                if r.status_code not in (204, 404):
                    left.append(f"{sid}: {r.status_code}")
            except Exception as e:  # noqa: BLE001 - keep removing the others
                left.append(f"{sid}: {e}")
        return left


# ---------------------------------------------------------------- report

def report(a, res: dict) -> None:
    rows = res["rows"]
    print(f"\nsettings: runtime.memory_mb={a.budget_mb} runtime.cpus={a.budget_cpus:g} "
          f"runtime.host_reserve_mb={a.reserve_mb} proxy.workers={a.workers}; per sandbox memory_mb={a.sandbox_mb} "
          f"cpus={a.sandbox_cpus:g} pids=1024 disk_mb=256, template browser; {a.rounds} page loads each "
          f"({RESOURCES} resources, {res['bytes_per_load'] / 1024:.0f} KiB, on {len(HOSTS)} hosts, {INTERCEPTED} "
          "intercepted + injected)")
    if not rows:
        print("no sandbox ran")
    n = len(rows)
    alive = sum(1 for v in res["final"].values() if any("chromium" in c for c in v["procs"]))
    ref = res["refusal"]
    print(f"sandboxes running: {n} (browsers alive at the end: {alive}/{n})")
    if ref:
        msg = (ref["body"] or {}).get("message", ref["body"])
        print(f"admission refused sandbox #{ref['n']}: HTTP {ref['status']} {msg!r}")
    else:
        print(f"stopped by {res['stopped']} before admission refused")
    if not rows:
        return
    loads = [b.load_ms for r in rows for b in r["beacons"]]
    cold = [r["beacons"][0].load_ms for r in rows]
    warm = [b.load_ms for r in rows for b in r["beacons"][1:]]
    dcl = [b.dcl_ms for r in rows for b in r["beacons"]]
    incomplete = sum(1 for r in rows for b in r["beacons"] if b.ok != b.want or b.bad)
    fin = [res["final"][r["sid"]]["mem"] for r in rows]
    cpu = sum(r["gw_cpu_s"] for r in rows)
    window = sum(r["window_s"] for r in rows)
    n_loads = len(loads)
    idle = res["idle_cpu_per_s"] * window
    reqs = res["requests"]
    n_req = sum(h["requests"] for h in reqs.values())
    drop = res["mem_available_before"] - res["mem_available_after"]
    drops = [r["mem_available_drop"] for r in rows]
    cpu_first = sum(r["gw_cpu_first_s"] for r in rows)
    print()
    print("| measure | value |")
    print("|---|---:|")
    print(f"| sandboxes admitted and running (browser resident) | {n} |")
    print(f"| page loads (all {RESOURCES} resources loaded, 200) | {n_loads - incomplete} of {n_loads} |")
    print(f"| page load p50 / p95, all loads | {statistics.median(loads):.0f} / {pct(loads, 95):.0f} ms |")
    print(f"| first load (new connections) p50 / p95 | {statistics.median(cold):.0f} / {pct(cold, 95):.0f} ms |")
    if warm:
        print(f"| repeat loads (kept-alive) p50 / p95 | {statistics.median(warm):.0f} / {pct(warm, 95):.0f} ms |")
    print(f"| DOMContentLoaded p50 | {statistics.median(dcl):.0f} ms |")
    usage = [m["usage"] for m in fin]
    print(f"| memory per sandbox at the end, cgroup usage p50 (min–max) | {statistics.median(usage):.0f} "
          f"({min(usage):.0f}–{max(usage):.0f}) MB |")
    med = {k: statistics.median(m[k] for m in fin) for k in ("anon", "file", "shmem", "kernel")}
    print(f"| of which anon / page cache (its tmpfs {med['shmem']:.0f} MB included) / kernel, p50 | "
          f"{med['anon']:.0f} / {med['file']:.0f} / {med['kernel']:.0f} MB |")
    print(f"| cgroup peak p50 (max) | {statistics.median(m['peak'] for m in fin):.0f} "
          f"({max(m['peak'] for m in fin):.0f}) MB |")
    grew = res["gateway_rss_after"] - res["gateway_rss_before"]
    print(f"| gateway RSS growth (daemon tree), total / per sandbox | {grew:.0f} / {grew / n:.1f} MB |")
    print(f"| host MemAvailable drop per sandbox (its create + loads), p50 (min–max) | "
          f"{statistics.median(drops):.0f} ({min(drops):.0f}–{max(drops):.0f}) MB |")
    print(f"| host MemAvailable drop over the run, total / per sandbox (shared host: noisy) | {drop:.0f} / "
          f"{drop / n:.0f} MB |")
    print(f"| OOM kills in the sandboxes | {sum(m['oom_kills'] for m in fin)} |")
    print(f"| gateway CPU per page load (daemon tree, sandboxes excluded) | {cpu * 1000 / n_loads:.1f} ms "
          f"({(cpu - idle) * 1000 / n_loads:.1f} ms above idle) |")
    if len(loads) > n:
        print(f"| of which: browser start + first load (new connections), per sandbox | "
              f"{cpu_first * 1000 / n:.1f} ms |")
        print(f"| of which: per repeat load (kept-alive connections) | "
              f"{(cpu - cpu_first) * 1000 / (len(loads) - n):.1f} ms |")
    print(f"| gateway CPU per request ({n_req} requests) | {cpu * 1000 / max(1, n_req):.2f} ms |")
    print(f"| gateway idle CPU | {res['idle_cpu_per_s'] * 1000:.1f} ms/s |")
    print(f"| create → running p50 | {statistics.median(r['create_s'] for r in rows) * 1000:.0f} ms |")
    print("\nrequests seen by nginx, per host: " + ", ".join(
        f"{h} {v['requests']} ({v['injected']} with the injected credential, {v['non_200']} not 200)"
        for h, v in sorted(reqs.items())))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="budget for 2 sandboxes, 2 loads each")
    ap.add_argument("--max", type=int, default=12, help="sandboxes at most (stops before admission refuses)")
    ap.add_argument("--rounds", type=int, default=5, help="page loads per sandbox")
    ap.add_argument("--sandbox-mb", type=int, default=512)
    ap.add_argument("--sandbox-cpus", type=float, default=0.25)
    ap.add_argument("--budget-mb", type=int, default=3072, help="runtime.memory_mb")
    ap.add_argument("--budget-cpus", type=float, default=2.0, help="runtime.cpus")
    ap.add_argument("--reserve-mb", type=int, default=512, help="runtime.host_reserve_mb")
    ap.add_argument("--workers", type=int, default=1, help="proxy.workers")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after the loads before memory is read")
    ap.add_argument("--time-cap", type=float, default=240.0, help="seconds for the sandbox loop")
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args()
    if a.quick:
        a.budget_mb, a.rounds, a.max, a.time_cap = 2 * a.sandbox_mb, 2, min(a.max, 3), min(a.time_cap, 90.0)
    a.max = max(1, min(a.max, 64))
    from sandbox_runtime.templates import TemplateStore
    cache = Path(os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates"))
    TemplateStore(cache).resolve("browser")       # built and cached (`cubegate template build browser`)
    from testbed.lab import Lab
    from tests.sandbox_runtime.daemonlab import runtime_daemon, runtime_settings
    settings = runtime_settings(API_PORT, memory_mb=a.budget_mb, cpus=a.budget_cpus, max_sandboxes=64,
                                host_reserve_mb=a.reserve_mb, template_cache=str(cache))
    settings["proxy"] = {"workers": a.workers}

    def vault(gw) -> None:
        gw.cli("vault", "init")
        gw.cli("vault", "secret", "put", TENANT, "shop", input=SECRET + "\n")
        gw.cli("vault", "binding", "add", "--id", "b-shop", "--tenant", TENANT, "--secret", "shop",
               "--host", INTERCEPTED, "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cgcap-") as tmp, Lab(workdir=tmp) as lab:
        site = Site(lab, Path(tmp) / "site", expected_auth=f"Bearer {SECRET}").start()
        try:
            with runtime_daemon(lab, Path(tmp) / "sw", POLICY, tport=TPORT, prefix="bc", settings=settings,
                                before_start=vault) as (gw, _):
                bench = Bench(a, lab, gw, site)
                try:
                    res = bench.run()
                finally:
                    left = bench.cleanup()
                    if left:
                        print("NOT REMOVED: " + "; ".join(left), file=sys.stderr)
                leaked = SECRET in gw.log_path.read_text(errors="replace")
        finally:
            site.stop()
    report(a, res)
    print(f"secret value in the daemon's log: {'YES' if leaked else 'no'}; "
          f"wall time {time.monotonic() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(res, default=lambda o: o.__dict__, indent=1))
    return 0 if res["rows"] and not left and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
