"""Bounded load generator for the soak tests: N sandboxes through the explicit proxy.

Raw asyncio streams (no httpx): measured 7x less client CPU per request than httpx (0.4 vs 2.9 ms),
and on a 2-core machine the client must not be the bottleneck (see
bench/soak.py --compare-clients). Run it as its own process, pinned to a
CPU apart from the gateway:

    python -m testbed.loadgen spec.json > result.json

Every connection binds its own loopback source address (127.a.b.c, unique
per run and `ip_base`), so the gateway's audit field `client` names the
connection; every request that the gateway can see (intercepted or plain
HTTP) carries a unique path /soak/<run>/<n>. That gives exact accounting:
  denied CONNECT   1 decision(deny)  + 1 connection_closed (the fast path: 1 decision with extra.closed)
  passthrough      1 decision(allow) + 1 connection_closed (inner requests opaque)
  intercept/inject 1 decision(allow) + 1 request per path + 1 connection_closed
  plain HTTP       1 request per path + 1 connection_closed
Bounded: fixed duration, max request count, per-operation timeout.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import random
import resource
import socket
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field

# kind -> (host, port, tls through CONNECT?)
KINDS = {
    "intercept": ("api.allowed.test", 443, True),     # MITM because a path rule needs the request
    "inject": ("echo.allowed.test", 443, True),       # MITM + credential injected
    "passthrough": ("passthrough.allowed.test", 443, True),
    "denied": ("denied.test", 443, True),              # 403 at CONNECT
    "plain": ("api.allowed.test", 80, False),          # absolute-form HTTP
}
DEFAULT_MIX = {"intercept": 0.25, "inject": 0.25, "passthrough": 0.2, "denied": 0.1, "plain": 0.2}
OP_TIMEOUT = 10.0


@dataclass
class Conn:
    ip: str                   # the per-connection marker (audit field client = ip:port)
    sandbox: str
    kind: str
    keepalive: bool
    paths: list[str] = field(default_factory=list)     # requests sent (marker paths)
    acked: list[str] = field(default_factory=list)     # requests with a full response
    connect_status: int | None = None
    error: str | None = None                           # kind of error, if any
    inflight_at_error: bool = False                    # a request was sent and unanswered
    t_start: float = 0.0
    t_end: float = 0.0


class Stats:
    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {k: [] for k in KINDS}
        self.errors: dict[str, int] = {}
        self.refused_retries = 0
        self.requests = 0
        self.inject_verified = 0


def _ip(n: int) -> str:
    return f"127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    body = await reader.readexactly(n) if n else b""
    return status, headers, body


class LoadGen:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.proxy = (spec.get("proxy_host", "127.0.0.1"), int(spec["proxy_port"]))
        self.sandboxes: list[tuple[str, str]] = [tuple(x) for x in spec["sandboxes"]]
        self.duration = float(spec["duration"])
        self.max_requests = int(spec["max_requests"])
        self.concurrency = int(spec.get("concurrency", 16))
        self.keepalive_requests = int(spec.get("keepalive_requests", 5))
        self.keepalive_fraction = float(spec.get("keepalive_fraction", 0.5))
        self.mix = spec.get("mix", DEFAULT_MIX)
        self.run_tag = spec.get("run_tag", "r")
        self.secrets = [s.encode() for s in spec.get("secrets", [])]
        self.retry_refused = bool(spec.get("retry_refused", True))
        self.stop_file = spec.get("stop_file")   # its appearance ends the load before `duration`
        self.rng = random.Random(spec.get("seed", 1))
        self._ips = itertools.count(int(spec.get("ip_base", 1 << 16)))
        self._paths = itertools.count(1)
        self.gw_ctx = ssl.create_default_context(cafile=spec["gateway_ca"]) if spec.get("gateway_ca") else None
        self.lab_ctx = ssl.create_default_context(cafile=spec["lab_ca"]) if spec.get("lab_ca") else None
        self.conns: list[Conn] = []
        self.stats = Stats()
        self.sent = 0

    # ----------------------------------------------------------------- helpers
    def _auth(self, sb: str, token: str) -> str:
        return "Basic " + base64.b64encode(f"{sb}:{token}".encode()).decode()

    def _err(self, conn: Conn, kind: str) -> None:
        if conn.error is None:
            conn.error = kind
            self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1

    async def _connect(self, conn: Conn) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect from the connection's own source address; retry while refused (restart gap)."""
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((conn.ip, 0))
            try:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, self.proxy), OP_TIMEOUT)
                return await asyncio.open_connection(sock=sock)
            except ConnectionRefusedError:
                sock.close()
                if not self.retry_refused or time.monotonic() > self.deadline:
                    raise
                self.stats.refused_retries += 1
                await asyncio.sleep(0.05)
            except BaseException:
                sock.close()
                raise

    # ----------------------------------------------------------------- one session
    async def session(self, sb: str, token: str, kind: str, keepalive: bool) -> None:
        host, port, tunnel = KINDS[kind]
        conn = Conn(ip=_ip(next(self._ips)), sandbox=sb, kind=kind, keepalive=keepalive, t_start=time.time())
        self.conns.append(conn)
        nreq = self.keepalive_requests if keepalive else 1
        writer = None
        try:
            reader, writer = await self._connect(conn)
            auth = self._auth(sb, token)
            if tunnel:
                t0 = time.perf_counter()
                writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                             f"Proxy-Authorization: {auth}\r\n\r\n".encode())
                status, _, _ = await asyncio.wait_for(_read_response(reader), OP_TIMEOUT)
                conn.connect_status = status
                if kind == "denied":
                    self.stats.lat[kind].append(time.perf_counter() - t0)
                    self.stats.requests += 1
                    self.sent += 1
                    if status != 403:
                        self._err(conn, f"denied_status_{status}")
                    return
                if status != 200:
                    self._err(conn, f"connect_status_{status}")
                    return
                ctx = self.lab_ctx if kind == "passthrough" else self.gw_ctx
                await asyncio.wait_for(writer.start_tls(ctx, server_hostname=host), OP_TIMEOUT)
            for _ in range(nreq):
                if time.monotonic() > self.deadline or self.sent >= self.max_requests:
                    break
                path = f"/soak/{self.run_tag}/{next(self._paths)}"
                target = path if tunnel else f"http://{host}{path}"
                extra = "" if tunnel else f"Proxy-Authorization: {auth}\r\n"
                req = (f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}"
                       f"Connection: {'keep-alive' if keepalive else 'close'}\r\n\r\n")
                conn.paths.append(path)
                self.sent += 1
                t0 = time.perf_counter()
                writer.write(req.encode())
                try:
                    status, headers, body = await asyncio.wait_for(_read_response(reader), OP_TIMEOUT)
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    conn.inflight_at_error = True
                    self._err(conn, "broken_" + type(e).__name__)
                    return
                self.stats.lat[kind].append(time.perf_counter() - t0)
                self.stats.requests += 1
                conn.acked.append(path)
                if status != 200:
                    self._err(conn, f"status_{status}")
                    return
                if any(s in body or s in json.dumps(headers).encode() for s in self.secrets):
                    self._err(conn, "secret_in_response")
                if kind == "inject" and b"Bearer [REDACTED]" in body:
                    self.stats.inject_verified += 1
                if headers.get("connection", "").lower() == "close":
                    break   # the gateway is draining: reconnect on the next session
        except asyncio.TimeoutError:
            conn.inflight_at_error = len(conn.paths) > len(conn.acked)
            self._err(conn, "timeout")
        except ConnectionRefusedError:
            self._err(conn, "refused")
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError) as e:
            conn.inflight_at_error = len(conn.paths) > len(conn.acked) or conn.connect_status is None
            self._err(conn, "broken_" + type(e).__name__)
        finally:
            conn.t_end = time.time()
            if writer is not None:
                writer.close()
                try:
                    await asyncio.wait_for(writer.wait_closed(), 2)
                except (asyncio.TimeoutError, OSError, ssl.SSLError, ConnectionError):
                    pass

    def _pick_kind(self) -> str:
        r, acc = self.rng.random(), 0.0
        for k, w in self.mix.items():
            acc += w
            if r < acc:
                return k
        return next(iter(self.mix))

    async def sandbox_loop(self, sb: str, token: str, sem: asyncio.Semaphore) -> None:
        while time.monotonic() < self.deadline and self.sent < self.max_requests:
            async with sem:
                if time.monotonic() >= self.deadline or self.sent >= self.max_requests:
                    return
                await self.session(sb, token, self._pick_kind(), self.rng.random() < self.keepalive_fraction)

    async def run(self) -> dict:
        sem = asyncio.Semaphore(self.concurrency)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        self.deadline = time.monotonic() + self.duration
        tasks = [asyncio.create_task(self.sandbox_loop(sb, tok, sem)) for sb, tok in self.sandboxes]
        watch = asyncio.create_task(self._stop_when_asked()) if self.stop_file else None
        # hard bound: the duration plus one operation timeout
        done, pending = await asyncio.wait(tasks, timeout=self.duration + OP_TIMEOUT + 5)
        if watch is not None:
            watch.cancel()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        return self.result(wall, cpu, cancelled=len(pending))

    async def _stop_when_asked(self) -> None:
        while time.monotonic() < self.deadline:
            if os.path.exists(self.stop_file):
                self.deadline = time.monotonic()
                return
            await asyncio.sleep(0.05)

    def result(self, wall: float, cpu: float, cancelled: int = 0) -> dict:
        all_lat = sorted(x for v in self.stats.lat.values() for x in v)
        return {
            "wall_s": round(wall, 3), "client_cpu_s": round(cpu, 3), "requests": self.stats.requests,
            "rps": round(self.stats.requests / wall, 1) if wall else 0.0,
            "p50_ms": _pct(all_lat, 0.50), "p99_ms": _pct(all_lat, 0.99),
            "by_kind": {k: {"n": len(v), "p50_ms": _pct(sorted(v), 0.5), "p99_ms": _pct(sorted(v), 0.99)}
                        for k, v in self.stats.lat.items()},
            "errors": self.stats.errors, "refused_retries": self.stats.refused_retries,
            "inject_verified": self.stats.inject_verified, "cancelled_tasks": cancelled,
            "sandboxes_active": len({c.sandbox for c in self.conns}),
            "connections": [asdict(c) for c in self.conns],
        }


def _pct(sorted_vals: list[float], p: float) -> float | None:
    if not sorted_vals:
        return None
    return round(sorted_vals[min(len(sorted_vals) - 1, int(p * len(sorted_vals)))] * 1000, 2)


def run_spec(spec: dict) -> dict:
    cpu = spec.get("cpu")
    if cpu is not None:
        os.sched_setaffinity(0, {int(cpu)})
    return asyncio.run(LoadGen(spec).run())


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    out = run_spec(spec)
    data = json.dumps(out)
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            f.write(data)
    else:
        sys.stdout.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
