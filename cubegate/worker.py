"""One data-plane worker process: `python -m cubegate.worker SLOT LINK_FD EXPLICIT_FDS TRANSPARENT_FDS`.

Started by the daemon (cubegate/worker_pool.py), never by hand. It opens the state
dir's stores itself (policy store + files, identities, audit log, vault) and runs a
DataPlane on the listening sockets the daemon passed it (fds, shared with the other
workers); it follows policy changes on the daemon's word and by polling the store,
revokes what a change denies, and tells the daemon every STATE_SECONDS whether it is
ready. cubegate.internal requests go to the daemon (it holds the denials and the
access store). When the daemon goes away, the worker drains and exits (no orphan
ever keeps serving). Metrics go to PROMETHEUS_MULTIPROC_DIR (the daemon sums them).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import os
import signal
import socket
import sys
import time

from cubegate.workerlink import STATE_SECONDS, Link
from egress.log_redact import where

log = logging.getLogger("cubegate.worker")

AGENT_TIMEOUT = 5.0
# A connection authenticated just before an identity change may still be deciding its
# destination (resolving, connecting) when the change is first followed, invisible to that
# look: the identity checks go on this long after each change (longer than any decision takes).
IDENTITY_RECHECK_SECONDS = 60.0
# The identity store unreadable for this many polls in a row: no token can be checked, so the open
# explicit connections are closed (fail closed); new ones already fail (every lookup raises).
IDENTITY_UNREADABLE_POLLS = 5
AGENT_MAX_PENDING = 256


class RemoteAgentEndpoint:
    """cubegate.internal, answered by the daemon over the link (egress.gate awaits it)."""

    def __init__(self, link: Link) -> None:
        from cubegate.agent_endpoint import MAX_BODY
        self.max_body = MAX_BODY
        self.link = link
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def answer(self, identity, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if len(self._waiting) >= AGENT_MAX_PENDING:
            return 503, {"error": "busy"}
        n = next(self._ids)
        fut = self._waiting[n] = asyncio.get_running_loop().create_future()
        self.link.send({"t": "agent", "id": n, "sandbox": identity.sandbox_id, "labels": dict(identity.labels),
                        "method": method, "path": path, "body": base64.b64encode(body).decode()})
        try:
            return await asyncio.wait_for(fut, AGENT_TIMEOUT)
        except (asyncio.TimeoutError, TimeoutError):
            return 503, {"error": "unavailable"}
        finally:
            self._waiting.pop(n, None)

    def deliver(self, msg: dict) -> None:
        fut = self._waiting.get(msg.get("id"))
        if fut is not None and not fut.done():
            fut.set_result((int(msg.get("status", 503)), msg.get("doc") or {}))


class Worker:
    def __init__(self, slot: int, link_fd: int, sockets: dict[bool, list[socket.socket]] | None) -> None:
        self.slot = slot
        self.link_fd = link_fd
        self.sockets = sockets
        self.stop = asyncio.Event()

    async def run(self) -> int:
        from cubegate.dataplane import DataPlane, build_guard, open_vault, vault_ready
        from cubegate.settings import Settings
        from cubegate.supervise import Supervisor
        from cubegate.worker_policy import PolicyFollower
        from egress import netguard
        from egress.audit.log import AuditLog
        from egress.identity import IdentityStore
        from egress.metrics import GatewayMetrics
        from egress.ops_server import Readiness
        from egress.policy.live import LivePolicies
        from egress.policy.reload import PolicyStore
        from egress.policy.repo import PolicyRepo

        loop = asyncio.get_running_loop()
        self.link = await Link.open(socket.socket(fileno=self.link_fd))
        hello = await self.link.receive()
        if not hello or hello.get("t") != "hello":
            log.error("worker %d: no hello from the daemon", self.slot)
            return 2
        s = Settings.model_validate(hello["settings"])
        keys = hello.get("keys") or {}
        self.metrics = metrics = GatewayMetrics()
        self.policies = LivePolicies(PolicyStore(s.policy_dir), PolicyRepo(s.policy_db))
        self.follower = PolicyFollower(self.policies, self.slot, lambda res: metrics.policy_reloads.labels(
            "ok" if res.ok else "error").inc())
        self.audit = AuditLog(s.audit_dir, max_bytes=s.audit.max_bytes, keep_files=s.audit.keep_files,
                              retention_days=s.audit.retention_days, fsync=s.audit.fsync)
        self.identities = IdentityStore(s.identity_db)
        guard, resolver = await build_guard(s)
        uninstall = netguard.install(loop, resolver)
        self.vault = open_vault(s, keys, self.policies)
        keys.clear()
        credentials = None
        if self.vault is not None:
            from egress.credentials import VaultCredentials
            credentials = VaultCredentials(self.vault, metrics=metrics, scrub_bodies=s.vault.scrub_response_bodies)
        from cubevs.registry import Registry
        from cubegate.sandbox_lookup import RegistryLookup
        # the switch's record: who a transparent source is, and where a sandbox's token may come from
        registry = RegistryLookup(Registry(s.cubevs_state_dir), self.identities)
        lookup = registry if s.proxy.transparent_port else None
        self.agent = RemoteAgentEndpoint(self.link)
        self.dataplane = DataPlane(s, policies=self.policies, identities=self.identities, guard=guard,
                                   resolver=resolver, audit=self.audit, metrics=metrics, credentials=credentials,
                                   sandbox_lookup=lookup, sandbox_addresses=registry, agent_endpoint=self.agent,
                                   sockets=self.sockets)
        claims = hello.get("claims")
        if claims:   # the per-sandbox connection cap counts every worker's connections
            from egress.shared_claims import SharedClaims
            self.dataplane.gate.claims = SharedClaims(claims["path"], s.proxy.max_connections_per_sandbox,
                                                      int(claims["column"]))
        sup = self.supervisor = Supervisor()
        readiness = self.readiness = Readiness()
        readiness.add("policy", lambda: (True, f"digest {self.policies.current.digest[:12]}"))
        readiness.add("listeners", self.dataplane.listeners_ready)
        readiness.add("vault", lambda: vault_ready(self.vault))
        readiness.add("audit", lambda: (self.audit.writable(), str(s.audit_dir)))
        readiness.add("tasks", sup.check)
        master_task = await self.dataplane.start(sup)
        sup.start("link", self._read_link())
        sup.start("state", self._report_state())
        sup.start("policy-watch", self._policy_watch(s.policy_poll_seconds))
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)   # the daemon's ^C: it drains us itself
        log.info("worker %d (pid %d) serving (loop: %s)", self.slot, os.getpid(), type(loop).__name__)
        stop_task = asyncio.create_task(self.stop.wait())
        await asyncio.wait({master_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        failed = master_task.done() and not master_task.cancelled() and master_task.exception() is not None
        sup.begin_stop()
        self._send_state()   # not ready any more: the daemon says so on /readyz at once
        await self.dataplane.drain(s.proxy.drain_seconds)
        log.info("worker %d drained", self.slot)
        await sup.stop()
        self.follower.close()
        uninstall()
        self.audit.close()
        return 1 if failed else 0

    # ------------------------------------------------------------------ the link
    async def _read_link(self) -> None:
        while True:
            msg = await self.link.receive()
            if msg is None:   # the daemon is gone: nobody supervises us, stop serving
                log.warning("worker %d: the daemon closed the link; draining", self.slot)
                self.stop.set()
                return
            t = msg.get("t")
            if t == "policy":
                self._refresh()   # the store now; files once they settle (never a half-written one)
            elif t == "drain":
                self.stop.set()
            elif t == "agent_reply":
                self.agent.deliver(msg)
            elif t == "vault":
                await self._vault(msg)

    async def _vault(self, msg: dict) -> None:
        """The daemon's admin API sealed or unsealed its vault: the same here."""
        if self.vault is None:
            return
        try:
            if msg.get("op") == "seal":
                self.vault.seal()
            elif msg.get("key_file"):
                await asyncio.to_thread(self.vault.unseal_with_key_file, msg["key_file"])
            elif msg.get("passphrase"):
                await asyncio.to_thread(self.vault.unseal_with_passphrase, msg["passphrase"])
        except Exception as e:   # stays as it was; /readyz says sealed
            log.error("worker %d: vault %s failed: %s", self.slot, msg.get("op"), type(e).__name__)
        finally:
            msg.clear()

    def _send_state(self) -> None:
        ready, checks = self.readiness.evaluate()
        if self.stop.is_set():
            ready = False
            checks["draining"] = {"ok": False, "detail": "worker is draining"}
        self.link.send({"t": "state", "ready": ready, "checks": checks, "pid": os.getpid()})

    async def _report_state(self) -> None:
        while True:
            self._send_state()
            await asyncio.sleep(STATE_SECONDS)

    # ------------------------------------------------------------------ policy
    def _refresh(self) -> None:
        """The daemon's word: the store now; files once they settle (never a half-written one).
        Parsed on the policy thread: returns at once (cubegate/worker_policy.py)."""
        self.follower.request()

    def _reload(self) -> None:
        """SIGHUP: the files now (an invalid one keeps the old set), then the store; off the loop."""
        self.follower.request(files_now=True)

    async def _policy_watch(self, interval: float) -> None:
        """The daemon says when the store changes; this catches anything it could not say.
        The identity table too: a removed, re-keyed or relabelled sandbox loses its open connections."""
        seen = self._follow_identities(None)
        while True:
            await asyncio.sleep(interval)
            await self.follower.request()   # the relabel check below decides by the policy now in force
            seen = self._follow_identities(seen, unreadable_grace=IDENTITY_UNREADABLE_POLLS * interval)
            try:   # then the relabelled ones still open: re-decided with their new labels
                self.dataplane.check_labels()
            except Exception as e:   # noqa: BLE001 - keep watching; the next look compares again
                # by type and frames only: a store's error text can quote what it read
                log.error("worker %d: label watch failed: %s at %s", self.slot, type(e).__name__, where(e))

    _unreadable_since: float | None = None   # when following the identity store first failed

    def _follow_identities(self, seen, unreadable_grace: float = 0.0):
        """Close the open connections of identities removed or re-keyed since `seen` (None: the
        first look), and again on every poll until IDENTITY_RECHECK_SECONDS after the last change;
        returns (generation, recheck until) now (unchanged on a failure: the next poll tries again,
        and once the store has been unreadable past `unreadable_grace`, every explicit connection
        is closed). A relabel alone is check_labels' (re-decided, not closed)."""
        try:
            seen = self._follow_identity_changes(seen)
            self._unreadable_since = None
            return seen
        except Exception as e:   # new authentications fail closed (each lookup raises); open ones:
            self.identities.forget_cached()
            clock = time.monotonic()
            since = self._unreadable_since = self._unreadable_since or clock
            closing = clock - since >= unreadable_grace
            # the text may quote the table: class and frames only
            log.error("worker %d: following identity changes failed (%s at %s)%s", self.slot,
                      type(e).__name__, where(e), "; closing explicit connections" if closing else "; retried next poll")
            if closing:
                from egress.revocation import identity_unverifiable
                self.dataplane.gate.revoke_where(identity_unverifiable)
            return seen

    def _follow_identity_changes(self, seen):
        from cubegate.sandbox_lookup import RegistryLookup
        from egress.revocation import identity_changed
        now = self.identities.generation()
        if seen is None:
            return now, 0.0
        last, recheck_until = seen
        clock = time.monotonic()
        if now != last:
            recheck_until = clock + IDENTITY_RECHECK_SECONDS
        elif clock >= recheck_until:
            return seen
        table = {i.sandbox_id: i for i in self.identities.list()}   # one read for every connection

        def current(conn):
            known = table.get(conn.sandbox_id)
            return RegistryLookup.identity_of(conn.sandbox_id, known) if conn.transparent else known

        self.dataplane.gate.revoke_where(identity_changed(current))
        return now, recheck_until


