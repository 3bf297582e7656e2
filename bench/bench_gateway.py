"""cubegate's data path next to squid, tinyproxy and stock mitmdump, with a native client.

Run (root; builds a lab, removes it and every process at the end, also on failure):

    .venv/bin/python bench/bench_gateway.py [--requests 1000] [--concurrency 10] [--workers 1,2]
        [--proxies squid,tinyproxy,mitmdump,cubegate] [--scenarios passthrough-new,...] [--loops uvloop,asyncio]
        [--out .cache/bench/bench_gateway]       # writes <out>.md and <out>.json
        [--profile]                              # py-spy samples of cubegate's rows (pip install py-spy)
        [--idle-conns 300]                       # memory per idle passthrough tunnel (squid, cubegate)

All in one lab and one run: `hey` (apt, Go) in the gw namespace is the client,
nginx (apt nginx-light) in the "internet" namespace is the upstream (HTTP :80,
HTTPS :443 with the lab's test CA). Each proxy is started with a temporary
config, measured on the scenarios that apply to it, then stopped:

  passthrough-new  CONNECT + TLS end to end, a new connection per request (hey -disable-keepalive)
  passthrough-ka   the same, keep-alive (tunnels reused)
  deny             CONNECT to a denied host, answered 403 (new connection each)
  plain-ka         plain HTTP through the proxy, keep-alive
  mitm-ka          intercepted TLS, keep-alive; cubegate injects a credential from its vault,
                   stock mitmdump only intercepts
  mitm-new         the same, a new connection per request

cubegate runs once per --workers value (proxy.workers); while the gateway does
not know that setting, workers=1 is its one process and other counts are n/a.

Per row: req/s; p50/p99 (hey -o csv, per request; none for refusals);
proxy CPU per request (utime+stime of the proxy's whole process tree from
/proc, before/after, divided by requests); upstream connections per request
(nginx's accepted-connection counter: tunnels and upstream dials); CPU ratio
to squid and, for interception, to stock mitmdump. Before each row one curl
through the proxy checks that the row is what it says (passthrough verified
against the lab CA, interception against the proxy's CA, the credential seen
injected by nginx, deny answered 403) and warms the path (leaf certificate).
The machine is shared: read ratios measured in the same run, not absolutes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import hey, pyspy  # noqa: E402
from bench.idle_conns import hold_idle_tunnels  # noqa: E402
from bench.nginx_upstream import NginxUpstream  # noqa: E402
from bench.proctree import tree_cpu_seconds  # noqa: E402
from bench.proxies import (DENIED_HOST, INJECTED_AUTH, MITM_HOST, PASS_HOST, PLAIN_HOST,  # noqa: E402
                           Cubegate, Mitmdump, Proxy, Squid, Tinyproxy, gateway_knows_workers)
from testbed.lab import Lab  # noqa: E402

UPSTREAM_IP = "198.18.0.30"
QUIET_POLL_S = 0.1
QUIET_MAX_S = 3.0


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    url: str
    keepalive: bool
    refused: bool = False          # the proxy must refuse every request
    intercepted: bool = False      # the proxy terminates TLS (probe trusts its CA)


SCENARIOS = [
    Scenario("passthrough-new", "passthrough (CONNECT), new connection each", f"https://{PASS_HOST}/", False),
    Scenario("passthrough-ka", "passthrough (CONNECT), keep-alive", f"https://{PASS_HOST}/", True),
    Scenario("deny", "deny at CONNECT (403)", f"https://{DENIED_HOST}/", False, refused=True),
    Scenario("plain-ka", "plain HTTP, keep-alive", f"http://{PLAIN_HOST}/", True),
    Scenario("mitm-ka", "MITM (+ credential injection for cubegate), keep-alive", f"https://{MITM_HOST}/",
             True, intercepted=True),
    Scenario("mitm-new", "MITM (+ credential injection for cubegate), new connection each",
             f"https://{MITM_HOST}/", False, intercepted=True),
]
BY_KEY = {s.key: s for s in SCENARIOS}
PROXY_ORDER = ["squid", "tinyproxy", "mitmdump", "cubegate"]


@dataclass
class Row:
    scenario: str
    proxy: str
    workers: str = ""              # "" for references; "1", "2", ...
    loop: str = ""                 # cubegate's proxy.event_loop ("" for references / the default)
    status: str = "ok"             # ok | failed | n/a
    note: str = ""
    sent: int = 0
    answered: int = 0
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_ms_per_req: float | None = None
    cpu_s: float | None = None
    upstream_conns: int | None = None
    upstream_conns_per_req: float | None = None
    client_conns: int | None = None    # client connections the proxy saw (its log): hey's dials, cancelled ones too
    upstream_requests: int | None = None
    injected: int | None = None
    errors: dict[str, int] = field(default_factory=dict)
    vs_squid_cpu: float | None = None
    vs_mitmdump_cpu: float | None = None


# ------------------------------------------------------------------ one row
def probe(lab, proxy: Proxy, sc: Scenario) -> str | None:
    """One curl through the proxy; None if the path is what the row claims, else why not."""
    argv = ["-x", proxy.url, "-o", "/dev/null", "-w", "%{http_code} %{http_connect}"]
    ca = proxy.mitm_ca if sc.intercepted else lab.ca.bundle_path
    if sc.url.startswith("https://"):
        argv += ["--cacert", str(ca)]
    r = lab.curl(*argv, sc.url, cacert=False, lab_dns=False)
    want = "000 403" if sc.refused else ("200 000" if sc.url.startswith("http://") else "200 200")
    got = r.stdout.strip()
    return None if got == want else f"probe: curl got '{got}' (want '{want}'): {r.stderr.strip()[:200]}"


def wait_quiet(pid: int) -> float:
    """Wait until the proxy stops burning CPU (closing connections, audit), at most QUIET_MAX_S."""
    last, deadline = tree_cpu_seconds(pid), time.monotonic() + QUIET_MAX_S
    still = 0
    while time.monotonic() < deadline and still < 2:
        time.sleep(QUIET_POLL_S)
        now = tree_cpu_seconds(pid)
        still = still + 1 if now == last else 0
        last = now
    return last


def measure(lab, upstream: NginxUpstream, proxy: Proxy, sc: Scenario, requests: int,
            concurrency: int, profile_to: Path | None = None) -> Row:
    row = Row(sc.key, proxy.name, str(proxy.workers) if proxy.workers else "", getattr(proxy, "event_loop", None) or "")
    why = probe(lab, proxy, sc)
    if why:
        row.status, row.note = "failed", why
        return row
    sent = hey.sent_count(requests, concurrency)
    argv = hey.argv(sc.url, requests=requests, concurrency=concurrency, proxy=proxy.url,
                    keepalive=sc.keepalive, csv=not sc.refused)
    accepted0, offset0 = upstream.accepted(), upstream.log_offset()
    clients0 = proxy.client_connections()
    sampler = pyspy.Recorder(proxy.pid, profile_to) if profile_to else nullcontext()
    with sampler:
        cpu0 = tree_cpu_seconds(proxy.pid)
        try:
            out = lab.run_gw(argv, lab_dns=False, timeout=30 + requests * 0.1)
        except subprocess.TimeoutExpired:
            row.status, row.note = "failed", "hey timed out"
            return row
        cpu1 = wait_quiet(proxy.pid)
    if profile_to:
        row.note = "profiled with py-spy (it shares the 2 cores)"
    conns = upstream.accepted() - accepted0
    clients1 = proxy.client_connections()
    if clients0 is not None and clients1 is not None:
        row.client_conns = clients1 - clients0
        counts = getattr(proxy, "last_counts", None)
        if counts:
            print(f"    (cubegate's connection counts so far: {counts})", flush=True)
    lines = upstream.log_lines(offset0)
    if out.returncode != 0:
        row.status, row.note = "failed", f"hey exit {out.returncode}: {out.stderr.strip()[:300]}"
        return row
    res = hey.parse_summary(out.stdout, sent) if sc.refused else hey.parse_csv(out.stdout, sent)
    row.sent, row.answered, row.errors = res.sent, res.answered, res.errors
    row.rps = res.rps
    p50, p99 = res.p(50), res.p(99)
    row.p50_ms = p50 * 1000 if p50 is not None else None
    row.p99_ms = p99 * 1000 if p99 is not None else None
    row.cpu_s = cpu1 - cpu0
    row.cpu_ms_per_req = row.cpu_s * 1000 / sent
    row.upstream_conns, row.upstream_conns_per_req = conns, conns / sent
    row.upstream_requests = len(lines)
    row.injected = sum(1 for l in lines if len(l) > 2 and l[2] == "injected")
    problems = check(row, sc, proxy)
    if problems:
        row.status, row.note = "failed", "; ".join([*problems, row.note] if row.note else problems)
    return row


def check(row: Row, sc: Scenario, proxy: Proxy) -> list[str]:
    """What makes the row's figures mean what its title says."""
    out = []
    if sc.refused:
        if row.answered or sum(row.errors.values()) != row.sent:
            out.append(f"{row.answered} answered, errors {row.errors}")
        if row.upstream_conns:
            out.append(f"denied host contacted {row.upstream_conns} times")
        return out
    if row.answered != row.sent:
        out.append(f"{row.sent - row.answered} of {row.sent} failed")
    if row.upstream_requests != row.sent:
        out.append(f"upstream saw {row.upstream_requests} requests, not {row.sent}")
    want_injected = row.sent if (sc.intercepted and proxy.name == "cubegate") else 0
    if row.injected != want_injected:
        out.append(f"credential injected {row.injected} times, expected {want_injected}")
    return out


