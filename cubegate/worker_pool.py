"""The daemon's worker processes: the data plane, `proxy.workers` times (cubegate/worker.py).

Listening: the daemon binds one socket per proxy port *per worker slot*, all with
SO_REUSEPORT (the kernel spreads new connections over the slots), keeps its own
copy of each, and passes slot i's sockets to the worker of slot i. A slot's accept
queue therefore outlives its worker:
  - a worker that dies is replaced at once; connections that arrive for its slot
    meanwhile wait in the kernel's queue for the replacement (held, never relayed
    unchecked, never refused), and /readyz is 503 until it is ready (fail closed);
  - a rolling restart (SIGUSR2) starts slot i's new worker on the same sockets,
    waits until it is ready, and only then tells the old one to drain: both accept
    from the same queue in between, so no connection is refused;
  - on stop the daemon closes its copies first, then every worker drains: the ports
    are released and new connections are refused, as before (egress/drain.py).
With proxy.fast_path off there is one worker and mitmproxy binds its own listeners.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from egress.fastpath.listeners import listen_sockets
from egress.shared_claims import ClaimsColumns
from cubegate.workerlink import STALE_SECONDS, Link

log = logging.getLogger("cubegate.workers")

READY_TIMEOUT = 60.0      # a new worker of a rolling restart must be ready within this
CRASH_WINDOW = 2.0        # a worker that dies younger than this is crash-looping: back off
MAX_BACKOFF = 5.0


@dataclass(eq=False)
class WorkerHandle:
    slot: int
    proc: asyncio.subprocess.Process
    link: Link
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    checks: dict = field(default_factory=dict)
    seen: float = 0.0
    retired: bool = False          # draining (replaced or stopping): its exit is expected
    column: int = -1               # its counters in the shared connection budget (egress/shared_claims.py)
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.proc.pid


class WorkerPool:
    def __init__(self, settings, *, count: int, key_env: dict, registry, answer_agent) -> None:
        from prometheus_client import Counter, Gauge
        self.settings = settings
        self.count = count
        self._key_env = key_env                    # vault key sources, handed to each worker over its link
        self._answer_agent = answer_agent          # async (sandbox, labels, method, path, body) → (status, doc)
        run = Path(settings.state_dir) / "run"
        self.metrics_dir = run / "metrics" / str(os.getpid())
        self.claims_path = run / f"claims-{os.getpid()}"   # per-sandbox connection budget, all workers
        self.claims = None
        self.current: dict[int, WorkerHandle] = {}
        self.live: set[WorkerHandle] = set()
        self.sockets: dict[int, dict[bool, list[socket.socket]]] = {}
        self.stopping = False
        self._crashes: dict[int, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._rolling = asyncio.Lock()
        self.restarts = Counter("cubegate_worker_restarts_total", "Workers started again after one died",
                                registry=registry)
        self.ready_gauge = Gauge("cubegate_workers_ready", "Worker processes ready to serve", registry=registry)
        self.ready_gauge.set_function(lambda: sum(1 for h in self.current.values() if self._is_ready(h)))

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        _clean_metrics_dirs(self.metrics_dir.parent)
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        self.claims = ClaimsColumns(self.claims_path)
        p = self.settings.proxy
        if p.fast_path:
            ports = {False: p.explicit_port, True: p.transparent_port}
            for slot in range(self.count):
                self.sockets[slot] = {}
                for transparent, port in ports.items():
                    if port is None:
                        self.sockets[slot][transparent] = []
                        continue
                    if port == 0 and slot > 0:     # the kernel picked slot 0's port: every slot shares it
                        port = self.sockets[0][transparent][0].getsockname()[1]
                    self.sockets[slot][transparent] = listen_sockets(p.listen_host, port)
        for slot in range(self.count):
            self.current[slot] = await self._spawn(slot)

    def _spawn_args(self, slot: int, link_fd: int) -> tuple[list[str], list[int]]:
        socks = self.sockets.get(slot)
        if socks is None:
            return [str(slot), str(link_fd), "-", "-"], [link_fd]
        fds = {t: [s.fileno() for s in socks[t]] for t in (False, True)}
        args = [str(slot), str(link_fd), ",".join(map(str, fds[False])), ",".join(map(str, fds[True]))]
        return args, [link_fd, *fds[False], *fds[True]]

    async def _spawn(self, slot: int) -> WorkerHandle:
        column = self.claims.take()
        parent, child = socket.socketpair()
        try:
            args, fds = self._spawn_args(slot, child.fileno())
            env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(self.metrics_dir), CUBEGATE_DAEMON_PID=str(os.getpid()),
                       CUBEGATE_WORKER_LOG_LEVEL=str(logging.getLogger().getEffectiveLevel()),
                       CUBEGATE_WORKER_LOOP=self.settings.proxy.event_loop)   # chosen before the hello arrives
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "cubegate.worker", *args,
                                                        pass_fds=fds, env=env)
        except BaseException:
            self.claims.give_back(column)
            raise
        finally:
            child.close()
        link = await Link.open(parent)
        h = WorkerHandle(slot, proc, link, column=column)
        link.send({"t": "hello", "settings": self.settings.model_dump(mode="json"), "keys": self._key_env,
                   "claims": {"path": str(self.claims_path), "column": column}})
        self.live.add(h)
        self._hold(self._read(h))
        self._hold(self._watch(h))
        log.info("worker %d started (pid %d)", slot, proc.pid)
        return h

    def _hold(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ each worker
    async def _read(self, h: WorkerHandle) -> None:
        while True:
            msg = await h.link.receive()
            if msg is None:
                h.ready = False
                return
            t = msg.get("t")
            if t == "state":
                h.ready, h.checks, h.seen = bool(msg.get("ready")), msg.get("checks") or {}, time.monotonic()
                if h.ready:
                    h.ready_event.set()
            elif t == "agent":
                self._hold(self._agent(h, msg))

    async def _agent(self, h: WorkerHandle, msg: dict) -> None:
        try:
            status, doc = await self._answer_agent(str(msg.get("sandbox")), dict(msg.get("labels") or {}),
                                                   str(msg.get("method")), str(msg.get("path")),
                                                   base64.b64decode(msg.get("body") or ""))
        except Exception:
            log.exception("answering a cubegate.internal request failed")
            status, doc = 500, {"error": "internal_error"}
        h.link.send({"t": "agent_reply", "id": msg.get("id"), "status": status, "doc": doc})

    async def _watch(self, h: WorkerHandle) -> None:
        rc = await h.proc.wait()
        h.ready = False
        h.link.close()
        self.live.discard(h)
        _mark_dead(h.pid, self.metrics_dir)
        self.claims.give_back(h.column)   # a dead worker's connections are gone: so is their budget
        if h.retired or self.stopping:
            log.info("worker %d (pid %d) exited %s", h.slot, h.pid, rc)
            return
        lived = time.monotonic() - h.started
        k = self._crashes[h.slot] = self._crashes.get(h.slot, 0) + 1 if lived < CRASH_WINDOW else 0
        delay = min(MAX_BACKOFF, 0.2 * 2 ** (k - 1)) if k else 0.0
        log.error("worker %d (pid %d) died (exit %s) after %.1fs; starting another%s", h.slot, h.pid, rc, lived,
                  f" in {delay:.1f}s" if delay else "")
        self.restarts.inc()
        if delay:
            await asyncio.sleep(delay)
        if not self.stopping and self.current.get(h.slot) is h:
            self.current[h.slot] = await self._spawn(h.slot)

    # ------------------------------------------------------------------ readiness
    @staticmethod
    def _is_ready(h: WorkerHandle | None) -> bool:
        return h is not None and h.ready and time.monotonic() - h.seen < STALE_SECONDS

    def readiness(self) -> tuple[bool, str]:
        bad = []
        for slot in range(self.count):
            h = self.current.get(slot)
            if not self._is_ready(h):
                why = "not started" if h is None else ", ".join(
                    f"{k}: {v.get('detail')}" for k, v in h.checks.items() if not v.get("ok")) or "starting"
                bad.append(f"worker {slot}{f' (pid {h.pid})' if h else ''} not ready: {why}")
        if bad:
            return False, "; ".join(bad)
        pids = ", ".join(str(self.current[s].pid) for s in range(self.count))
        return True, f"{self.count} worker(s) ready (pids {pids})"

    def all_ready(self) -> bool:
        return all(self._is_ready(self.current.get(slot)) for slot in range(self.count))

    def pids(self) -> list[int]:
        return sorted(h.pid for h in self.live)

    # ------------------------------------------------------------------ to every worker
    def broadcast(self, msg: dict) -> None:
        """To every live worker, draining ones too (their open connections follow the policy)."""
        for h in list(self.live):
            h.link.send(msg)

    def broadcast_threadsafe(self, loop, msg: dict) -> None:
        loop.call_soon_threadsafe(self.broadcast, msg)

    def signal_all(self, sig: int) -> None:
        for h in list(self.live):
            try:
                os.kill(h.pid, sig)
            except ProcessLookupError:
                pass

    async def rolling_restart(self) -> bool:
        """Each slot in turn: a new worker on the slot's sockets, ready, then the old one drains."""
        if not self.sockets:
            log.error("rolling restart needs proxy.fast_path (mitmproxy alone cannot share its ports)")
            return False
        async with self._rolling:
            for slot in range(self.count):
                if self.stopping:
                    return False
                old = self.current.get(slot)
                new = await self._spawn(slot)
                try:
                    await asyncio.wait_for(new.ready_event.wait(), READY_TIMEOUT)
                except (asyncio.TimeoutError, TimeoutError):
                    log.error("rolling restart: the new worker %d (pid %d) was not ready in %ss; keeping the old",
                              slot, new.pid, READY_TIMEOUT)
                    new.retired = True
                    new.link.send({"t": "drain"})
                    return False
                self.current[slot] = new
                if old is not None:
                    old.retired = True
                    old.link.send({"t": "drain"})
            log.info("rolling restart done: workers %s", self.pids())
            return True

    async def stop(self, drain_seconds: float) -> None:
        """Our copies of the sockets closed first (so the ports are released once the workers
        close theirs), then every worker drains; one that outlives the drain is killed."""
        self.stopping = True
        for socks in self.sockets.values():
            for s in (*socks[False], *socks[True]):
                s.close()
        for h in list(self.live):
            h.retired = True
            h.link.send({"t": "drain"})
        procs = [h.proc for h in self.live]
        if procs:
            done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs],
                                               timeout=drain_seconds + 10)
            for h in list(self.live):
                if h.proc.returncode is None:
                    log.error("worker %d (pid %d) did not stop in time: killed", h.slot, h.pid)
                    h.proc.send_signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5)
        for t in list(self._tasks):
            t.cancel()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if self.claims is not None:
            self.claims.close()
            self.claims_path.unlink(missing_ok=True)


def _mark_dead(pid: int, path: Path) -> None:
    """A dead worker's live gauges leave the sums (its counters stay: totals never go back)."""
    try:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid, str(path))
    except Exception:
        log.exception("cannot remove the metrics of worker pid %d", pid)


def _clean_metrics_dirs(parent: Path) -> None:
    """Metrics dirs of daemons that are gone (a crash leaves them)."""
    if not parent.is_dir():
        return
    for d in parent.iterdir():
        if d.name.isdigit() and not _alive(int(d.name)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