def _fds(arg: str) -> list[socket.socket]:
    return [socket.socket(fileno=int(fd)) for fd in arg.split(",") if fd]


def _die_with_the_daemon() -> None:
    """SIGKILL when the daemon dies, however it dies (kill -9 included): no orphan worker ever
    serves on (fail closed), and the ports are released with the daemon's."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(os.environ.get("CUBEGATE_DAEMON_PID", "0")):
        os._exit(3)   # the daemon was gone before we asked


def _loop_factory():
    """proxy.event_loop (passed by the daemon): uvloop only as egress.guarded_uvloop's subclass, which
    netguard can guard; the stdlib loop when asked for or when uvloop is not installed."""
    if os.environ.get("CUBEGATE_WORKER_LOOP", "asyncio") == "uvloop":
        try:
            from egress.guarded_uvloop import new_event_loop
            return new_event_loop
        except ImportError:
            log.warning("uvloop is not installed: the worker runs the stdlib loop")
    return None


def main(argv: list[str]) -> int:
    _die_with_the_daemon()
    from egress.metrics import values_with_cached_pid
    values_with_cached_pid()             # before any metric of this process exists
    slot, link_fd, explicit, transparent = int(argv[0]), int(argv[1]), argv[2], argv[3]
    logging.basicConfig(level=int(os.environ.get("CUBEGATE_WORKER_LOG_LEVEL", logging.INFO)), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[w{slot}]: %(message)s")
    sockets = None if explicit == "-" else {False: _fds(explicit), True: _fds(transparent)}
    rc = asyncio.run(Worker(slot, link_fd, sockets).run(), loop_factory=_loop_factory())
    # Drained, audit log closed: skip the interpreter's teardown of mitmproxy's object graph
    # (seconds of CPU under load, in the way of the gateway that replaces us).
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
