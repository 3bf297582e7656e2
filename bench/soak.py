"""The long soak run: N sandboxes through one real gateway, then accounting, growth and a secret sweep.

    .venv/bin/python bench/soak.py --sandboxes 500 --duration 120 [--concurrency 32] [--json out.json]
    .venv/bin/python bench/soak.py --compare-clients       # raw asyncio vs httpx client CPU per request

Same lab and harness as tests/soak (which run the short CI version). The load
generator (testbed/loadgen.py) is its own process pinned to CPU 1, the gateway
to CPU 0. Prints a results table and a JSON document; exit status 1 if any
check failed (errors, accounting, fd/RSS growth bound, secret hits).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import resource
import ssl
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.lab import Lab  # noqa: E402
from tests.soak import accounting, soakkit  # noqa: E402

FD_SLACK = 5
RSS_GROWTH_MB_PER_MIN = 40.0   # stated bound after warm-up


def soak(args) -> dict:
    secret = soakkit.new_secret()
    with Lab() as lab:
        spool = lab.workdir / "spool"
        t0 = time.monotonic()
        gw = soakkit.make_gateway(lab, lab.workdir / "gw", args.sandboxes, secret)
        setup_s = time.monotonic() - t0
        try:
            start = soakkit.proc_stats(gw.proc.pid)
            common = dict(max_requests=args.max_requests, concurrency=args.concurrency, secrets=[secret])
            warm = soakkit.run_load(lab, soakkit.spec_for(gw, lab, duration=args.warmup, run_tag="warm",
                                                          ip_base=1 << 16, seed=3, **common), spool)
            soakkit.settle(gw)
            warmed = soakkit.proc_stats(gw.proc.pid)
            load = soakkit.run_load(lab, soakkit.spec_for(gw, lab, duration=args.duration, run_tag="soak",
                                                          ip_base=1 << 20, seed=4, **common), spool)
            mid = soakkit.proc_stats(gw.proc.pid)    # right after the clients closed
            records = soakkit.settle(gw, quiet=2.0, timeout=60)
            end = soakkit.proc_stats(gw.proc.pid)
            conns = warm["connections"] + load["connections"]
            problems, summary = accounting.check(conns, records, inject_secret_id=soakkit.SECRET_ID)
            sweep_live = soakkit.secret_sweep(gw, [secret])
        finally:
            gw.stop()
        rc = gw.proc.returncode
        sweep_done = soakkit.secret_sweep(gw, [secret], gateway_running=False)
    rss_bound = RSS_GROWTH_MB_PER_MIN * max(1.0, args.duration / 60)
    checks = {
        "no client errors": not load["errors"] and not warm["errors"],
        "accounting exact (both ways)": not problems and summary["records"] == summary["min_expected_records"],
        f"fds back to baseline +-{FD_SLACK}": abs(end["fds"] - warmed["fds"]) <= FD_SLACK,
        f"RSS growth < {rss_bound:.0f} MB": end["rss_mb"] - warmed["rss_mb"] < rss_bound,
        "secret sweep: zero hits": not sweep_live["hits"] and not sweep_done["hits"],
        "gateway exit 0 after drain": rc == 0,
    }
    load.pop("connections")
    warm.pop("connections")
    return {"sandboxes": args.sandboxes, "duration": args.duration, "concurrency": args.concurrency,
            "setup_s": round(setup_s, 1), "load": load,
            "gateway": {"start": start, "warmed": warmed, "after_clients": mid, "end": end},
            "accounting": summary, "problems": problems[:20],
            "sweep": {k: v for k, v in sweep_live.items() if k != "blob_bytes"} | {"after_stop_hits": sweep_done["hits"]},
            "checks": checks}


def print_table(r: dict) -> None:
    load, g = r["load"], r["gateway"]
    print(f"\n## cubegate soak: {r['sandboxes']} sandboxes, {r['duration']} s, {r['concurrency']} sessions in flight\n")
    print("| kind | requests | p50 ms | p99 ms |\n|---|---:|---:|---:|")
    for k, v in load["by_kind"].items():
        print(f"| {k} | {v['n']} | {v['p50_ms']} | {v['p99_ms']} |")
    print(f"| **all** | {load['requests']} | {load['p50_ms']} | {load['p99_ms']} |")
    print(f"\n{load['sandboxes_active']} sandboxes made traffic; requests/s {load['rps']} over {load['wall_s']} s; errors {load['errors'] or 'none'}; "
          f"client CPU {load['client_cpu_s']} s ({1000 * load['client_cpu_s'] / max(1, load['requests']):.2f} ms/req)")
    print("\n| gateway | RSS MB | open fds | CPU s (cumulative) |\n|---|---:|---:|---:|")
    for k in ("start", "warmed", "after_clients", "end"):
        print(f"| {k} | {g[k]['rss_mb']} | {g[k]['fds']} | {g[k]['cpu_s']} |")
    gw_cpu = g["after_clients"]["cpu_s"] - g["warmed"]["cpu_s"]
    print(f"\ngateway CPU {1000 * gw_cpu / max(1, load['requests']):.2f} ms/req vs client "
          f"{1000 * load['client_cpu_s'] / max(1, load['requests']):.2f} ms/req (the client is not the bottleneck)")
    a = r["accounting"]
    print(f"\naudit: {a['records']} records for {a['connections']} connections, expected exactly "
          f"{a['min_expected_records']}; problems: {len(r['problems'])}")
    s = r["sweep"]
    print(f"secret sweep: {s['files']} files + {len(s['blobs'])} outputs ({', '.join(s['blobs'])}), "
          f"{s['patterns']} encodings, core files {len(s['core_files'])}, hits {len(s['hits']) + len(s['after_stop_hits'])}")
    print("\n| check | held |\n|---|---|")
    for k, ok in r["checks"].items():
        print(f"| {k} | {'yes' if ok else '**NO**'} |")


# --------------------------------------------------------------- client cost
def _client_cost(kind: str, port: int, sb: str, token: str, cafile: str, n: int, conc: int) -> dict:
    """Client CPU (this thread only) for n keep-alive HTTPS requests through the gateway."""
    host = "api.allowed.test"

    async def raw_worker(k):
        from testbed.loadgen import _read_response
        r, w = await asyncio.open_connection("127.0.0.1", port)
        auth = base64.b64encode(f"{sb}:{token}".encode()).decode()
        w.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
        await _read_response(r)
        await w.start_tls(ssl.create_default_context(cafile=cafile), server_hostname=host)
        for i in range(k):
            w.write(f"GET /soak/cc/{i} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            await _read_response(r)
        w.close()

    async def httpx_worker(k):
        import httpx
        async with httpx.AsyncClient(proxy=f"http://{sb}:{token}@127.0.0.1:{port}",
                                     verify=ssl.create_default_context(cafile=cafile)) as c:
            for i in range(k):
                (await c.get(f"https://{host}/soak/cc/{i}")).raise_for_status()

    async def main():
        worker = raw_worker if kind == "raw" else httpx_worker
        await asyncio.gather(*[worker(n // conc) for _ in range(conc)])

    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"client": kind, "requests": n, "cpu_ms_per_req": round(1000 * cpu / n, 3), "rps": round(n / wall, 1)}


def compare_clients(n: int = 400, conc: int = 8) -> list[dict]:
    with Lab() as lab:
        gw = soakkit.make_gateway(lab, lab.workdir / "gw", 1, soakkit.new_secret())
        try:
            tok = gw.tokens["sb-0000"]
            out = []
            for kind in ("raw", "httpx", "raw", "httpx"):   # interleaved: noise hits both
                out.append(lab.call_gw(_client_cost, kind, gw.proxy_port, "sb-0000", tok, str(gw.ca_cert), n, conc,
                                       timeout=120))
        finally:
            gw.stop()
    print("\n| client | requests | client CPU ms/req | req/s |\n|---|---:|---:|---:|")
    for r in out:
        print(f"| {r['client']} | {r['requests']} | {r['cpu_ms_per_req']} | {r['rps']} |")
    raw = sum(r["cpu_ms_per_req"] for r in out if r["client"] == "raw")
    hx = sum(r["cpu_ms_per_req"] for r in out if r["client"] == "httpx")
    print(f"\nhttpx/raw client CPU per request: {hx / raw:.2f}x")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=500)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32, help="sessions in flight at once (all sandboxes take turns)")
    ap.add_argument("--max-requests", type=int, default=1_000_000)
    ap.add_argument("--json", help="also write the JSON result here")
    ap.add_argument("--compare-clients", action="store_true")
    args = ap.parse_args()
    if args.compare_clients:
        compare_clients()
        return 0
    r = soak(args)
    print_table(r)
    doc = json.dumps(r, indent=1)
    print("\n" + doc)
    if args.json:
        Path(args.json).write_text(doc)
    return 0 if all(r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
