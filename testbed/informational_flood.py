"""A lab upstream that answers every request with a flood of 1xx heads before its 200.

    python -m testbed.informational_flood --bind 198.18.0.59 --cert c.pem --key k.pem [--count 5000]

:80 plain HTTP/1.1 and :443 TLS (ALPN h2 or http/1.1): `count` informational responses
(103 Early Hints with a Link header), then "200 OK" with a short body; a request
whose target holds "n=N" gets N of them instead. The count is bounded (a lab server, not a load loop); a gateway that passes the flood on shows every
one of them to its client, one that bounds it refuses the answer before the 200.
"""
from __future__ import annotations

import argparse
import re
import socket
import ssl
import sys
import threading

HINT = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r\n\r\n"
FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nContent-Type: text/plain\r\n\r\nfinal\n"
MAX_COUNT = 100_000


def _read_head(sock) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        d = sock.recv(65536)
        if not d:
            return None
        data += d
        if len(data) > 1 << 20:
            return None
    return data


def _count_in(target: bytes, default: int) -> int:
    m = re.search(rb"[?&]n=(\d+)", target)
    return min(int(m.group(1)), MAX_COUNT) if m else default


def serve_h1(sock, count: int) -> None:
    with sock:
        sock.settimeout(30)
        while (head := _read_head(sock)) is not None:
            for _ in range(_count_in(head.split(b"\r\n", 1)[0], count)):
                sock.sendall(HINT)
            sock.sendall(FINAL)


def serve_h2(sock, count: int) -> None:
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.settimeout(30)
    with sock:
        while True:
            data = sock.recv(65536)
            if not data:
                return
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    path = dict(ev.headers).get(b":path", b"")
                    for i in range(_count_in(path, count)):
                        conn.send_headers(ev.stream_id, [(b":status", b"103"),
                                                         (b"link", b"</style.css>; rel=preload; as=style")])
                        if i % 64 == 0:
                            sock.sendall(conn.data_to_send())
                    conn.send_headers(ev.stream_id, [(b":status", b"200"), (b"content-length", b"6")])
                    conn.send_data(ev.stream_id, b"final\n", end_stream=True)
            sock.sendall(conn.data_to_send())


def _serve_tls(listener, ctx: ssl.SSLContext, count: int) -> None:
    while True:
        raw, _ = listener.accept()
        try:
            tls = ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            continue
        target = serve_h2 if tls.selected_alpn_protocol() == "h2" else serve_h1
        threading.Thread(target=_guarded, args=(target, tls, count), daemon=True).start()


def _serve_plain(listener, count: int) -> None:
    while True:
        c, _ = listener.accept()
        threading.Thread(target=_guarded, args=(serve_h1, c, count), daemon=True).start()


def _guarded(target, sock, count: int) -> None:
    try:
        target(sock, count)
    except Exception:   # noqa: BLE001 - a gateway hanging up mid-flood is what the test wants
        pass


def _listen(ip: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(64)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--log", help="unused (ensure_in_lab passes one)")
    a = ap.parse_args(argv)
    count = max(0, min(a.count, MAX_COUNT))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(a.cert, a.key)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    plain, tls = _listen(a.bind, 80), _listen(a.bind, 443)
    threading.Thread(target=_serve_plain, args=(plain, count), daemon=True).start()
    threading.Thread(target=_serve_tls, args=(tls, ctx, count), daemon=True).start()
    print("READY", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