# ------------------------------------------------------------------ the run
def add_ratios(rows: list[Row]) -> None:
    ref = {(r.proxy, r.scenario): r for r in rows if r.status == "ok" and not r.workers}
    for r in rows:
        if r.cpu_ms_per_req is None or r.status != "ok":
            continue
        squid = ref.get(("squid", r.scenario))
        if squid and squid.cpu_ms_per_req and r.proxy != "squid":
            r.vs_squid_cpu = r.cpu_ms_per_req / squid.cpu_ms_per_req
        mitm = ref.get(("mitmdump", r.scenario))
        if BY_KEY[r.scenario].intercepted and mitm and mitm.cpu_ms_per_req and r.proxy != "mitmdump":
            r.vs_mitmdump_cpu = r.cpu_ms_per_req / mitm.cpu_ms_per_req


def build_proxies(lab, workdir: Path, names: list[str], workers: list[int],
                  loops: list[str | None]) -> list[tuple[Proxy | None, str]]:
    """(proxy, n/a reason) in run order; a None proxy stands for n/a rows."""
    out: list[tuple[Proxy | None, str]] = []
    refs = {"squid": Squid, "tinyproxy": Tinyproxy, "mitmdump": Mitmdump}
    for name in names:
        if name in refs:
            out.append((refs[name](lab, workdir / name), ""))
            continue
        knows = gateway_knows_workers()
        for w in workers:
            if knows or w == 1:
                for lp in loops:
                    out.append((Cubegate(lab, workdir / f"cubegate-w{w}-{lp or 'default'}", w, set_workers=knows,
                                         event_loop=lp), ""))
            else:
                stub = Cubegate(lab, workdir / f"cubegate-w{w}", w, set_workers=False)
                out.append((stub, "proxy.workers is not a setting of this cubegate"))
    return out


