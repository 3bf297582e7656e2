"""The data plane of one worker process: the gate, mitmproxy and the fast path in front of it.

Built from the pieces every process opens on the same state dir (policy store,
identities, audit log, vault), so any worker decides exactly what any other does.
The daemon runs `proxy.workers` of these (cubegate/worker.py), never one itself.
"""
from __future__ import annotations

import asyncio
import logging

from egress import netguard

log = logging.getLogger("cubegate.dataplane")


async def build_guard(s) -> tuple[netguard.AddressGuard, netguard.GuardedResolver]:
    """The SSRF guard (our own endpoints are never an upstream) and the guarded resolver."""
    own = {(s.proxy.listen_host, s.proxy.explicit_port), (s.ops.listen_host, s.ops.port),
           ("127.0.0.1", s.vault.api_port), ("127.0.0.1", s.policy_api.port)}
    if s.console.enabled:
        own.add(("127.0.0.1", s.console.port))
    if s.runtime.enabled:     # the sandbox API, and the E2B API (control plane + envd) behind it
        own.add(("127.0.0.1", s.runtime.api_port))
        if s.e2b.enabled:
            own.add(("127.0.0.1", s.e2b.port))
    if s.proxy.transparent_port:
        own.add((s.proxy.listen_host, s.proxy.transparent_port))
    if s.dns.listen_host:
        own.add((s.dns.listen_host, s.dns.port))  # the sandbox resolver: never an upstream
    if any(getattr(netguard.parse_ip_literal(h), "is_unspecified", False) for h, _ in own):
        # A wildcard listener is reachable on every local address (e.g. the cubevs gateway ip).
        # (in a thread: pyroute2 runs its own event loop)
        own = netguard.expand_wildcard_endpoints(own, await asyncio.to_thread(netguard.local_addresses))
    guard = netguard.AddressGuard(allow_cidrs=s.upstream.allow_cidrs,
                                  extra_deny_cidrs=s.upstream.deny_cidrs, own_endpoints=own)
    return guard, netguard.GuardedResolver(guard, nameservers=list(s.upstream.nameservers))


def open_vault(s, key_env: dict, policies):
    """The vault, unsealed from the first key source present (None without a vault file)."""
    import vault as vaultlib
    if not s.vault_db.exists():
        log.info("no vault at %s: credential injection disabled", s.vault_db)
        return None
    from egress.credentials import host_policy_check_for
    v = vaultlib.Vault.open(s.vault_db, host_policy_check=host_policy_check_for(lambda: policies.current))
    try:
        source = vaultlib.unseal_from(v, s.vault_key_file, environ=key_env)
        log.info("vault %s unsealed (key from %s)", s.vault_db, source)
    except vaultlib.NoKeySource as e:
        log.warning("vault %s stays sealed: %s; bound requests get 503 until it is unsealed", s.vault_db, e)
    except vaultlib.VaultError as e:
        log.error("vault stays sealed: %s", e)
    return v


def vault_ready(v) -> tuple[bool, str]:
    if v is None:
        return True, "no vault configured (no credential bindings)"
    return (not v.sealed), ("unsealed" if not v.sealed else "sealed: bound requests get 503")


def kernel_splicer():
    """This worker's cubevs splice maps, or None (userspace relay) where BPF cannot load them."""
    try:
        from cubevs.splice import Splicer
        return Splicer()
    except Exception as e:   # no BPF here (permissions, kernel, clang): the relay stays in userspace
        log.warning("proxy.kernel_splice=auto: kernel splice unavailable (%s: %s); relaying in userspace",
                    type(e).__name__, e)
        return None


