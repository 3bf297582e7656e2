"""Reproduce the kernel's byte loss when a spliced socket leaves the verdict map and rejoins it
under load (cubevs.splice hold/release), the reason proxy.kernel_splice stays off.

    .venv/bin/python bench/repro_splice_hold.py [--runs 3] [--mib 64]

Loopback only: client → proxy_c (spliced) proxy_u → server; 64 MiB one way, the server reading
slowly, hold/release of proxy_c every 2 ms while the sender runs.  Prints per run whether the
server received every byte intact (a run without cycles first, as the control).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cubevs.splice import Splicer  # noqa: E402


def _pair():
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        a = socket.create_connection(lst.getsockname(), timeout=10)
        b, _ = lst.accept()
    return a, b


def run(sp: Splicer, mib: int, cycle: bool) -> str:
    client, proxy_c = _pair()
    proxy_u, server = _pair()
    try:
        pair = sp.add(proxy_c.fileno(), proxy_u.fileno())
        sp.arm(pair, proxy_c, proxy_u)
        data, got = os.urandom(mib << 20), bytearray()

        def read():
            server.settimeout(5)
            try:
                while len(got) < len(data):
                    chunk = server.recv(1 << 20)
                    if not chunk:
                        return
                    got.extend(chunk)
                    time.sleep(0.0005)
            except TimeoutError:
                return

        reader = threading.Thread(target=read)
        sender = threading.Thread(target=client.sendall, args=(data,), daemon=True)
        reader.start()
        sender.start()
        cycles, deadline = 0, time.monotonic() + 60
        while cycle and sender.is_alive() and time.monotonic() < deadline:   # bounded in time
            sp.hold(pair, "a")
            time.sleep(0.002)
            sp.release(pair, "a", proxy_c)
            time.sleep(0.002)
            cycles += 1
        reader.join(70)
        n = sp.counters(pair)
        sp.remove(pair)
        return (f"cycles {cycles}: received {len(got)} of {len(data)}, intact {bytes(got) == data}, "
                f"verdict counted {n.a_to_b}")
    finally:
        for s in (client, proxy_c, proxy_u, server):
            s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    sp = Splicer()
    try:
        print("control:", run(sp, args.mib, cycle=False))
        for i in range(min(args.runs, 10)):
            print(f"run {i + 1}:", run(sp, args.mib, cycle=True), flush=True)
    finally:
        sp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
