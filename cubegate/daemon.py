"""The daemon: the control plane in this process, the data plane in `proxy.workers` processes.

Here: policy (files + the policy API's store), vault and its admin API, access
requests and cubegate.internal's answers, the sandbox runtime and its API, the
E2B API, sandbox DNS, netwatch, the audit index, /healthz /readyz /metrics.
In each worker (cubegate/worker.py, cubegate/dataplane.py): the fast path,
mitmproxy and the gate, on listening sockets this process binds and shares
(cubegate/worker_pool.py). Every process opens the same state dir; the audit log
takes one append per record under its flock from all of them.

Start order is chosen so the workers only start once everything they need is in
place; /readyz says so explicitly (every worker must be ready). Stop: the admin
and ops listeners, then the workers drain (their listeners close first).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from egress import netguard
from egress.audit.index import AuditIndex
from egress.audit.log import AuditLog
from egress.audit.record import now_ts
from egress.identity import Identity, IdentityStore
from egress.metrics import GatewayMetrics, WithWorkers
from egress.mitm_ca import ca_paths, ensure_ca
from egress.ops_server import Readiness, start_ops_server
from egress.policy.live import LivePolicies
from egress.policy.reload import PolicyStore
from egress.policy.repo import PolicyRepo

import vault as vaultlib
from cubegate.dataplane import build_guard, open_vault, vault_ready
from cubegate.policy_thread import off_loop
from cubegate.settings import Settings
from cubegate.supervise import Supervisor

log = logging.getLogger("cubegate.daemon")


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.readiness = Readiness()
        self._started_through = False   # run() saw every worker ready with no task dead
        self.workers = None              # cubegate/worker_pool.py: the data plane's processes
        self.ops_server = None
        self._stop = asyncio.Event()
        self.supervisor = Supervisor()   # every long-running task: a dead one turns /readyz 503
        self._uninstall_resolver = None
        self._reloads: set[asyncio.Task] = set()   # SIGHUP reloads in progress

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        Path(s.state_dir).mkdir(parents=True, exist_ok=True)
        _raise_nofile_limit()  # every connection costs two fds (client + upstream)
        # Policy first: no valid policy → no daemon (PolicyError propagates with file:line).
        # Files + the policy API's versioned store; an API policy replaces a file policy of the same name.
        self.policy_repo = PolicyRepo(s.policy_db)
        self.policies = LivePolicies(PolicyStore(s.policy_dir), self.policy_repo)
        from cubegate.denials import DenialRing
        self.denials = DenialRing(per_sandbox=s.access.denials_kept_per_sandbox)
        self.audit = AuditLog(s.audit_dir, max_bytes=s.audit.max_bytes, keep_files=s.audit.keep_files,
                              retention_days=s.audit.retention_days, fsync=s.audit.fsync)
        # Each sandbox's recent denials (cubegate.internal), read from the log every process appends to.
        self.audit_index = AuditIndex(Path(s.state_dir) / "audit-index.db", s.audit_dir,
                                      on_record=self.denials.observe)
        self.identities = IdentityStore(s.identity_db)
        self.guard, self.resolver = await build_guard(s)   # the sandbox resolver resolves through it
        self._uninstall_resolver = netguard.install(asyncio.get_running_loop(), self.resolver)
        ensure_ca(s.ca_dir)
        self._open_vault()
        self._start_access()
        self.sandbox_lookup = self._sandbox_lookup()
        # A change (API, grant, expiry, file, network options) reaches every worker at once; each
        # takes it in one swap and closes its open connections the new policy denies.
        self.policies.on_change(self._policy_changed)
        from cubegate import runtime_service  # sandboxes + their API (runtime.enabled); creates the switch
        self._runtime = await runtime_service.start_for(self)   # before DNS: the switch adds the hub address
        from cubegate.e2b import service as e2b_service  # the E2B-compatible API on the runtime (e2b.enabled)
        self._e2b = await e2b_service.start_for(self, self._runtime)
        from cubegate import sandbox_dns  # sandbox DNS resolver (settings.dns; off when listen_host is null)
        self._dns = await sandbox_dns.start_for(self)
        from cubegate import netwatch  # switch counters on /metrics, drop events to audit (transparent mode)
        self._netwatch = await netwatch.start_for(self)
        from cubegate.worker_pool import WorkerPool
        self.workers = WorkerPool(s, count=s.proxy.worker_count, key_env=self._key_env,
                                  registry=self.metrics.registry, answer_agent=self._answer_agent)
        self.metrics_view = WithWorkers(self.metrics.registry, str(self.workers.metrics_dir))   # /metrics, console
        self._add_readiness_checks()
        self.vault_api = None
        self._start_vault_api()
        self.policy_api = None
        if s.policy_api.enabled:
            from cubegate import policy_api
            from cubegate.admin_tokens import AdminTokens, ensure_token_file
            ensure_token_file(s.admin_token_file)
            tokens = AdminTokens(s.admin_token_file, self.operator_tokens)
            self.policy_api = policy_api.serve(self.policies, self.access, tokens, port=s.policy_api.port,
                                               audit_hook=self._admin_audit)
        from cubegate.console import service as console_service   # the web console (console.enabled)
        self._console = await console_service.start_for(self)
        self.ops_server = start_ops_server(s.ops.listen_host, s.ops.port, self.readiness, self.metrics_view.render)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload_policy)
        loop.add_signal_handler(signal.SIGUSR2, self.rolling_restart)
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        sup = self.supervisor
        sup.start("policy-watch", self._policy_watch(s.policy_poll_seconds))
        sup.start("audit-index", self._index_loop())
        sup.start("grant-expiry", self._grant_expiry_loop(s.access.grant_sweep_seconds))
        if self.webhook is not None:
            sup.start("access-webhook", self.webhook.run())
        if self._netwatch is not None:
            sup.watch("netwatch", self._netwatch.task)
        if self._dns is not None:
            sup.start("sandbox-dns", self._dns.serve())
        if self._console is not None:
            sup.start("console-metrics", self._console.sample_loop())
        await self.workers.start()

    def _open_vault(self):
        """Open and unseal the vault if one exists. Without a vault file no host is bound."""
        # The key sources leave our environment at once: child processes (sandboxes, qemu) must never
        # inherit them; the workers get them over their link (cubegate/workerlink.py).
        self._key_env = {k: os.environ.pop(k) for k in vaultlib.KEY_ENV_VARS if k in os.environ}
        self.vault = open_vault(self.settings, self._key_env, self.policies)
        from cubegate.tenant_keys import operator_tokens   # tenants' E2B keys are for the E2B API only
        self.operator_tokens = operator_tokens(self.settings, self.vault)

    def _policy_changed(self, old, new) -> None:
        """Tell every worker (the runtime API changes network options from its worker threads)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if self.workers is None:
            return
        if here is self._loop:
            self.workers.broadcast({"t": "policy"})
        else:
            self._loop.call_soon_threadsafe(self.workers.broadcast, {"t": "policy"})

    async def _answer_agent(self, sandbox: str, labels: dict, method: str, path: str, body: bytes):
        """cubegate.internal, asked by a worker for the sandbox it identified."""
        if path.split("?", 1)[0].rstrip("/") == "/v1/denials":
            await asyncio.to_thread(self.audit_index.sync)   # the denial it just wrote is in the log
        return self.agent_endpoint.answer(Identity(sandbox, labels), method, path, body)

    def rolling_restart(self) -> None:
        """SIGUSR2: every worker replaced in turn, the new one ready before the old one drains."""
        self.supervisor.start("rolling-restart", self.workers.rolling_restart(), forever=False)

    def _start_access(self) -> None:
        """Access requests (cubegate.internal) and their webhook."""
        from cubegate.access_store import AccessStore
        from cubegate.agent_endpoint import AgentEndpoint
        a = self.settings.access
        self.access = AccessStore(Path(self.settings.state_dir) / "access.db")
        self.webhook = None
        if a.webhook_url:
            from cubegate.webhook import Webhook
            self.webhook = Webhook(a.webhook_url, a.webhook_timeout_seconds)
        self.agent_endpoint = AgentEndpoint(
            denials=self.denials, access=self.access,
            notify=self.webhook.notify if self.webhook is not None else (lambda req: None),
            requests_per_minute=a.requests_per_minute, max_pending=a.max_pending_per_sandbox,
            max_reason_chars=a.max_reason_chars)

    async def _grant_expiry_loop(self, interval: float) -> None:
        import time
        while True:
            await asyncio.sleep(interval)
            try:
                for name in self.policies.expire_grants(time.time()):
                    log.info("grant %s expired and was removed", name)
            except Exception:   # keep sweeping; a grant that could not be removed is tried again
                log.exception("grant expiry sweep failed")

    def _start_vault_api(self) -> None:
        if self.vault is None:
            return
        from vault.api import serve
        self.vault_api = serve(_SealFanout(self.vault, self._vault_changed), host="127.0.0.1",
                               port=self.settings.vault.api_port, tokens=self.operator_tokens,
                               audit_hook=self._admin_audit)

    def _vault_changed(self, msg: dict) -> None:
        """The admin API sealed or unsealed the vault (maybe from an executor thread): every worker too."""
        if self.workers is not None:
            self.workers.broadcast_threadsafe(self._loop, msg)

    def _admin_audit(self, rec: dict) -> None:
        self.audit.append(_admin_record(rec))

    def _sandbox_lookup(self):
        """Transparent mode identifies sandboxes by source address (cubevs registry)."""
        if not self.settings.proxy.transparent_port:
            return None
        from cubevs.registry import Registry
        from cubegate.sandbox_lookup import RegistryLookup
        self._lookup = RegistryLookup(Registry(self.settings.cubevs_state_dir), self.identities)
        return self._lookup

    def _add_readiness_checks(self) -> None:
        self.readiness.add("policy", lambda: (self.policies.current is not None,
                                              f"digest {self.policies.current.digest[:12]}"
                                              + (f"; last reload failed: {self.policies.last_error}"
                                                 if self.policies.last_error else "")))
        self.readiness.add("ca", lambda: (all(p.exists() for p in ca_paths(self.settings.ca_dir)),
                                          str(ca_paths(self.settings.ca_dir)[1])))
        self.readiness.add("listeners", lambda: self.workers.readiness())   # every worker bound and ready
        self.readiness.add("vault", self._vault_ready)
        self.readiness.add("audit", lambda: (self.audit.writable(), str(self.settings.audit_dir)))
        self.readiness.add("tasks", self.supervisor.check)
        # last: ready only once run() saw the start through (a task dying just before that
        # stops the daemon; a /readyz 200 must mean it will not)
        self.readiness.add("started", lambda: (self._started_through, "started" if self._started_through
                                               else "starting: waiting for every worker"))

    def _vault_ready(self) -> tuple[bool, str]:
        return vault_ready(self.vault)

    def reload_policy(self) -> None:
        """SIGHUP: reload now, here and in every worker; an invalid file keeps the old policy in
        force (PolicyStore logs why). Parsed on the policy thread: the loop keeps answering."""
        task = self._loop.create_task(self._reload_policy())
        self._reloads.add(task)      # held until done (the loop keeps only a weak reference)
        task.add_done_callback(self._reloads.discard)

    async def _reload_policy(self) -> None:
        try:
            self._count_reload(await off_loop(self.policies.reload))
        except Exception:   # the old policy stays in force
            log.exception("policy reload failed")
        if self.workers is not None:
            self.workers.signal_all(signal.SIGHUP)

    def _count_reload(self, result) -> None:
        if result is not None:
            self.metrics.policy_reloads.labels("ok" if result.ok else "error").inc()

    async def _policy_watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self._count_reload(await off_loop(self.policies.check_for_changes, settle=True))
            except Exception:  # keep watching; the old policy stays in force
                log.exception("policy watch iteration failed")

    async def _index_loop(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.audit_index.sync)
            except Exception as e:  # the index is disposable; the JSONL stays the truth
                log.warning("audit index sync failed: %s", e)
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------- run
    async def run(self) -> int:
        await self.start()
        log.info("cubegate gateway: explicit proxy on %s:%s, ops on %s:%s",
                 self.settings.proxy.listen_host, self.settings.proxy.explicit_port,
                 self.settings.ops.listen_host, self.settings.ops.port)
        if not await self._started():
            await self.stop()
            return 1
        self._started_through = True
        await self._stop.wait()
        await self.stop()
        return 1 if self.supervisor.dead else 0

    async def _started(self) -> bool:
        """Until every worker is ready: a daemon task that dies meanwhile stops the daemon (a bug
        at startup must not leave a half-working gateway); False then."""
        while not self._stop.is_set() and not self.workers.all_ready():
            if self.supervisor.dead:
                log.error("daemon task(s) died while the daemon started, stopping: %s", self.supervisor.dead)
                return False
            await asyncio.sleep(0.05)
        return not self.supervisor.dead

    async def stop(self) -> None:
        self.supervisor.begin_stop()
        if self.workers is not None:
            # Graceful drain (egress/drain.py, in each worker): the admin listeners and every
            # proxy listener closed first so a new gateway can bind, in-flight flows finish
            # up to proxy.drain_seconds.
            for server in (self.ops_server, getattr(self, "vault_api", None), getattr(self, "policy_api", None),
                           getattr(getattr(self, "_console", None), "server", None)):
                if server is not None:
                    try:
                        server.stop()
                    except Exception as e:  # a side listener must not block the drain
                        log.warning("stopping %r failed: %s", server, e)
            await self.workers.stop(self.settings.proxy.drain_seconds)
        if self.ops_server is not None:
            self.ops_server.stop()
        if getattr(self, "vault_api", None) is not None:
            self.vault_api.stop()
        if getattr(self, "policy_api", None) is not None:
            self.policy_api.stop()
        from cubegate.console import service as console_service
        console_service.stop_for(getattr(self, "_console", None))
        await self.supervisor.stop()
        from cubegate import sandbox_dns
        await sandbox_dns.stop_for(getattr(self, "_dns", None))
        from cubegate import netwatch
        await netwatch.stop_for(getattr(self, "_netwatch", None))
        from cubegate.e2b import service as e2b_service
        await e2b_service.stop_for(getattr(self, "_e2b", None))
        from cubegate import runtime_service
        await runtime_service.stop_for(getattr(self, "_runtime", None))
        if self._uninstall_resolver:
            self._uninstall_resolver()
        try:
            self.audit_index.sync()
        except Exception:
            pass
        self.audit.close()
        for db in ("access", "policy_repo"):
            if getattr(self, db, None) is not None:
                getattr(self, db).close()
        if getattr(self, "_lookup", None) is not None:
            self._lookup.close()


