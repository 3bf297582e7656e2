"""Issue #10 item 3: one sandbox cannot exhaust the shared gateway. Bodies that need no
inspection stream (bounded gateway RSS while 3 x 256 MiB go through, a client that
never reads applies backpressure, an upload streams), and a per-sandbox connection cap
refuses the 6th CONNECT with 429 while other sandboxes are unaffected.

RSS is read from /proc/<gateway pid>/status (VmRSS) by a sampler thread; when growth
passes the limit the test stops its transfers at once (a buffering gateway would
otherwise take GiBs of a shared machine). Nothing here is timed: every wait is only
a bound."""
from __future__ import annotations

import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from testbed.hostile import ensure_hostile
from tests.gateway import rawclient
from tests.gateway.harness import Gateway
from tests.gateway.hostile_env import POLICY, SINK, parse_h1

pytestmark = pytest.mark.netns

MIB = 1 << 20
SIZE = 256 * MIB
RSS_LIMIT = 64 * MIB
CAP = 5
SANDBOXES = ("sb-dl", "sb-slow", "sb-up", "sb-cap", "sb-free")


def _start_gateway(lab, workdir) -> Gateway:
    hostile = ensure_hostile(lab)
    gw = Gateway(lab, workdir, {"main.yaml": POLICY}, sandboxes={sb: {} for sb in SANDBOXES},
                 settings_extra={"proxy": {"max_connections_per_sandbox": CAP}})
    gw.start()
    gw.hostile = hostile
    return gw


@pytest.fixture(scope="module")
def xgw(lab, tmp_path_factory):
    gw = _start_gateway(lab, tmp_path_factory.mktemp("exhaust"))
    yield gw
    gw.stop()


@pytest.fixture
def fresh_gw(lab, tmp_path_factory):
    """One gateway per RSS test: memory a previous transfer left in the allocator would hide growth."""
    gw = _start_gateway(lab, tmp_path_factory.mktemp("exhaust-rss"))
    yield gw
    gw.stop()


def _gateway_pid(gw) -> int:
    """The cubegate process itself (nsenter execs it, but check rather than trust)."""
    pid = gw.proc.pid
    for _ in range(3):
        if b"cubegate.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert children, "gateway process not found"
        pid = int(children[0])
    raise AssertionError("gateway process not found")


def _rss(pid: int) -> int:
    """The daemon's and its workers' RSS (the data plane runs in the workers)."""
    from tests.faults.helpers import proc_rss_kib
    kib = proc_rss_kib(pid)
    assert kib, "no VmRSS"
    return kib * 1024


class RssWatch:
    """Samples the gateway's RSS; ``exceeded`` is set as soon as growth passes the limit."""

    def __init__(self, gw, limit: int = RSS_LIMIT):
        self.pid = _gateway_pid(gw)
        self.base = _rss(self.pid)
        self.peak = self.base
        self.limit = limit
        self.exceeded = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, _rss(self.pid))
            except (OSError, AssertionError):
                return
            if self.peak - self.base > self.limit:
                self.exceeded.set()

    @property
    def growth(self) -> int:
        return self.peak - self.base

    def __enter__(self) -> "RssWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(2)


def _proxy_sock(gw, timeout: float = 10) -> socket.socket:
    return gw.lab.call_gw(socket.create_connection, ("127.0.0.1", gw.proxy_port), timeout)


def _auth(gw, sb: str) -> str:
    return rawclient.auth_header(sb, gw.tokens[sb])


def _get_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _download(gw, sb: str, path: str, n: int, stop: threading.Event, deadline: float, out: dict) -> None:
    sock = _proxy_sock(gw)
    try:
        sock.sendall(f"GET http://{SINK}{path}?n={n} HTTP/1.1\r\nHost: {SINK}\r\n{_auth(gw, sb)}\r\n"
                     "Connection: close\r\n\r\n".encode())
        sock.settimeout(5)
        head, rest = _get_head(sock)
        out["status"] = parse_h1(head).status
        # streamed, not buffered: the first bytes arrive before the upstream has sent everything
        out["first_bytes_before_upstream_done"] = not gw.hostile.events("sent", path=path)
        count, intact = len(rest), rest.count(b"x") == len(rest)
        while count < n and not stop.is_set() and time.monotonic() < deadline:
            try:
                chunk = sock.recv(1 << 20)
            except socket.timeout:
                break
            if not chunk:
                break
            count += len(chunk)
            intact = intact and chunk.count(b"x") == len(chunk)
        out["count"], out["intact"] = count, intact
    except OSError as e:           # reset by the gateway, or our own abort
        out["error"] = repr(e)
    finally:
        sock.close()