def profile_path(args, proxy: str, workers: object, scenario: str, loop: str | None = "") -> Path | None:
    """Where py-spy's samples of one cubegate row go (--profile), else None."""
    if not args.profile or proxy != "cubegate":
        return None
    return args.out.parent / f"{args.out.name}-profile-{scenario}-w{workers}{'-' + loop if loop else ''}.raw"


def profiles(args, rows: list[Row]) -> dict[str, dict]:
    """py-spy summaries of the profiled rows, keyed "scenario workers=N"."""
    out = {}
    for r in rows:
        path = profile_path(args, r.proxy, r.workers, r.scenario, r.loop)
        if path and path.exists():
            out[f"{r.scenario} workers={r.workers}{' loop=' + r.loop if r.loop else ''}"] = {"raw": str(path), **pyspy.summarise(path.read_text())}
    return out


def profile_markdown(profs: dict[str, dict]) -> str:
    lines = []
    for key, p in profs.items():
        lines += ["", f"py-spy, cubegate {key}: {p['samples']} samples ({p['raw']})", "",
                  "- leaf frames by owner: " + ", ".join(f"{k} {v}%" for k, v in p["self_by_owner"][:8]),
                  "- inclusive: " + ", ".join(f"{k} {v}%" for k, v in p["inclusive"]),
                  "- top leaf functions: " + ", ".join(f"{k} {v}%" for k, v in p["self_by_function"][:8])]
    return "\n".join(lines) + ("\n" if lines else "")


