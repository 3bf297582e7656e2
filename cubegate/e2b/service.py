"""The E2B API inside the daemon: one loopback port for the control plane and envd, and
the TTL reaper (a supervised task) that kills each sandbox at its end time."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import httpkit
from httpkit import PathParam

from cubegate.admin_tokens import ensure_token_file
from cubegate.runtime_api import RUNTIME_TOKEN_PREFIX, TokenCheck
from cubegate.runtime_service import default_limits
from sandbox_runtime.manager import SANDBOX_ID_RE

from . import control, envd, templates
from .core import E2bCore
from .lanes import Lanes
from .registry import Registry

log = logging.getLogger("cubegate.e2b")
REAP_EVERY_S = 1.0

ENVD_ROUTES = [("/health", envd.Health), ("/process.Process/{method}", envd.ProcessRpc),
               ("/filesystem.Filesystem/{method}", envd.FilesystemRpc), ("/files", envd.Files),
               ("/execute", envd.Execute)]
PARAMS = {"id": PathParam(SANDBOX_ID_RE.pattern.strip("^$"), {"type": "string", "pattern": SANDBOX_ID_RE.pattern}),
          "method": PathParam(r"\w+", {"type": "string"})}


ENVD_WORKERS, CONTROL_WORKERS = 64, 16
ENVD_LIMITS = {"sandbox": 8, "tenant": 48}    # one sandbox, one tenant: never the whole envd pool
CONTROL_LIMITS = {"tenant": 12}


class E2bService:
    """Three pools: envd calls (sandbox code can make them last: bounded per sandbox and
    per tenant), the control plane (its own, per tenant), the reaper (its own thread)."""

    def __init__(self, core: E2bCore, server: httpkit.Server, pools: list[ThreadPoolExecutor],
                 reaper_pool: ThreadPoolExecutor):
        self.core, self.server, self.pools, self.reaper_pool = core, server, pools, reaper_pool

    @property
    def port(self) -> int:
        return self.server.port

    async def reaper(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                gone = await loop.run_in_executor(self.reaper_pool, self.core.reap_expired)
            except Exception as e:  # noqa: BLE001 - a failed round is retried; a dead reaper would
                # let every sandbox outlive its end time
                log.error("e2b: reaper round failed: %s: %s", type(e).__name__, e)
                gone = []
            for sid in gone:
                log.info("e2b: sandbox %s reached its end time: killed", sid)
            await asyncio.sleep(REAP_EVERY_S)

    def stop(self) -> None:
        self.server.stop()
        for pool in (*self.pools, self.reaper_pool):
            pool.shutdown(wait=False, cancel_futures=True)


CALL_MAX_BODY = 4 << 20      # a control-plane or envd RPC body; only an upload (POST /files) may be bigger


def body_limit(path: str) -> int:
    """Every body but an upload is a small JSON document: it may not take e2b.max_upload_mb."""
    return 1 << 62 if path == "/files" else CALL_MAX_BODY


def make_app(core: E2bCore, tokens, control_lanes: Lanes, envd_lanes: Lanes, *, tenants: dict,
             default_tenant: str, domain: str | None, audit_hook=None):
    kw = {"core": core, "tokens": tokens, "lanes": control_lanes, "tenants": tenants,
          "default_tenant": default_tenant, "domain": domain, "audit_hook": audit_hook}
    routes = [*control.ROUTES, ("/openapi.json", httpkit.openapi_handler(control.ControlBase, public=True))]
    app = httpkit.make_app(routes, base=control.ControlBase, kwargs=kw, params=PARAMS,
                           title="cubegate E2B-compatible API (control plane)", public_not_found=True,
                           log_name="cubegate.e2b")
    # envd speaks Connect, not JSON-API: its routes are served beside the document, not in it
    app.wildcard_router.add_rules([(httpkit.rule_regex(p, PARAMS), h, {**kw, "lanes": envd_lanes})
                                   for p, h in ENVD_ROUTES])
    return app


def admit(core: E2bCore, tokens, domain: str | None, tenants: dict, default_tenant: str):
    """The tenant whose valid API key, or whose sandbox's envd token, a request's headers hold
    (None: nobody's): only such a request may send more than a small body, and one tenant at
    most half of all bodies being read (httpkit.serve's admit)."""
    def check(headers) -> str | None:
        key = control.api_key(headers)
        actor = tokens.actor(key) if key else None
        if actor is not None:
            return tenants.get(actor, default_tenant)
        target = envd.target_of(headers, domain)
        rec = core.registry.get(target[0]) if target else None
        return rec.tenant if rec is not None and rec.token_ok(headers.get("X-Access-Token")) else None
    return check


def listen(app, core: E2bCore, tokens, *, port: int, max_upload_mb: int, domain: str | None, tenants: dict,
           default_tenant: str) -> httpkit.Server:
    return httpkit.serve(app, max_body=max_upload_mb << 20, host="127.0.0.1", port=port, what="the E2B API",
                         body_limit=body_limit, admit=admit(core, tokens, domain, tenants, default_tenant))


async def start_for(daemon, runtime) -> E2bService | None:
    s = daemon.settings
    e = s.e2b
    if not e.enabled or runtime is None:
        return None
    token_file = s.runtime_dir / "api.token"
    ensure_token_file(token_file, RUNTIME_TOKEN_PREFIX)
    core = E2bCore(runtime.manager, Registry(s.runtime_dir / "e2b"),
                   templates=templates.catalogue({k: v.model_dump(exclude_none=True) for k, v in e.templates.items()}),
                   default_backend=s.runtime.default_backend, default_limits=default_limits(s.runtime),
                   default_timeout=e.default_timeout_seconds, max_timeout=e.max_timeout_seconds, domain=e.domain)
    on_forget = getattr(runtime.manager.hooks, "on_forget", None)
    if on_forget is not None:
        on_forget(core.forget_sandbox)
    envd_pool = ThreadPoolExecutor(max_workers=ENVD_WORKERS, thread_name_prefix="e2b-envd")
    control_pool = ThreadPoolExecutor(max_workers=CONTROL_WORKERS, thread_name_prefix="e2b-control")
    reaper_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2b-reaper")
    tokens = TokenCheck(token_file, daemon.vault.tokens if daemon.vault is not None else None)
    app = make_app(core, tokens, Lanes(control_pool, CONTROL_LIMITS), Lanes(envd_pool, ENVD_LIMITS),
                   tenants=dict(e.token_tenants), default_tenant=e.tenant, domain=e.domain,
                   audit_hook=daemon._admin_audit)
    server = listen(app, core, tokens, port=e.port, max_upload_mb=e.max_upload_mb, domain=e.domain,
                    tenants=dict(e.token_tenants), default_tenant=e.tenant)
    log.info("e2b: API on 127.0.0.1:%d (tenant %s), templates %s", server.port, e.tenant, ", ".join(core.templates))
    svc = E2bService(core, server, [envd_pool, control_pool], reaper_pool)
    daemon.supervisor.start("e2b-reaper", svc.reaper())
    return svc


async def stop_for(svc: E2bService | None) -> None:
    if svc is not None:
        svc.stop()
