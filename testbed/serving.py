"""What every lab upstream process shares (testbed/upstream.py, hostile.py, sse.py):
a threaded HTTP server that runs its TLS handshakes in the connection's own thread, its
TLS context, serving until SIGTERM, and starting such a process in a lab's namespace."""
from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer

HANDSHAKE_TIMEOUT = 10
READY_TIMEOUT = 10
_QUIET_ERRORS = (ConnectionError, TimeoutError, ssl.SSLError)   # a peer that hangs up is no server error


def tls_context(cert: str, key: str, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(alpn)
    return ctx


class LabServer(ThreadingHTTPServer):
    """HTTP/1 (over TLS when `tls` is given). Subclasses may log a failed handshake
    (handshake_failed) or serve another protocol the handshake chose (serve_other_protocol)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler, tls: ssl.SSLContext | None) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls_context = tls
        self.tls = tls is not None
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        # TLS handshake in the per-connection thread, not in accept():
        # a slow client must not stall everyone else.
        if self.tls_context is not None:
            request.settimeout(HANDSHAKE_TIMEOUT)
            try:
                request = self.tls_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as e:
                self.handshake_failed(client_address, e)
                return
            if self.serve_other_protocol(request):
                return
        super().finish_request(request, client_address)

    def handshake_failed(self, client_address, error: Exception) -> None:
        pass

    def serve_other_protocol(self, request: ssl.SSLSocket) -> bool:
        """True when the connection was served here (e.g. ALPN h2), not as HTTP/1."""
        return False

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], _QUIET_ERRORS):
            super().handle_error(request, client_address)


def _address(server: ThreadingHTTPServer) -> str:
    return f"{server.server_address[0]}:{server.server_address[1]}"


def serve_until_stopped(servers: list[ThreadingHTTPServer], name: str,
                        describe: Callable[[ThreadingHTTPServer], str] = _address) -> int:
    """Serve every server in its own thread, say READY, and stop on SIGTERM/SIGINT."""
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"READY {name} " + " ".join(describe(s) for s in servers), flush=True)
    while not stop.wait(0.2):
        pass
    # Serving threads are daemons: closing the listeners and returning is
    # enough, and much faster than shutdown() waiting for each poll.
    for server in servers:
        server.server_close()
    return 0


def spawn_upstream(lab, argv: list[str], name: str) -> subprocess.Popen:
    """Start an upstream process in the lab's net namespace and wait (READY_TIMEOUT at most) for its READY line."""
    popen = lab.spawn_net(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + READY_TIMEOUT
    line = ""
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if line.startswith("READY") or not line:
            break
    if not line.startswith("READY"):
        popen.kill()
        popen.wait(5)
        raise RuntimeError(f"{name} upstream did not start: {line!r}")
    threading.Thread(target=lambda: [None for _ in popen.stdout], daemon=True).start()  # keep the pipe drained
    return popen