def run(args) -> tuple[list[Row], dict]:
    scenarios = [BY_KEY[k] for k in args.scenarios]
    rows: list[Row] = []
    idle: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="cgbench-"))
    os.chmod(workdir, 0o755)  # squid and tinyproxy drop privileges and write their logs below it
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_before": os.getloadavg(),
            "cpus": os.cpu_count(), "gateway_knows_workers": gateway_knows_workers()}
    with Lab() as lab:
        print(f"lab up in {lab.startup_seconds:.1f} s (prefix {lab.prefix})", flush=True)
        upstream = NginxUpstream(lab, workdir / "nginx", UPSTREAM_IP,
                                 [PASS_HOST, MITM_HOST, PLAIN_HOST, DENIED_HOST], INJECTED_AUTH)
        try:
            upstream.start()
            for proxy, na in build_proxies(lab, workdir, args.proxies, args.workers, args.loops):
                applicable = [s for s in scenarios if s.key in proxy.scenarios]
                workers = str(proxy.workers) if proxy.workers else ""
                if na:
                    rows += [Row(s.key, proxy.name, workers, status="n/a", note=na) for s in applicable]
                    continue
                try:
                    t0 = time.monotonic()
                    proxy.start()
                    lp = getattr(proxy, "event_loop", None)
                    print(f"{proxy.name}{' workers=' + workers if workers else ''}{' loop=' + lp if lp else ''} up in "
                          f"{time.monotonic() - t0:.1f} s", flush=True)
                    for sc in applicable:
                        row = measure(lab, upstream, proxy, sc, args.requests, args.concurrency,
                                      profile_path(args, proxy.name, proxy.workers, sc.key,
                                                   getattr(proxy, "event_loop", None)))
                        rows.append(row)
                        print("  " + progress_line(row), flush=True)
                    if args.idle_conns and proxy.name in ("squid", "cubegate"):
                        res = hold_idle_tunnels(lab, proxy.url, PASS_HOST, str(lab.ca.bundle_path), args.idle_conns,
                                                proxy.pid, wait_quiet)
                        idle.append({"proxy": proxy.name, "workers": workers,
                                     "loop": getattr(proxy, "event_loop", None) or "", **res})
                        print(f"  idle             {proxy.name}: {res}", flush=True)
                except Exception as e:  # one proxy that will not start must not hide the others
                    lp = getattr(proxy, "event_loop", None) or ""
                    done = {r.scenario for r in rows if r.proxy == proxy.name and r.workers == workers
                            and r.loop == lp}
                    rows += [Row(s.key, proxy.name, workers, lp, status="failed", note=f"{type(e).__name__}: {e}"[:300])
                             for s in applicable if s.key not in done]
                    print(f"  {proxy.name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                finally:
                    proxy.stop()
        finally:
            upstream.stop()
            subprocess.run(["rm", "-rf", str(workdir)], check=False)
    meta["loadavg_after"] = os.getloadavg()
    meta["idle"] = idle
    add_ratios(rows)
    order = {s.key: i for i, s in enumerate(SCENARIOS)}
    rows.sort(key=lambda r: (order[r.scenario], PROXY_ORDER.index(r.proxy), r.workers,
                             args.loops.index(r.loop or None) if (r.loop or None) in args.loops else 0))
    return rows, meta


# ------------------------------------------------------------------ output
def _f(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def progress_line(r: Row) -> str:
    head = f"{r.scenario:16s} {r.proxy}{' w=' + r.workers if r.workers else ''}{' ' + r.loop if r.loop else ''}: {r.status}"
    if r.rps is None:
        return f"{head} {r.note}"
    return (f"{head} {r.rps:,.0f} req/s p50 {_f(r.p50_ms, '.2f')} ms cpu {_f(r.cpu_ms_per_req, '.3f')} ms/req "
            f"upstream conns {r.upstream_conns} client conns {r.client_conns}{' — ' + r.note if r.note else ''}")


def markdown(rows: list[Row], meta: dict, args) -> str:
    lines = [f"### cubegate data path vs references (hey c={args.concurrency}, {args.requests} requests per row)",
             "", "| scenario | proxy | workers | loop | req/s | p50 ms | p99 ms | proxy CPU ms/req | upstream conns/req "
             "| tunnels per client conn | CPU vs squid | CPU vs mitmdump | status |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        status = r.status + (f": {r.note}" if r.note else "")
        lines.append(f"| {BY_KEY[r.scenario].title} | {r.proxy} | {r.workers or '–'} | {r.loop or '–'} "
                     f"| {_f(r.rps, ',.0f')} "
                     f"| {_f(r.p50_ms, '.2f')} | {_f(r.p99_ms, '.2f')} | {_f(r.cpu_ms_per_req, '.3f')} "
                     f"| {_f(r.upstream_conns_per_req, '.3f')} | {_f(tunnels_per_client(r, args.concurrency), '.2f')} "
                     f"| {_f(r.vs_squid_cpu, '.2f')}"
                     f"{'x' if r.vs_squid_cpu is not None else ''} | {_f(r.vs_mitmdump_cpu, '.2f')}"
                     f"{'x' if r.vs_mitmdump_cpu is not None else ''} | {status} |")
    lines += ["", f"{meta['cpus']} CPUs, load average {meta['loadavg_before'][0]:.2f} before, "
              f"{meta['loadavg_after'][0]:.2f} after (shared machine: compare rows of one run). "
              f"CPU from /proc in 10 ms ticks; p50/p99 from hey -o csv (0.1 ms resolution). "
              f"Tunnels per client conn (keep-alive rows): connections the client opened through the proxy "
              f"per hey connection (c), from the proxy's own log (squid: access.log CONNECT lines; cubegate: "
              f"connection_closed records and closing decision records (extra.closed) of connections that "
              f"sent a CONNECT), so dials the client cancels "
              f"count too; upstream conns/req is what reached nginx."]
    if not meta["gateway_knows_workers"]:
        lines.append("cubegate has no proxy.workers setting yet: workers=1 is its one process, "
                     "other worker counts are n/a.")
    if meta.get("idle"):
        lines += ["", f"Idle connections (passthrough tunnels held open after one keep-alive request each; "
                      f"growth of the proxy tree's RSS):", "",
                  "| proxy | workers | loop | tunnels held | RSS before MiB | RSS after MiB | KiB per idle tunnel |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for i in meta["idle"]:
            lines.append(f"| {i['proxy']} | {i['workers'] or '–'} | {i['loop'] or '–'} | {i['held']} "
                         f"| {i['rss_before_kib'] / 1024:.1f} | {i['rss_after_kib'] / 1024:.1f} "
                         f"| {_f(i['kib_per_conn'], '.1f')}{' (' + i['error'] + ')' if i.get('error') else ''} |")
    lines += ["", "Targets (issue #11):", ""] + [f"- {t}" for t in targets(rows, args.concurrency, meta.get("idle"))]
    return "\n".join(lines) + "\n"


def tunnels_per_client(r: Row, concurrency: int) -> float | None:
    """Keep-alive rows: tunnels the client opened through the proxy (the proxy's own count, so a Go
    dial that was cancelled before reaching the upstream counts too; else upstream connections)
    per client connection (hey's c); None otherwise."""
    if not BY_KEY[r.scenario].keepalive or r.status != "ok":
        return None
    n = r.client_conns if r.client_conns is not None else r.upstream_conns
    return None if n is None else n / concurrency


def targets(rows: list[Row], concurrency: int, idle: list[dict] | None = None) -> list[str]:
    def get(proxy: str, scenario: str, workers: str = "1") -> Row | None:
        for r in rows:
            if r.proxy == proxy and r.scenario == scenario and r.status == "ok" and \
                    (proxy != "cubegate" or r.workers == workers):
                return r
        return None

    def line(text: str, value: float | None, ok) -> str:
        if value is None:
            return f"{text}: n/a"
        return f"{text}: {value:,.2f} — {'met' if ok(value) else 'missed'}"

    out = []
    r = get("cubegate", "passthrough-new")
    out.append(line("passthrough, new connection: CPU/request vs squid ≤ 1.0x", r and r.vs_squid_cpu,
                    lambda v: v <= 1.0))
    r = get("cubegate", "deny")
    out.append(line("deny at CONNECT ≥ 5,000 req/s (workers=1)", r and r.rps, lambda v: v >= 5000))
    r = get("cubegate", "plain-ka")
    out.append(line("plain HTTP keep-alive: CPU/request vs squid ≤ 2x", r and r.vs_squid_cpu, lambda v: v <= 2.0))
    r = get("cubegate", "mitm-ka")
    out.append(line("MITM + injection keep-alive: CPU/request vs stock mitmdump ≤ 0.7x",
                    r and r.vs_mitmdump_cpu, lambda v: v <= 0.7))
    w1, w2 = get("cubegate", "passthrough-new", "1"), get("cubegate", "passthrough-new", "2")
    out.append(line("workers=2 / workers=1 passthrough req/s ≥ 1.7x",
                    (w2.rps / w1.rps) if (w1 and w2 and w1.rps and w2.rps) else None, lambda v: v >= 1.7))
    r = get("cubegate", "passthrough-ka")
    out.append(line(f"keep-alive passthrough: tunnels per client connection (c={concurrency}) ≤ 1.5",
                    r and tunnels_per_client(r, concurrency),
                    lambda v: v <= 1.5))
    ours = [i for i in idle or () if i["proxy"] == "cubegate" and i["workers"] == "1" and not i.get("error")]
    out.append(line("idle connection (passthrough tunnel) ≤ 20 KiB", ours[0]["kib_per_conn"] if ours else None,
                    lambda v: v <= 20))
    return out


def _interrupt(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so the lab and every proxy are removed."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per row (default 1000)")
    ap.add_argument("--concurrency", type=int, default=10, help="hey -c (default 10)")
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                    help="cubegate proxy.workers values, comma-separated (default 1,2)")
    ap.add_argument("--idle-conns", type=int, default=0,
                    help="also hold this many idle passthrough tunnels through squid and cubegate and report "
                         "the memory each costs (default 0: off; below cubegate's max_connections_per_sandbox, "
                         "256 by default: one sandbox holds them all)")
    ap.add_argument("--loops", type=lambda s: [x or None for x in s.split(",")], default=[None],
                    help="cubegate proxy.event_loop values, comma-separated (uvloop,asyncio; default: the "
                         "gateway's default); targets are read from the first")
    ap.add_argument("--proxies", type=lambda s: s.split(","), default=PROXY_ORDER,
                    help="comma-separated subset of " + ",".join(PROXY_ORDER))
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=[s.key for s in SCENARIOS],
                    help="comma-separated subset of " + ",".join(BY_KEY))
    ap.add_argument("--profile", action="store_true",
                    help="sample cubegate with py-spy during its rows (pip install py-spy; skews the CPU figures)")
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "bench" / "bench_gateway",
                    help="writes OUT.md and OUT.json")
    args = ap.parse_args(argv)
    bad = [p for p in args.proxies if p not in PROXY_ORDER] + [s for s in args.scenarios if s not in BY_KEY] \
        + [lp for lp in args.loops if lp not in (None, "uvloop", "asyncio")]
    if args.profile and not pyspy.available():
        ap.error("--profile needs py-spy in the venv (pip install py-spy)")
    if bad or args.requests < args.concurrency or args.concurrency < 1 or min(args.workers) < 1:
        ap.error(f"bad arguments: {bad or 'requests must be >= concurrency >= 1, workers >= 1'}")
    signal.signal(signal.SIGTERM, _interrupt)

    t0 = time.monotonic()
    try:
        rows, meta = run(args)
    except KeyboardInterrupt as e:  # the lab, the proxies and the workdir are gone by now
        print(f"interrupted ({e or 'Ctrl-C'}): everything started was stopped", file=sys.stderr)
        return 130
    meta.update(command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                requests=args.requests, concurrency=args.concurrency, workers=args.workers,
                seconds=round(time.monotonic() - t0, 1), host=platform.node(),
                hey=hey.argv("URL", requests=args.requests, concurrency=args.concurrency, proxy="PROXY",
                              keepalive=True, csv=True))
    profs = profiles(args, rows)
    text = markdown(rows, meta, args) + profile_markdown(profs)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows],
                                                          "targets": targets(rows, args.concurrency,
                                                                             meta.get("idle")),
                                                          "profiles": profs}, indent=1))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')} "
          f"({meta['seconds']:.0f} s)")
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
