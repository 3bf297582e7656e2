"""Per-connection cost of the real cubegate gateway next to tinyproxy and a direct connection.

Run (root; builds a lab, removes it at the end):

    .venv/bin/python bench/bench_gateway.py [--requests 300] [--seconds 20] [--concurrency 4]

Scenarios, each a bounded run (count and time) of new connections from a pool
of Python client threads inside the lab's gw namespace:

  direct      TLS to 198.18.0.10:443 (SNI api.allowed.test), GET /       reference
  tinyproxy   CONNECT api.allowed.test:443, then TLS + GET /             reference proxy
  cubegate    CONNECT with Proxy-Authorization, passthrough, TLS + GET / (verified against the lab CA,
              so an intercepted connection would fail, not be counted)
  cg-deny     CONNECT denied.test:443 with Proxy-Authorization -> 403

Clients are Python (GIL-bound, one process), so absolute figures include
client cost; compare the rows, not the numbers with other tools.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed.lab import Lab  # noqa: E402
from tests.gateway.harness import Gateway  # noqa: E402
from tests.gateway.rawclient import read_head  # noqa: E402

HOST = "api.allowed.test"
HOST_IP = "198.18.0.10"
DENIED = "denied.test"
TINYPROXY_PORT = 18888
IO_TIMEOUT = 5.0
WARMUP = 10

POLICY = """\
name: bench
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test], ports: [443]}
  - name: denied
    action: deny
    match: {hosts: [denied.test]}
