"""The daemon: wires policy, identity, audit, metrics, guard and mitmproxy together.

Start order is chosen so the listeners only bind once everything they need
is in place; /readyz says so explicitly. Stop order: listeners first
(`servers.update([])`, or the ports stay bound), then the master.
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
from egress.engine import build_master, listeners_bound
from egress.bodies import BodyLimits
from egress.gate import PolicyGate
from egress.identity import IdentityStore
from egress.metrics import GatewayMetrics
from egress.mitm_ca import ca_paths, ensure_ca
from egress.ops_server import Readiness, start_ops_server
from egress.policy.live import LivePolicies
from egress.policy.reload import PolicyStore
from egress.policy.repo import PolicyRepo
from egress.revocation import denied_by

import vault as vaultlib
from cubegate.settings import Settings
from cubegate.supervise import Supervisor

log = logging.getLogger("cubegate.daemon")


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.readiness = Readiness()
        self.master = None
        self.ops_server = None
        self._stop = asyncio.Event()
        self.supervisor = Supervisor()   # every long-running task: a dead one turns /readyz 503
        self._master_task: asyncio.Task | None = None
        self._uninstall_resolver = None

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
        from cubegate.denials import DenialRing, TappedAudit
        self.denials = DenialRing(per_sandbox=s.access.denials_kept_per_sandbox)
        self.audit = TappedAudit(AuditLog(s.audit_dir, max_bytes=s.audit.max_bytes, keep_files=s.audit.keep_files,
                                          retention_days=s.audit.retention_days, fsync=s.audit.fsync),
                                 self.denials.observe)   # each sandbox's recent denials, for cubegate.internal
        self.audit_index = AuditIndex(Path(s.state_dir) / "audit-index.db", s.audit_dir)
        self.identities = IdentityStore(s.identity_db)
        own = {(s.proxy.listen_host, s.proxy.explicit_port), (s.ops.listen_host, s.ops.port),
               ("127.0.0.1", s.vault.api_port), ("127.0.0.1", s.policy_api.port)}
        if s.console.enabled:
            own.add(("127.0.0.1", s.console.port))
        if s.proxy.transparent_port:
            own.add((s.proxy.listen_host, s.proxy.transparent_port))
        if s.dns.listen_host:
            own.add((s.dns.listen_host, s.dns.port))  # the sandbox resolver: never an upstream
        if any(getattr(netguard.parse_ip_literal(h), "is_unspecified", False) for h, _ in own):
            # A wildcard listener is reachable on every local address (e.g. the cubevs gateway ip).
            # (in a thread: pyroute2 runs its own event loop)
            own = netguard.expand_wildcard_endpoints(own, await asyncio.to_thread(netguard.local_addresses))
        self.guard = netguard.AddressGuard(allow_cidrs=s.upstream.allow_cidrs,
                                           extra_deny_cidrs=s.upstream.deny_cidrs, own_endpoints=own)
        self.resolver = netguard.GuardedResolver(self.guard, nameservers=list(s.upstream.nameservers))
        self._uninstall_resolver = netguard.install(asyncio.get_running_loop(), self.resolver)
        ensure_ca(s.ca_dir)
        self._open_vault()
        self._start_access()
        self.gate = PolicyGate(
            policies=self.policies, identities=self.identities, guard=self.guard, resolver=self.resolver,
            audit=self.audit, metrics=self.metrics, credentials=self._credentials(),
            sandbox_lookup=self._sandbox_lookup(),
            max_header_count=s.proxy.max_header_count, max_header_bytes=s.proxy.max_header_bytes,
            header_timeout=s.proxy.header_timeout, upstream_timeout=s.proxy.upstream_timeout,
            connect_timeout=s.proxy.connect_timeout,
            max_connections_per_sandbox=s.proxy.max_connections_per_sandbox,
            body_limits=BodyLimits(max_body_bytes=s.proxy.max_body_bytes,
                                   inspect_buffer_bytes=s.proxy.inspect_buffer_bytes,
                                   max_buffered_bytes_per_sandbox=s.proxy.max_buffered_bytes_per_sandbox),
            agent_endpoint=self.agent_endpoint,
        )
        # A change (API, grant, expiry, file) closes open connections the new policy denies.
        self.policies.on_change(self._revoke_on_change)
        from cubegate import runtime_service  # sandboxes + their API (runtime.enabled); creates the switch
        self._runtime = await runtime_service.start_for(self)   # before DNS: the switch adds the hub address
        from cubegate.e2b import service as e2b_service  # the E2B-compatible API on the runtime (e2b.enabled)
        self._e2b = await e2b_service.start_for(self, self._runtime)
        from cubegate import sandbox_dns  # sandbox DNS resolver (settings.dns; off when listen_host is null)
        self._dns = await sandbox_dns.start_for(self)
        from cubegate import netwatch  # switch counters on /metrics, drop events to audit (transparent mode)
        self._netwatch = await netwatch.start_for(self)
        self.master = build_master(
            gate=self.gate, listen_host=s.proxy.listen_host, explicit_port=s.proxy.explicit_port,
            transparent_port=s.proxy.transparent_port, confdir=str(s.ca_dir),
            upstream_ca_bundle=s.upstream.ca_bundle, idle_timeout=s.proxy.idle_timeout,
        )
        self._add_readiness_checks()
        self.vault_api = None
        self._start_vault_api()
        self.policy_api = None
        if s.policy_api.enabled:
            from cubegate import policy_api
            from cubegate.admin_tokens import AdminTokens, ensure_token_file
            ensure_token_file(s.admin_token_file)
            tokens = AdminTokens(s.admin_token_file, self.vault.tokens if self.vault is not None else None)
            self.policy_api = policy_api.serve(self.policies, self.access, tokens, port=s.policy_api.port,
                                               audit_hook=self._admin_audit)
        from cubegate.console import service as console_service   # the web console (console.enabled)
        self._console = await console_service.start_for(self)
        self.ops_server = start_ops_server(s.ops.listen_host, s.ops.port, self.readiness, self.metrics.render)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload_policy)
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
        from egress.engine import widen_listen_backlog  # bursts of connects must not be dropped
        self._backlog = sup.start("listen-backlog", widen_listen_backlog(self.master), forever=False)
        self._master_task = sup.start("mitmproxy", self._run_master())   # run() stops the daemon when it ends

    async def _run_master(self) -> None:
        try:
            await self.master.run()
        except SystemExit as e:  # mitmproxy's errorcheck: an ERROR was logged during startup
            # (an exception, not SystemExit, so the daemon stops in order instead of the loop dying)
            raise RuntimeError(f"mitmproxy exited ({e.code}): an error was logged during startup") from None

    def _open_vault(self):
        """Open and unseal the vault if one exists. Without a vault file no host is bound."""
        s = self.settings
        self.vault = None
        # The key sources leave our environment at once: child processes (sandboxes, qemu) must never inherit them.
        key_env = {k: os.environ.pop(k) for k in vaultlib.KEY_ENV_VARS if k in os.environ}
        if not s.vault_db.exists():
            log.info("no vault at %s: credential injection disabled", s.vault_db)
            return
        from egress.credentials import host_policy_check_for
        self.vault = vaultlib.Vault.open(s.vault_db, host_policy_check=host_policy_check_for(lambda: self.policies.current))
        try:
            source = vaultlib.unseal_from(self.vault, s.vault_key_file, environ=key_env)
            log.info("vault %s unsealed (key from %s)", s.vault_db, source)
        except vaultlib.NoKeySource as e:
            log.warning("vault %s stays sealed: %s; bound requests get 503 until it is unsealed", s.vault_db, e)
        except vaultlib.VaultError as e:
            log.error("vault stays sealed: %s", e)

    def _revoke_on_change(self, old, new) -> None:
        """On the event loop (the runtime API changes network options from its worker threads)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self._loop:
            self.gate.revoke_where(denied_by(new))
        else:
            self._loop.call_soon_threadsafe(lambda: self.gate.revoke_where(denied_by(self.policies.current)))

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

    def _credentials(self):
        if self.vault is None:
            return None
        from egress.credentials import VaultCredentials
        # Leaks are denied in the request's own audit record (reason credential_leak),
        # logged as ALERT and counted in cubegate_credential_leaks_blocked_total.
        return VaultCredentials(self.vault, metrics=self.metrics, scrub_bodies=self.settings.vault.scrub_response_bodies)

    def _start_vault_api(self) -> None:
        if self.vault is None:
            return
        from vault.api import serve
        self.vault_api = serve(self.vault, host="127.0.0.1", port=self.settings.vault.api_port,
                               audit_hook=self._admin_audit)

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
        self.readiness.add("listeners", self._listeners_ready)
        self.readiness.add("vault", self._vault_ready)
        self.readiness.add("audit", lambda: (self.audit.writable(), str(self.settings.audit_dir)))
        self.readiness.add("tasks", self.supervisor.check)

    def _listeners_ready(self) -> tuple[bool, str]:
        bound, detail = listeners_bound(self.master)
        backlog = getattr(self, "_backlog", None)
        if bound and (backlog is None or not backlog.done()):
            return False, f"{detail}; accept backlog not widened yet (a burst of connects would be dropped)"
        return bound, detail

    def _vault_ready(self) -> tuple[bool, str]:
        if self.vault is None:
            return True, "no vault configured (no credential bindings)"
        return (not self.vault.sealed), ("unsealed" if not self.vault.sealed else "sealed: bound requests get 503")

    def reload_policy(self) -> None:
        """SIGHUP: reload now; an invalid file keeps the old policy in force (PolicyStore logs why)."""
        self._count_reload(self.policies.reload())

    def _count_reload(self, result) -> None:
        if result is not None:
            self.metrics.policy_reloads.labels("ok" if result.ok else "error").inc()

    async def _policy_watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self._count_reload(self.policies.check_for_changes(settle=True))
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
        stop_task = asyncio.create_task(self._stop.wait())
        await asyncio.wait({self._master_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        failed = self._master_task.done() and not self._master_task.cancelled() \
            and self._master_task.exception() is not None
        await self.stop()
        return 1 if failed or self.supervisor.dead else 0

    async def stop(self) -> None:
        self.supervisor.begin_stop()
        if self.master is not None:
            # Graceful drain (egress/drain.py): all listeners closed first so a new
            # gateway can bind, in-flight flows finish up to proxy.drain_seconds.
            from egress.drain import drain
            await drain(self.master, self.settings.proxy.drain_seconds,
                        close_first=(self.ops_server, getattr(self, "vault_api", None),
                                     getattr(self, "policy_api", None),
                                     getattr(getattr(self, "_console", None), "server", None)))
            self.master.shutdown()
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