class DataPlane:
    def __init__(self, s, *, policies, identities, guard, resolver, audit, metrics, credentials,
                 sandbox_lookup, sandbox_addresses, agent_endpoint, sockets: dict[bool, list] | None) -> None:
        """sockets: transparent? → listening sockets shared with the other workers (fast path);
        None: mitmproxy binds its own (proxy.fast_path off, one worker)."""
        # mitmproxy is imported here, in the workers only: the daemon starts without it
        from egress.bodies import BodyLimits
        from egress.engine import build_master
        from egress.gate import PolicyGate
        from egress.refusal_budget import RefusalBudget
        from egress.revocation import denied_by
        self.settings = s
        self.gate = PolicyGate(
            policies=policies, identities=identities, guard=guard, resolver=resolver,
            audit=audit, metrics=metrics, credentials=credentials, sandbox_lookup=sandbox_lookup,
            sandbox_addresses=sandbox_addresses,
            max_header_count=s.proxy.max_header_count, max_header_bytes=s.proxy.max_header_bytes,
            header_timeout=s.proxy.header_timeout, upstream_timeout=s.proxy.upstream_timeout,
            connect_timeout=s.proxy.connect_timeout,
            max_connections_per_sandbox=s.proxy.max_connections_per_sandbox,
            body_limits=BodyLimits(max_body_bytes=s.proxy.max_body_bytes,
                                   inspect_buffer_bytes=s.proxy.inspect_buffer_bytes,
                                   max_buffered_bytes_per_sandbox=s.proxy.max_buffered_bytes_per_sandbox),
            agent_endpoint=agent_endpoint,
            refusal_budget=RefusalBudget(s.audit.refusals_written_per_interval),
        )
        # A change (API, grant, expiry, file) closes open connections the new policy denies.
        policies.on_change(lambda old, new: self.gate.revoke_where(denied_by(new)))
        # A sandbox relabelled (policy by label) has its open connections re-decided the same way.
        from egress.identity import LabelWatch
        self._policies = policies
        self._labels = LabelWatch(identities)
        self.master = build_master(
            gate=self.gate, listen_host=s.proxy.listen_host, explicit_port=s.proxy.explicit_port,
            transparent_port=s.proxy.transparent_port, confdir=str(s.ca_dir),
            upstream_ca_bundle=s.upstream.ca_bundle, idle_timeout=s.proxy.idle_timeout,
            own_listeners=not s.proxy.fast_path,
        )
        self.fast_path = None
        self._sockets = sockets
        if s.proxy.fast_path:
            from egress.fastpath.server import FastPath
            self.fast_path = FastPath(gate=self.gate, master=self.master, listen_host=s.proxy.listen_host,
                                      explicit_port=s.proxy.explicit_port, transparent_port=s.proxy.transparent_port,
                                      idle_timeout=s.proxy.idle_timeout, plain_http=s.proxy.fast_plain_http,
                                      splicer=kernel_splicer() if s.proxy.kernel_splice == "auto" else None)
        self._backlog = None

    async def start(self, supervisor) -> asyncio.Task:
        """Listen; returns mitmproxy's task (it ends only when mitmproxy does)."""
        master_task = supervisor.start("mitmproxy", self._run_master())
        supervisor.start("refusal-summaries", self._refusal_summaries())
        if self.fast_path is not None:
            await self.fast_path.start(self._sockets)
        else:
            from egress.engine import widen_listen_backlog  # bursts of connects must not be dropped
            self._backlog = supervisor.start("listen-backlog", widen_listen_backlog(self.master), forever=False)
        return master_task

    async def _run_master(self) -> None:
        try:
            await self.master.run()
        except SystemExit as e:  # mitmproxy's errorcheck: an ERROR was logged during startup
            raise RuntimeError(f"mitmproxy exited ({e.code}): an error was logged during startup") from None

    async def _refusal_summaries(self) -> None:
        """Each interval's end: the refusals past a source's budget, as one record per source."""
        interval = self.settings.audit.refusal_interval_seconds
        while True:
            await asyncio.sleep(interval)
            self.gate.flush_refusals(interval)

    def check_labels(self) -> None:
        """Polled: re-decide the open connections of every sandbox relabelled since the last look."""
        changed = self._labels.changed()
        if changed:
            self.gate.relabel(changed, self._policies.current)

    def listeners_ready(self) -> tuple[bool, str]:
        from egress.engine import listeners_bound
        if self.fast_path is not None:
            return self.fast_path.listeners_bound()
        bound, detail = listeners_bound(self.master)
        if bound and (self._backlog is None or not self._backlog.done()):
            return False, f"{detail}; accept backlog not widened yet (a burst of connects would be dropped)"
        return bound, detail

    async def drain(self, seconds: float) -> None:
        """Listeners closed first, in-flight flows finish within `seconds` (egress/drain.py)."""
        from egress.drain import drain
        fast = self.fast_path.drain(seconds) if self.fast_path is not None else asyncio.sleep(0)
        await asyncio.gather(fast, drain(self.master, seconds, close_first=()))
        self.gate.flush_refusals(self.settings.audit.refusal_interval_seconds)   # none counted is lost
        self.master.shutdown()
