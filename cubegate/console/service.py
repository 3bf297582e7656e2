"""The console inside the daemon: its server, sessions, exec jobs and the chart sampler.

Started by Daemon.start() when console.enabled. Loopback only, like the admin APIs;
HTTPS when console.tls_cert/tls_key are set. Without a vault there are no tokens,
so nobody could log in: the console then stays off (logged).
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from concurrent.futures import ThreadPoolExecutor

import httpkit
from httpkit import SessionStore

from .app import make_app
from .base import ConsoleContext, ConsoleHandler, Runtime, known_error_text
from .charts import Ring, sample_from
from .exec_jobs import ExecJobs
from .overview import host_capacity

log = logging.getLogger("cubegate.console")
MAX_BODY = 1024 * 1024


class ConsoleService:
    def __init__(self, ctx: ConsoleContext, server: httpkit.Server, registry, tls: bool):
        self.ctx, self.server, self.registry, self.tls = ctx, server, registry, tls

    @property
    def port(self) -> int | None:
        return self.server.port

    def sample(self) -> None:
        self.ctx.ring.add(sample_from(list(self.registry.collect()), time.time()))

    async def sample_loop(self) -> None:
        """Supervised: the charts' samples, every console.sample_seconds."""
        while True:
            try:
                await asyncio.to_thread(self.sample)   # the runtime's collector reads cgroups
            except Exception as e:   # a missed sample is a gap in the chart, not a dead console
                log.warning("console: metrics sample failed: %s", type(e).__name__)
            await asyncio.sleep(self.ctx.ring.interval)

    def close(self) -> None:
        self.server.stop()
        self.ctx.jobs.cancel_all()
        self.ctx.pool.shutdown(wait=False, cancel_futures=True)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def build(*, settings, vault, readiness, registry, audit_index, audit_dir, runtime: Runtime | None,
          audit_hook, policies=None, access=None, port: int | None = None, tokens=None) -> ConsoleService:
    c = settings.console
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="console")
    manager = runtime.manager if runtime is not None else None
    ctx = ConsoleContext(
        vault=vault, sessions=SessionStore(idle_seconds=c.idle_timeout, max_age_seconds=c.max_session),
        readiness=readiness, ring=Ring(c.sample_seconds), audit_index=audit_index, audit_dir=audit_dir,
        runtime=runtime, pool=pool, jobs=ExecJobs(known_error_text), capacity=lambda: host_capacity(manager),
        policies=policies, access=access, tokens=tokens if tokens is not None else vault.tokens)
    tls = tls_context(c.tls_cert, c.tls_key) if c.tls_cert else None
    server = httpkit.serve(make_app(ctx, audit_hook), max_body=MAX_BODY, host="127.0.0.1",
                           port=c.port if port is None else port, what="the web console", ssl_options=tls,
                           admit=httpkit.session_admit(ctx.sessions, ConsoleHandler.cookie))
    svc = ConsoleService(ctx, server, registry, tls is not None)
    svc.sample()    # the first point at once: rates need two
    return svc


async def start_for(daemon) -> ConsoleService | None:
    s = daemon.settings
    if not s.console.enabled:
        return None
    if daemon.vault is None:
        log.error("console: enabled, but there is no vault (%s): no token could log in; the console stays off",
                  s.vault_db)
        return None
    rt = getattr(daemon, "_runtime", None)
    runtime = None
    if rt is not None:
        from cubegate.runtime_service import default_limits
        runtime = Runtime(rt.manager, tuple(s.runtime.backends), s.runtime.default_backend,
                          default_limits(s.runtime))
    svc = build(settings=s, vault=daemon.vault, readiness=daemon.readiness, registry=getattr(daemon, "metrics_view", daemon.metrics.registry),
                audit_index=daemon.audit_index, audit_dir=s.audit_dir, runtime=runtime,
                audit_hook=daemon._admin_audit, policies=daemon.policies, access=daemon.access,
                tokens=getattr(daemon, "operator_tokens", None))
    log.info("console: %s://127.0.0.1:%s/", "https" if svc.tls else "http", svc.port)
    return svc


def stop_for(svc: ConsoleService | None) -> None:
    if svc is not None:
        svc.close()
