"""Misbehaving "internet" servers for fault tests (run in the lab's net namespace).

    python -m tests.faults.badupstream --serve 198.18.0.40:80:hang --serve 198.18.0.41:443:reset ...

Modes (each connection gets a thread; every connection ends after LIFETIME s):
  hang     accept, read, never answer
  reset    accept, read the first bytes, answer with a TCP RST
  garbage  accept, read, answer bytes that are neither TLS nor HTTP, keep the connection open
  trickle  accept, read, answer an HTTP response head one byte per second
Prints "READY" once every listener is bound.
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import threading
import time

LIFETIME = 120.0
MAX_CONNS = 500
TRICKLE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nslow!"


def _serve_conn(conn: socket.socket, mode: str, slots: threading.BoundedSemaphore) -> None:
    deadline = time.monotonic() + LIFETIME
    try:
        conn.settimeout(2.0)
        try:
            conn.recv(65536)
        except OSError:
            pass
        if mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if mode == "garbage":
            conn.sendall(b"\x00\xffNOT-TLS-NOT-HTTP\x07" + os.urandom(64))
        sent = 0
        while time.monotonic() < deadline:
            if mode == "trickle":
                conn.sendall(TRICKLE[sent % len(TRICKLE):][:1])
                sent += 1
                time.sleep(1.0)
            else:
                try:
                    if conn.recv(65536) == b"":
                        return  # peer closed
                except socket.timeout:
                    continue
    except OSError:
        pass
    finally:
        conn.close()
        slots.release()


def _listen(addr: str, port: int, mode: str, slots: threading.BoundedSemaphore) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(128)

    def loop() -> None:
        while True:
            conn, _ = s.accept()
            if not slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=_serve_conn, args=(conn, mode, slots), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="append", required=True, help="ip:port:mode")
    args = p.parse_args(argv)
    slots = threading.BoundedSemaphore(MAX_CONNS)
    socks = []
    for spec in args.serve:
        ip, port, mode = spec.rsplit(":", 2)
        if mode not in ("hang", "reset", "garbage", "trickle"):
            raise SystemExit(f"unknown mode {mode}")
        socks.append(_listen(ip, int(port), mode, slots))
    print("READY", flush=True)
    try:
        sys.stdin.read()      # the test closes stdin (or kills us) to stop
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