class _SealFanout:
    """The vault as the admin API sees it: a seal or unseal that succeeds here is passed on to
    every worker process (its own vault object on the same file)."""

    def __init__(self, vault, changed) -> None:
        self._vault, self._changed = vault, changed

    def seal(self) -> None:
        self._vault.seal()
        self._changed({"t": "vault", "op": "seal"})

    def unseal_with_key_file(self, path) -> None:
        self._vault.unseal_with_key_file(path)
        self._changed({"t": "vault", "op": "unseal", "key_file": str(path)})

    def unseal_with_passphrase(self, passphrase: str) -> None:
        self._vault.unseal_with_passphrase(passphrase)
        self._changed({"t": "vault", "op": "unseal", "passphrase": passphrase})

    def __getattr__(self, name):
        return getattr(self._vault, name)


def _raise_nofile_limit() -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise RLIMIT_NOFILE from %s to %s: %s", soft, hard, e)
    log.info("open files limit: %s", resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _admin_record(rec: dict) -> dict:
    """Vault admin actions → audit records (never a value: the vault hook carries none)."""
    import uuid
    return {"id": uuid.uuid4().hex, "ts": now_ts(), "event": "admin", "sandbox": rec.get("sandbox"),
            "decision": "allow" if rec.get("outcome", "ok") == "ok" else "deny",
            "reason": rec.get("reason") or rec.get("action"), "status": rec.get("status"),
            "extra": {k: v for k, v in rec.items() if k in
                      ("action", "tenant", "secret_id", "version", "binding_id", "actor", "outcome", "remote",
                       "sandbox", "program", "exit_code", "path", "snapshot", "clones",
                       "kind", "name", "version", "change", "scope", "request_id", "to_version", "token_id",
                       "records")}}