def test_three_parallel_256mib_downloads_stream_in_bounded_memory(fresh_gw):
    xgw = fresh_gw
    results = [dict() for _ in range(3)]
    deadline = time.monotonic() + 60
    with RssWatch(xgw) as watch:
        threads = [threading.Thread(target=_download, daemon=True,
                                    args=(xgw, "sb-dl", f"/bytes/dl-{i}-{uuid.uuid4().hex[:6]}", SIZE,
                                          watch.exceeded, deadline, results[i])) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(70)
    assert watch.growth <= RSS_LIMIT, f"gateway RSS grew by {watch.growth / MIB:.0f} MiB (limit 64)"
    for r in results:
        assert r.get("status") == 200 and r.get("count") == SIZE and r.get("intact"), results
        assert r["first_bytes_before_upstream_done"], "the gateway buffered the whole download"


def test_client_that_never_reads_is_backpressured(fresh_gw):
    xgw = fresh_gw
    marker = f"/bytes/stall-{uuid.uuid4().hex[:8]}"
    sock = _proxy_sock(xgw)
    try:
        with RssWatch(xgw) as watch:
            sock.sendall(f"GET http://{SINK}{marker}?n={SIZE} HTTP/1.1\r\nHost: {SINK}\r\n"
                         f"{_auth(xgw, 'sb-slow')}\r\n\r\n".encode())
            # Wait until the upstream stops making progress (stalled by backpressure) or finishes.
            deadline, last, since = time.monotonic() + 30, None, time.monotonic()
            while time.monotonic() < deadline and not watch.exceeded.is_set():
                sent = [e["sent"] for e in xgw.hostile.events("progress", path=marker)]
                if xgw.hostile.events("sent", path=marker):
                    break
                if sent and sent[-1] != last:
                    last, since = sent[-1], time.monotonic()
                elif sent and time.monotonic() - since > 1.5:
                    break
                time.sleep(0.1)
            time.sleep(0.3)
        completed = bool(xgw.hostile.events("sent", path=marker))
    finally:
        sock.close()
    assert watch.growth <= RSS_LIMIT, f"gateway RSS grew by {watch.growth / MIB:.0f} MiB for a client that reads nothing"
    assert not completed, "the gateway read the whole 256 MiB from the upstream for a client that reads nothing"


def test_256mib_upload_streams_to_the_upstream(fresh_gw):
    xgw = fresh_gw
    marker = f"/upload-{uuid.uuid4().hex[:8]}"
    block = b"u" * MIB
    sock = _proxy_sock(xgw)
    sent, head_early = 0, False
    try:
        with RssWatch(xgw) as watch:
            sock.sendall(f"POST http://{SINK}{marker} HTTP/1.1\r\nHost: {SINK}\r\n{_auth(xgw, 'sb-up')}\r\n"
                         f"Content-Type: application/octet-stream\r\nContent-Length: {SIZE}\r\n"
                         "Connection: close\r\n\r\n".encode())
            sock.settimeout(10)
            deadline = time.monotonic() + 60
            while sent < SIZE and not watch.exceeded.is_set() and time.monotonic() < deadline:
                sock.sendall(block)
                sent += len(block)
                if sent == 32 * MIB:
                    # streamed, not buffered: the upstream has the request before the body is complete
                    t_head = time.monotonic() + 5
                    while not xgw.hostile.requests(marker) and time.monotonic() < t_head:
                        time.sleep(0.05)
                    head_early = bool(xgw.hostile.requests(marker))
            resp = parse_h1(rawclient.recv_all(sock, 10)) if sent == SIZE else None
    except OSError as e:
        resp = None
        print(f"upload stopped after {sent / MIB:.0f} MiB: {e}")
    finally:
        sock.close()
    assert watch.growth <= RSS_LIMIT, f"gateway RSS grew by {watch.growth / MIB:.0f} MiB during a 256 MiB upload"
    assert head_early, "the upstream saw nothing after 32 MiB of the upload: the gateway buffers it"
    assert resp is not None and resp.status == 200, resp
    got = xgw.hostile.requests(marker)
    assert len(got) == 1 and got[0]["body_len"] == SIZE and got[0]["body_complete"], got


def _connect(gw, sb: str, target: str = f"{SINK}:443") -> tuple[socket.socket, int, str | None]:
    s, head = gw.lab.call_gw(rawclient.connect_tunnel, gw.proxy_port, target, _auth(gw, sb))
    resp = parse_h1(head)
    return s, resp.status, resp.reason


def test_per_sandbox_connection_cap(xgw):
    held: list[socket.socket] = []
    try:
        for i in range(CAP):
            s, status, _ = _connect(xgw, "sb-cap")
            held.append(s)
            assert status == 200, f"tunnel {i + 1} of {CAP} refused ({status})"
        s, status, reason = _connect(xgw, "sb-cap")
        held.append(s)
        assert (status, reason) == (429, "sandbox_connection_limit"), (status, reason)
        rec = xgw.wait_record(lambda r: r.get("reason") == "sandbox_connection_limit"
                              and r.get("sandbox") == "sb-cap", timeout=3)
        assert rec.get("decision") == "deny"
        s, status, _ = _connect(xgw, "sb-free")
        held.append(s)
        assert status == 200, "another sandbox was refused while sb-cap is at its cap"
        held.pop(0).close()       # one of sb-cap's tunnels goes away: the next one is served
        deadline, status = time.monotonic() + 3, 0
        while time.monotonic() < deadline:
            s, status, _ = _connect(xgw, "sb-cap")
            held.append(s)
            if status == 200:
                break
            time.sleep(0.1)
        assert status == 200, "a freed slot was not given back"
    finally:
        for s in held:
            s.close()