"""

TINYPROXY_CONF = """\
Port {port}
Listen 127.0.0.1
User nobody
Group nogroup
Timeout 30
MaxClients 100
LogLevel Error
"""


# ------------------------------------------------------------------ clients (run in the gw netns)
def _status(head: bytes) -> int:
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def _https_get(sock: socket.socket, ctx: ssl.SSLContext) -> int:
    with ctx.wrap_socket(sock, server_hostname=HOST) as tls:
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        resp = http.client.HTTPResponse(tls)
        resp.begin()
        resp.read()
        return resp.status


def _connect(port: int, target: str, auth: str | None) -> tuple[socket.socket, int]:
    s = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
    extra = f"Proxy-Authorization: {auth}\r\n" if auth else ""
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n".encode())
    return s, _status(read_head(s))


def one_request(kind: str, ctx: ssl.SSLContext, port: int, auth: str | None) -> bool:
    """One new connection; True if it got the expected answer."""
    if kind == "direct":
        s = socket.create_connection((HOST_IP, 443), timeout=IO_TIMEOUT)
        try:
            return _https_get(s, ctx) == 200
        finally:
            s.close()
    if kind == "deny":
        s, code = _connect(port, f"{DENIED}:443", auth)
        s.close()
        return code == 403
    s, code = _connect(port, f"{HOST}:443", auth)
    try:
        return code == 200 and _https_get(s, ctx) == 200
    finally:
        s.close()


def run_scenario(kind: str, cafile: str, port: int, auth: str | None, requests: int,
                 seconds: float, concurrency: int) -> dict:
    """Runs inside the gw namespace; threads created here inherit it."""
    ctx = ssl.create_default_context(cafile=cafile)
    for _ in range(WARMUP):
        one_request(kind, ctx, port, auth)
    lock = threading.Lock()
    state = {"issued": 0}
    lat: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        while True:
            with lock:
                if state["issued"] >= requests or time.perf_counter() > deadline:
                    return
                state["issued"] += 1
            t0 = time.perf_counter()
            try:
                ok = one_request(kind, ctx, port, auth)
                err = None if ok else "unexpected status"
            except (OSError, ssl.SSLError, http.client.HTTPException) as e:
                err = f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            with lock:
                if err:
                    errors.append(err)
                else:
                    lat.append(dt)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    return {"ok": len(lat), "errors": len(errors), "first_error": errors[0] if errors else "",
            "wall": wall, "lat": lat, "capped": state["issued"] < requests}


# ------------------------------------------------------------------ orchestration
def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def _start_tinyproxy(lab: Lab, workdir: Path) -> subprocess.Popen:
    conf = workdir / "tinyproxy.conf"
    conf.write_text(TINYPROXY_CONF.format(port=TINYPROXY_PORT))
    log = open(workdir / "tinyproxy.log", "ab")
    proc = lab.spawn_gw([shutil.which("tinyproxy") or "tinyproxy", "-d", "-c", str(conf)],
                        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tinyproxy exited {proc.returncode}: {(workdir / 'tinyproxy.log').read_text()}")
        try:
            lab.call_gw(lambda: socket.create_connection(("127.0.0.1", TINYPROXY_PORT), timeout=1).close(),
                        timeout=5)
            return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("tinyproxy did not listen within 10 s")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per scenario")
    ap.add_argument("--seconds", type=float, default=20.0, help="time cap per scenario")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()

    t_all = time.perf_counter()
    results: dict[str, dict] = {}
    with Lab() as lab:
        print(f"lab up in {lab.startup_seconds:.1f} s (prefix {lab.prefix})", flush=True)
        gw = Gateway(lab, lab.workdir / "gw", {"bench.yaml": POLICY}, sandboxes={"sb-1": {}})
        tiny = None
        try:
            gw.start()
            tiny = _start_tinyproxy(lab, lab.workdir)
            auth = "Basic " + base64.b64encode(f"sb-1:{gw.tokens['sb-1']}".encode()).decode()
            cafile = str(lab.ca.bundle_path)
            scenarios = [
                ("direct", "direct", 0, None),
                ("tinyproxy", "connect", TINYPROXY_PORT, None),
                ("cubegate passthrough", "connect", gw.proxy_port, auth),
                ("cubegate deny (403)", "deny", gw.proxy_port, auth),
            ]
            for label, kind, port, a in scenarios:
                r = lab.call_gw(run_scenario, kind, cafile, port, a, args.requests, args.seconds,
                                args.concurrency, timeout=args.seconds + 60)
                results[label] = r
                print(f"{label:22s} ok={r['ok']} errors={r['errors']} wall={r['wall']:.2f}s"
                      + (f" first_error={r['first_error']}" if r["errors"] else "")
                      + (" (time cap hit)" if r["capped"] else ""), flush=True)
        finally:
            _stop(tiny)
            if gw.proc and gw.proc.poll() not in (None, 0):
                print("gateway log tail:\n" + gw.log(), file=sys.stderr)
            gw.stop()

    rows = {k: {"rps": v["ok"] / v["wall"] if v["wall"] else 0.0,
                "p50": _pct(v["lat"], 50) * 1000, "p99": _pct(v["lat"], 99) * 1000,
                "n": v["ok"], "err": v["errors"]} for k, v in results.items()}
    cg, tp, d = rows.get("cubegate passthrough"), rows.get("tinyproxy"), rows.get("direct")
    print(f"\n### Gateway per-connection cost (concurrency {args.concurrency}, new connection per request, "
          f"Python clients in the gw namespace)\n")
    print("| scenario | ok | errors | req/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, r in rows.items():
        print(f"| {k} | {r['n']} | {r['err']} | {r['rps']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} |")
    if cg and tp and d:
        print("\n| ratio | req/s | p50 | p99 |")
        print("|---|---:|---:|---:|")
        for name, ref in (("cubegate / tinyproxy", tp), ("cubegate / direct", d)):
            print(f"| {name} | {cg['rps'] / ref['rps']:.2f}x | {cg['p50'] / ref['p50']:.2f}x "
                  f"| {cg['p99'] / ref['p99']:.2f}x |")
    print(f"\ntotal {time.perf_counter() - t_all:.1f} s")
    bad = any(r["n"] == 0 for r in rows.values()) or len(rows) < 4
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
