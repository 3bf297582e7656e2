"""The sandbox runtime inside the daemon: switch, backends, manager, REST API.

Started by Daemon.start() when runtime.enabled. Sandboxes outlive the daemon
(their processes run in their own sessions); on start the manager re-finds
them from its SQLite state and marks the dead ones failed.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from sandbox_runtime.backend import Limits, SandboxError
from sandbox_runtime.capacity import default_budget
from sandbox_runtime.manager import SandboxManager
from sandbox_runtime.metrics import RuntimeMetrics
from sandbox_runtime.snapshots import SnapshotStore
from sandbox_runtime.state import StateStore

log = logging.getLogger("cubegate.runtime")


def open_switch(settings):
    from cubevs.registry import DB_NAME
    from cubevs.switch import Switch, SwitchError
    state_dir = settings.cubevs_state_dir
    if (Path(state_dir) / DB_NAME).exists():
        try:
            return Switch.reopen(state_dir)
        except SwitchError:   # a registry without switch settings (nothing attached yet)
            pass
    p = settings.proxy
    return Switch(hub_netns=settings.runtime.hub_netns, state_dir=state_dir, bpffs_dir=Path(state_dir) / "bpf",
                  transparent_port=p.transparent_port, gateway_ports=switch_gateway_ports(settings),
                  dns_port=settings.dns.port)


def switch_gateway_ports(settings) -> tuple[int, ...]:
    """What a sandbox may dial on the gateway address: the proxy ports, and 80 for
    http://cubegate.internal (the sandbox resolver's answer; steered to the transparent
    listener like any other port 80, so the gate serves it to that sandbox alone)."""
    p = settings.proxy
    return (p.transparent_port, p.explicit_port) + ((80,) if settings.dns.listen_host else ())


def tenant_share(settings) -> float | None:
    """runtime.tenant_share, or by default half the host for each tenant when tenants with keys
    of their own share it (E2B token_tenants): none of them can take the host from the others."""
    if settings.runtime.tenant_share is not None:
        return settings.runtime.tenant_share
    e = settings.e2b
    tenants = {e.tenant, *e.token_tenants.values()}
    return 0.5 if e.enabled and len(tenants) > 1 else None


def make_backends(settings, ca_bundle: Path) -> dict:
    out = {}
    rdir = settings.runtime_dir
    for name in settings.runtime.backends:
        if name == "namespace":
            from sandbox_runtime.namespace import NamespaceBackend
            from sandbox_runtime.templates import TemplateStore
            out[name] = NamespaceBackend(rdir / "namespace", ca_bundle=ca_bundle,
                                         templates=TemplateStore(settings.template_cache_dir),
                                         launchers=settings.runtime.pool_size)
        elif name == "microvm":
            from sandbox_runtime.microvm.backend import MicrovmBackend
            from sandbox_runtime.templates import TemplateStore
            out[name] = MicrovmBackend(rdir / "microvm", settings.microvm_assets_dir, ca_bundle=ca_bundle,
                                       templates=TemplateStore(settings.template_cache_dir))
    return out


def default_limits(rt) -> Limits:
    return Limits(memory_mb=rt.default_memory_mb, cpus=rt.default_cpus, pids=rt.default_pids,
                  disk_mb=rt.default_disk_mb)


class RuntimeService:
    def __init__(self, manager: SandboxManager, api, switch):
        self.manager, self.api, self.switch = manager, api, switch

    async def close(self) -> None:
        if self.api is not None:
            self.api.stop()
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        if self.manager.pool is not None:
            self.manager.pool.stop()      # unclaimed slots are removed (the next start would anyway)
        self.manager.state.close()
        self.switch.close()   # sandboxes, pins and rules stay: they outlive the daemon
        for b in self.manager.backends.values():
            close = getattr(b, "close", None)
            if close is not None:
                close()       # its connections; the namespace backend its roots dir if nothing is left


async def start_for(daemon) -> RuntimeService | None:
    s = daemon.settings
    rt = s.runtime
    if not rt.enabled:
        return None
    from egress.mitm_ca import ca_paths
    from cubegate.runtime_api import serve
    from cubegate.runtime_hooks import DaemonHooks

    switch = await asyncio.to_thread(open_switch, s)   # pyroute2 runs its own loop: keep it off ours
    backends = make_backends(s, ca_paths(s.ca_dir)[1])
    for name, b in backends.items():
        ok, why = b.available()
        if not ok:
            log.warning("runtime: backend %s not available: %s (creations with it fail)", name, why)
    from sandbox_runtime.netpool import SlotPool
    pool = SlotPool(switch, rt.pool_size) if rt.pool_size > 0 else None
    snapshots = SnapshotStore(s.runtime_dir / "snapshots")
    snapshots.clean_temporaries()
    manager = SandboxManager(
        switch=switch, backends=backends, state=StateStore(s.runtime_dir / "sandboxes.sqlite3"), pool=pool,
        budget=default_budget(rt.memory_mb, rt.cpus, rt.max_sandboxes, rt.host_reserve_mb),
        metrics=RuntimeMetrics(daemon.metrics.registry), hooks=DaemonHooks(daemon), snapshots=snapshots,
        max_snapshots=rt.max_snapshots, auto_pause_seconds=rt.auto_pause_seconds,
        paused_capacity=rt.paused_capacity, tenant_share=tenant_share(s))
    result = await asyncio.to_thread(manager.recover)
    log.info("runtime: %d sandbox(es) kept, %d failed after restart, %d orphan(s) reaped",
             result["kept"], result["failed"], result["reaped"])
    if pool is not None:
        await asyncio.to_thread(pool.start)     # leftover slots of a previous daemon are removed first
    api = serve(manager, host="127.0.0.1", port=rt.api_port, token_file=s.runtime_dir / "api.token",
                vault_tokens=getattr(daemon, "operator_tokens", None),
                audit_hook=daemon._admin_audit, default_backend=rt.default_backend,
                default_limits=default_limits(rt), default_template=rt.default_template)
    log.info("runtime: sandbox API on 127.0.0.1:%d, backends %s", api.port, ", ".join(backends))
    svc = RuntimeService(manager, api, switch)
    if rt.auto_pause_seconds is not None:
        daemon.supervisor.start("auto-pause", auto_pause_loop(manager, rt.auto_pause_seconds))
    default = backends.get(rt.default_backend)
    # /readyz: with the runtime on, "ready" includes being able to start the default sandbox kind.
    daemon.readiness.add("runtime", lambda: default.available() if default is not None
                         else (False, f"default backend {rt.default_backend} not configured"))
    return svc


def auto_pause_interval(idle_seconds: float) -> float:
    """How often idleness is checked: a quarter of the idle time, within [0.25 s, 10 s]."""
    return min(10.0, max(0.25, idle_seconds / 4))


async def auto_pause_loop(manager: SandboxManager, idle_seconds: float) -> None:
    interval = auto_pause_interval(idle_seconds)
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(manager.auto_pause_tick)
        except SandboxError as e:      # the switch counters unreadable: nobody is paused this round
            log.warning("auto-pause: %s", e)
        except Exception as e:  # noqa: BLE001 - a round that fails pauses nobody (safe); the loop
            # must outlive it: a dead loop would mean no sandbox is ever paused again
            log.error("auto-pause: round failed: %s: %s", type(e).__name__, e)


async def stop_for(svc: RuntimeService | None) -> None:
    if svc is not None:
        await svc.close()
