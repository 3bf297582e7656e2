"""MITM + credential injection through cubegate vs stock mitmproxy (default addons, no policy).

Same lab, same upstream, same run. Each worker opens one CONNECT tunnel and
sends keep-alive HTTPS requests through it, so the figure is the per-request
cost of interception (+ policy + injection + audit for cubegate).

    .venv/bin/python bench/bench_inject.py [--requests 400] [--seconds 20]
"""
from __future__ import annotations

import argparse
import base64
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.lab import Lab  # noqa: E402
from tests.gateway.harness import Gateway  # noqa: E402

POLICY = """\
name: bench
tenant: acme
default: deny
rules:
  - name: echo
    action: allow
    match: {hosts: [echo.allowed.test], ports: [443]}
"""
HOST = "echo.allowed.test"


def _read_response(f) -> int:
    status = int(f.readline().split()[1])
    length = 0
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    f.read(length)
    return status


def worker(port: int, auth: str | None, cafile: str, n: int, deadline: float, out: list, errors: list) -> None:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        hdr = f"Proxy-Authorization: Basic {auth}\r\n" if auth else ""
        s.sendall(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n{hdr}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        ctx = ssl.create_default_context(cafile=cafile)
        tls = ctx.wrap_socket(s, server_hostname=HOST)
        f = tls.makefile("rb")
        req = f"GET /bench HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
        for _ in range(n):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            tls.sendall(req)
            if _read_response(f) != 200:
                errors.append("status")
                continue
            out.append(time.perf_counter() - t0)
        tls.close()
    except Exception as e:  # counted, not hidden
        errors.append(repr(e))


def run(port, auth, cafile, requests, seconds, conc=4):
    lat, errors = [], []
    deadline = time.monotonic() + seconds
    # warm-up connection (leaf certificate generation is cached after it)
    worker(port, auth, cafile, 5, deadline, [], [])
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(port, auth, cafile, requests // conc, deadline, lat, errors))
               for _ in range(conc)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    lat.sort()
    pct = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")
    return {"ok": len(lat), "errors": len(errors), "rps": len(lat) / wall, "p50": pct(0.5), "p99": pct(0.99),
            "first_error": errors[0] if errors else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=20)
    args = ap.parse_args()
    with Lab() as lab:
        gw = Gateway(lab, lab.workdir / "gw", {"bench.yaml": POLICY}, sandboxes={"sb-1": {}})
        gw.cli("vault", "init")
        gw.cli("vault", "secret", "put", "acme", "k", input="bench-secret-value-123\n")
        gw.cli("vault", "binding", "add", "--id", "b", "--tenant", "acme", "--secret", "k", "--host", HOST,
               "--header", "Authorization")
        gw.start()
        mitm_dir = lab.workdir / "mitm"
        mitm_dir.mkdir()
        mport = gw.proxy_port + 5
        mitm = lab.spawn_gw([str(REPO / ".venv/bin/mitmdump"), "-q", "--listen-host", "127.0.0.1", "-p", str(mport),
                             "--set", f"confdir={mitm_dir}", "--set", f"ssl_verify_upstream_trusted_ca={lab.ca.bundle_path}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, lab_dns=True)
        try:
            for _ in range(100):
                if (mitm_dir / "mitmproxy-ca-cert.pem").exists():
                    break
                time.sleep(0.1)
            time.sleep(1.0)
            auth = base64.b64encode(f"sb-1:{gw.tokens['sb-1']}".encode()).decode()
            rows = [
                ("stock mitmproxy (mitmdump, default addons)",
                 lab.call_gw(run, mport, None, str(mitm_dir / "mitmproxy-ca-cert.pem"), args.requests, args.seconds)),
                ("cubegate MITM + inject + audit",
                 lab.call_gw(run, gw.proxy_port, auth, str(gw.ca_cert), args.requests, args.seconds)),
            ]
        finally:
            mitm.terminate()
            gw.stop()
    print("\n| scenario | ok | errors | req/s | p50 ms | p99 ms |\n|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['ok']} | {r['errors']} | {r['rps']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} |")
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    a, b = rows[0][1], rows[1][1]
    print(f"\nratio cubegate/mitmproxy: req/s {b['rps'] / a['rps']:.2f}x, p50 {b['p50'] / a['p50']:.2f}x, "
          f"p99 {b['p99'] / a['p99']:.2f}x")
    return 0 if a["ok"] and b["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
