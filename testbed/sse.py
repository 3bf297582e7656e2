"""A hostile, slow event-stream upstream for the lab: an LLM-style token stream that
hands the injected key back inside its events.

    python -m testbed.sse --bind 198.18.0.55 --cert c.pem --key k.pem --log /tmp/sse.jsonl

Listens on :443 (TLS, HTTP/1.1) on --bind. One route:

  GET /events/<marker>?n=20&gap=0.15&echo=5&split=8&log_lag=0
      200 text/event-stream, chunked: n events `gap` seconds apart, each written and
      flushed on its own (as an LLM API streams tokens). Event `echo` carries the key
      (whatever follows "Bearer " in Authorization: what the gateway injected) inside its
      JSON; event `split` carries it cut in two writes `gap` apart. -1: none.

Every request and every write is appended to --log as one JSON line (``event`` request |
sent | write_failed, with the marker, the event index, the part of a split event and
time.time() when the write returned), so a test can compare when an event left the
upstream with when the sandbox got it. A line is written after its write, so the sandbox
may read an event before its line exists (a loaded machine delays it at random):
`log_lag` seconds delays the last event's line on purpose, so a test proves it waits for
it. The key is logged as its SHA-256 only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from testbed.serving import LabServer, serve_until_stopped, spawn_upstream, tls_context

MAX_EVENTS = 1000
MAX_GAP = 2.0


def event_bytes(index: int, text: str) -> bytes:
    """One OpenAI-style chat.completion.chunk event."""
    chunk = {"id": "chatcmpl-lab", "object": "chat.completion.chunk", "created": 1700000000, "model": "lab",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return f"id: {index}\ndata: {json.dumps(chunk)}\n\n".encode()


def event_writes(n: int, echo: int, split: int, key: bytes) -> list[list[bytes]]:
    """Per event, the writes it is sent in (the split event: two)."""
    writes: list[list[bytes]] = []
    for i in range(n):
        text = f" token{i}"
        if i in (echo, split):
            text += " your key is " + key.decode("latin-1") + " ok"
        data = event_bytes(i, text)
        if i == split:
            cut = data.index(key) + len(key) // 2
            writes.append([data[:cut], data[cut:]])
        else:
            writes.append([data])
    writes.append([b"data: [DONE]\n\n"])
    return writes


class Log:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: str, **fields: object) -> None:
        line = json.dumps({"event": event, "t": time.time(), **fields}, sort_keys=True)
        with self._lock:
            self._f.write(line + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"

    def log_message(self, fmt: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if parts[0] != "events":
            self.send_error(404)
            return
        marker = parts[1] if len(parts) > 1 else ""
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        n = max(1, min(int(q.get("n", "20")), MAX_EVENTS))
        gap = max(0.0, min(float(q.get("gap", "0.15")), MAX_GAP))
        log_lag = max(0.0, min(float(q.get("log_lag", "0")), MAX_GAP))
        auth = self.headers.get("Authorization", "")
        key = (auth[7:] if auth.lower().startswith("bearer ") else auth).encode("latin-1", "replace")
        self.server.log.write("request", marker=marker, key_sha256=hashlib.sha256(key).hexdigest())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        writes = event_writes(n, int(q.get("echo", "5")), int(q.get("split", "8")), key)
        for index, pieces in enumerate(writes):
            if index:
                time.sleep(gap)
            for part, piece in enumerate(pieces):
                if part:
                    time.sleep(gap)
                try:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                except OSError as e:     # said in the log (a test names what cut its stream), then the usual
                    self.server.log.write("write_failed", marker=marker, index=index, part=part,
                                          error=f"{type(e).__name__}: {e}")
                    raise
                written = time.time()
                if log_lag and index == len(writes) - 1:
                    time.sleep(log_lag)
                self.server.log.write("sent", marker=marker, index=index, part=part, t=written)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True


class Server(LabServer):
    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext, log: Log) -> None:
        self.log = log
        super().__init__(address, Handler, tls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cubegate lab: slow event-stream upstream")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--https-port", type=int, default=443)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)
    server = Server((args.bind, args.https_port), tls_context(args.cert, args.key, ["http/1.1"]), Log(args.log))
    return serve_until_stopped([server], "sse")


# ------------------------------------------------------------------------- lab wiring
class SseUpstream:
    """The event-stream upstream running in a lab's net namespace, and its log."""

    def __init__(self, name: str, ip: str, log_path: Path, popen: subprocess.Popen) -> None:
        self.name, self.ip, self.log_path, self.popen = name, ip, log_path, popen

    def entries(self, marker: str) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines() if self.log_path.exists() else []:
            try:
                entry = json.loads(line)
            except ValueError:
                continue          # a line being written right now
            if entry.get("marker") == marker:
                out.append(entry)
        return out

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_sse(lab, name: str, ip: str) -> SseUpstream:
    """Start it in the lab's net namespace under `name` (lab DNS, cert from the lab CA)."""
    lab.add_host(name, ip)
    cert, key = lab.ca.issue([name], [ip], stem="sse-" + name.split(".")[0])
    log_path = Path(lab.workdir) / f"sse-{ip}.jsonl"
    argv = [sys.executable, "-m", "testbed.sse", "--bind", ip, "--cert", str(cert), "--key", str(key),
            "--log", str(log_path)]
    return SseUpstream(name, ip, log_path, spawn_upstream(lab, argv, "sse"))


if __name__ == "__main__":
    sys.exit(main())
