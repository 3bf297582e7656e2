"""The console's handler base: vault-token sessions, read-only scope, audit records, pages.

Login is with a vault admin API token (`cubegate vault token create`); the session
remembers the token's id (the audit actor), never the token. Every request re-checks
that the token still exists and has not expired, so revoking it ends its sessions.
`read` tokens see everything and change nothing.

A page handler renders a template; when one of its state changes fails, the same page
is rendered again with the error in place (and the request's real status), never a
value that was typed into a secret field.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from httpkit import ApiError, SessionHandler, SessionStore

import vault as vaultlib
from vault import errors as verr
from sandbox_runtime import manager as sm
from sandbox_runtime.capacity import CapacityError

from .charts import Ring
from .exec_jobs import ExecJobs

NAV = (("/", "Overview"), ("/sandboxes", "Sandboxes"), ("/policies", "Policies"), ("/vault", "Vault"),
       ("/audit", "Audit"))
ERROR_MAP = [
    (verr.NotFound, 404, "not_found"), (verr.Conflict, 409, "conflict"), (verr.InvalidBinding, 400, "invalid_binding"),
    (verr.InvalidName, 400, "invalid_name"), (verr.InvalidValue, 400, "invalid_value"),
    (verr.VaultSealed, 503, "sealed"), (verr.VaultError, 500, "vault_error"),
    (sm.NotFound, 404, "not_found"), (sm.Conflict, 409, "conflict"), (sm.InvalidRequest, 400, "invalid"),
    (CapacityError, 429, "capacity"), (sm.NotSupported, 501, "not_supported"), (sm.Unavailable, 503, "unavailable"),
    (sm.SandboxError, 500, "sandbox_error"), (OverflowError, 429, "busy"), (ValueError, 400, "invalid"),
]


def known_error_text(e: BaseException) -> str:
    """What a failed background action (an exec) shows: a mapped error's message, else nothing of it."""
    if isinstance(e, ApiError):
        return e.message
    for exc_type, _, _ in ERROR_MAP:
        if isinstance(e, exc_type):
            return str(e)
    return "internal error"


@dataclasses.dataclass
class Runtime:
    manager: sm.SandboxManager
    backends: tuple[str, ...]
    default_backend: str
    default_limits: Any            # sandbox_runtime.backend.Limits


@dataclasses.dataclass
class ConsoleContext:
    vault: vaultlib.Vault
    sessions: SessionStore
    readiness: Any                 # egress.ops_server.Readiness
    ring: Ring
    audit_index: Any               # egress.audit.index.AuditIndex
    audit_dir: Path
    runtime: Runtime | None
    pool: ThreadPoolExecutor
    jobs: ExecJobs
    capacity: Callable[[], dict]
    policies: Any = None           # egress.policy.live.LivePolicies
    access: Any = None             # cubegate.access_store.AccessStore
    tokens: Any = None             # who may log in: the vault's tokens minus tenants' E2B keys (tenant_keys.py)
    max_streams: int = 16
    streams: int = 0
    login_failures: list = dataclasses.field(default_factory=list)   # monotonic times of recent failures


class ConsoleHandler(SessionHandler):
    cookie = "cubegate_console"
    kind = "page"              # page: HTML, redirect to /login; api: JSON, 401
    template: str | None = None  # the page a failed state change is shown on again
    error_map = ERROR_MAP

    def initialize(self, sessions: SessionStore, ctx: ConsoleContext, audit_hook=None) -> None:
        super().initialize(sessions, audit_hook)
        self.ctx = ctx
        self.form_values: dict[str, str] = {}    # fields to put back into a failed form (never secret fields)

    # -- auth ----------------------------------------------------------------
    def session_valid(self, session) -> bool:
        now = time.time()
        return any(t.id == session.actor and not t.expired(now) for t in self.login_tokens.list())

    @property
    def login_tokens(self):
        return self.ctx.tokens if self.ctx.tokens is not None else self.ctx.vault.tokens

    def authorize(self) -> None:
        if self.request.method not in ("GET", "HEAD") and self.session.scope != "admin":
            raise ApiError(403, "forbidden", "this session's token has the read scope: it cannot change anything")

    def unauthenticated(self) -> None:
        if self.kind == "page" and self.request.method in ("GET", "HEAD"):
            self.redirect("/login")
            return
        raise ApiError(401, "unauthenticated", "not logged in, or the session expired")

    # -- audit -----------------------------------------------------------------
    audit_reads = False        # GET requests are recorded too (the export)

    def audit_record(self) -> dict | None:
        if self.request.method in ("GET", "HEAD") and not self.audit_reads:
            return None
        return {"action": self.action, "actor": self.actor, "status": self.get_status(), "outcome": self.outcome(),
                "reason": self.reason, "remote": self.request.remote_ip, **self.audit}

    # -- helpers -----------------------------------------------------------------
    async def run(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(self.ctx.pool, lambda: fn(*args, **kw))

    def form(self, *names: str, secret: tuple[str, ...] = ()) -> dict[str, str]:
        """Body fields (missing = ""); those not in `secret` are kept to refill a failed form."""
        out = {n: self.get_body_argument(n, "", strip=n not in secret) for n in names}
        self.form_values = {k: v for k, v in out.items() if k not in secret}
        return out

    def send_json(self, doc: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(doc))

    def flash(self, message: str, kind: str = "ok") -> None:
        self.session.data["flash"] = (kind, message)

    def done(self, where: str, message: str) -> None:
        """A state change succeeded: say so on the next page (POST → redirect → GET)."""
        self.flash(message)
        self.redirect(where, status=303)

    async def page_context(self) -> dict:
        """The template's own values (pages override)."""
        return {}

    def get_template_namespace(self) -> dict:
        ns = super().get_template_namespace()
        ns.update(nav=NAV, path=self.request.path, session=self.session, flash=None, error=None,
                  form_values=self.form_values, readonly=self.session is not None and self.session.scope != "admin")
        return ns

    async def render_page(self, template: str, status: int = 200, error: str | None = None, **kw: Any) -> None:
        flash = self.session.data.pop("flash", None) if self.session is not None else None
        values = {**await self.page_context(), **kw}
        self.set_status(status)
        self.render(template, flash=flash, error=error, **values)

    def send_error_reply(self, err: ApiError) -> None:
        if self.kind != "page":
            return super().send_error_reply(err)
        if self.template is not None and self.session is not None and err.status not in (401, 403, 421):
            return asyncio.ensure_future(self._render_in_place(err))
        self.set_status(err.status)
        self.render("error.html", status=err.status, message=err.message)

    async def _render_in_place(self, err: ApiError) -> None:
        try:
            await self.render_page(self.template, status=err.status, error=err.message)
        except Exception:   # the page itself cannot be built: the plain error page
            if not self._finished:
                self.clear()
                self.set_default_headers()
                self.set_status(err.status)
                self.render("error.html", status=err.status, message=err.message)


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
