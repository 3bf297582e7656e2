"""cubevs benchmarks (root; namespaces created here and removed at the end).

1. Data path cost: TCP stream (fixed byte count) and small UDP datagrams from a
   sandbox to the gateway address, with the filter attached vs detached, for
   the eBPF and the nftables backends.  Sender and receiver are Python, so the
   absolute figures are Python-bound; the ratio and the per-packet delta are
   what matter.
2. Control plane: attach+detach time per sandbox at 1, 100, 1000 sandboxes.

    .venv/bin/python bench/bench_cubevs.py [--quick] [--sizes 1,100,1000]
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cubevs import datapath, libbpf, netns  # noqa: E402
from cubevs.switch import Switch  # noqa: E402

GW = "10.200.0.1"
TIME_CAP_S = 60.0


class Hub:
    def __init__(self, backend: str):
        self.tag = "cg" + secrets.token_hex(3)
        self.ns = self.tag + "h"
        self.tmp = tempfile.mkdtemp(prefix=self.tag)
        netns.create(self.ns)
        self.sw = Switch(hub_netns=self.ns, state_dir=f"{self.tmp}/state",
                         bpffs_dir=f"{self.tmp}/bpf", backend=backend,
                         netns_prefix=self.tag + "s")

    def close(self):
        with suppress(Exception):
            for sb in self.sw.sandboxes():
                self.sw.detach_sandbox(sb.sandbox_id)
        with suppress(Exception):
            self.sw.close()
        for name in os.listdir(netns.NETNS_RUN_DIR):
            if name.startswith(self.tag):
                netns.remove(name)
        if os.path.isdir(f"{self.tmp}/bpf"):
            datapath.remove_pins(f"{self.tmp}/bpf")
            libbpf.umount_bpffs(f"{self.tmp}/bpf")
        shutil.rmtree(self.tmp, ignore_errors=True)


def _sock(ns, kind):
    with netns.entered(ns):
        return socket.socket(socket.AF_INET, kind)


def tcp_stream(hub_ns, sb_ns, total: int, chunk: int = 65536) -> float:
    """Seconds to push `total` bytes sandbox -> gateway:8080 (receiver in the hub)."""
    srv = _sock(hub_ns, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((GW, 8080))
    srv.listen(1)
    got = [0]

    def sink():
        c, _ = srv.accept()
        buf = bytearray(1 << 20)
        while True:
            n = c.recv_into(buf)
            if not n:
                break
            got[0] += n
        c.close()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    cli = _sock(sb_ns, socket.SOCK_STREAM)
    cli.connect((GW, 8080))
    data = b"\0" * chunk
    t0 = time.perf_counter()
    sent = 0
    while sent < total and time.perf_counter() - t0 < TIME_CAP_S:
        cli.sendall(data)
        sent += chunk
    cli.shutdown(socket.SHUT_WR)
    t.join(TIME_CAP_S)
    dt = time.perf_counter() - t0
    cli.close()
    srv.close()
    assert got[0] == sent, (got[0], sent)
    return sent / dt


def udp_flood(hub_ns, sb_ns, count: int, size: int = 64) -> float:
    """Seconds per datagram for `count` datagrams sandbox -> gateway:53."""
    srv = _sock(hub_ns, socket.SOCK_DGRAM)
    srv.bind((GW, 53))   # bound so the hub does not answer with ICMP unreachable
    cli = _sock(sb_ns, socket.SOCK_DGRAM)
    cli.connect((GW, 53))
    payload = b"x" * size
    t0 = time.perf_counter()
    n = 0
    while n < count and time.perf_counter() - t0 < TIME_CAP_S:
        cli.send(payload)
        n += 1
    dt = time.perf_counter() - t0
    cli.close()
    srv.close()
    return dt / n


def _best(fn, reps=3):
    return [fn() for _ in range(reps)]


def datapath(backend: str, quick: bool) -> dict:
    hub = Hub(backend)
    try:
        sb = hub.sw.attach_sandbox("bench")
        e = hub.sw.registry.get("bench")
        total = (64 if quick else 512) << 20
        count = 20_000 if quick else 200_000
        res = {}
        for state in ("with", "without", "with_again"):
            if state == "without":
                hub.sw._impl.remove(e)            # filter off (map entries too)
            elif state == "with_again":
                hub.sw._impl.add(e)
            bps = max(_best(lambda: tcp_stream(hub.ns, sb.netns, total)))
            ppkt = min(_best(lambda: udp_flood(hub.ns, sb.netns, count)))
            res[state] = (bps, ppkt)
        res["counters"] = hub.sw.counters("bench")
        return res
    finally:
        hub.close()


def control_plane(backend: str, n: int) -> dict:
    hub = Hub(backend)
    try:
        t0 = time.perf_counter()
        done = 0
        for i in range(n):
            hub.sw.attach_sandbox(f"sb{i}")
            done += 1
            if time.perf_counter() - t0 > TIME_CAP_S:
                break
        t_attach = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(done):
            hub.sw.detach_sandbox(f"sb{i}")
        t_detach = time.perf_counter() - t0
        return {"requested": n, "done": done, "attach_ms": t_attach / done * 1000,
                "detach_ms": t_detach / done * 1000, "total_s": t_attach + t_detach}
    finally:
        hub.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="1,100,1000")
    ap.add_argument("--backends", default="ebpf,nftables")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    backends = args.backends.split(",")
    print(f"cubevs bench  kernel {os.uname().release}  cpus {os.cpu_count()}")
    print("\n== data path (sandbox -> gateway address through the veth) ==")
    for be in backends:
        r = datapath(be, args.quick)
        w, wo, w2 = r["with"], r["without"], r["with_again"]
        bw = min(w[0], w2[0]) if False else (w[0] + w2[0]) / 2
        pp = (w[1] + w2[1]) / 2
        print(f"[{be}] TCP stream: with {bw / 1e6:8.1f} MB/s   without {wo[0] / 1e6:8.1f} MB/s   "
              f"ratio {bw / wo[0]:.3f}")
        print(f"[{be}] UDP 64B   : with {pp * 1e9:8.0f} ns/pkt  without {wo[1] * 1e9:8.0f} ns/pkt "
              f"  delta {(pp - wo[1]) * 1e9:+6.0f} ns/pkt  ratio {pp / wo[1]:.3f}")
        dns = [v for (s, rsn, _), v in r["counters"].items() if rsn == "dns"]
        print(f"[{be}]   counted dns packets (with-filter runs): {dns[0][0] if dns else 0}")
    print("\n== control plane: attach + detach per sandbox ==")
    for be in backends:
        for n in (int(x) for x in args.sizes.split(",")):
            r = control_plane(be, n)
            note = "" if r["done"] == n else f"  (stopped at {r['done']}: {TIME_CAP_S:.0f}s cap)"
            print(f"[{be}] n={n:5d}: attach {r['attach_ms']:7.2f} ms/sandbox  "
                  f"detach {r['detach_ms']:7.2f} ms/sandbox  total {r['total_s']:6.1f}s{note}")


if __name__ == "__main__":
    main()
