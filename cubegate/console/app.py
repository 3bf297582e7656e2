"""The console's routes and its tornado Application."""
from __future__ import annotations

import logging
from pathlib import Path

import tornado.web

from httpkit import ApiError, PublicStaticHandler
from httpkit.pages import security_headers

from sandbox_runtime.ids import SANDBOX_ID_RE
from vault.names import _NAME

from . import audit_pages, auth, overview, policies, sandboxes, vault_pages
from .base import ConsoleContext, ConsoleHandler, fmt_bytes, fmt_time

HERE = Path(__file__).parent
SANDBOX = f"(?P<id>{SANDBOX_ID_RE.pattern.strip('^$')})"
log = logging.getLogger("cubegate.console")


class NotFound(ConsoleHandler):
    action = "console.not_found"

    def prepare(self):
        super().prepare()
        if not self._finished:
            raise ApiError(404, "not_found", "no such page")


class NoFavicon(tornado.web.RequestHandler):
    def set_default_headers(self) -> None:
        security_headers(self)

    def get(self) -> None:
        self.set_status(204)


def routes() -> list:
    sid = SANDBOX
    return [
        (r"/", overview.OverviewPage),
        (r"/login", auth.LoginHandler),
        (r"/logout", auth.LogoutHandler),
        (r"/sandboxes", sandboxes.SandboxCreate),
        (rf"/sandboxes/{sid}", sandboxes.SandboxPage),
        (rf"/sandboxes/{sid}/exec", sandboxes.SandboxExec),
        (rf"/sandboxes/{sid}/destroy", sandboxes.SandboxDestroy),
        (r"/policies", policies.PoliciesPage),
        (r"/policies/new", policies.NewPolicy),
        (r"/policies/explain", policies.ExplainPage),
        (rf"/policies/(?P<name>{policies.NAME})", policies.PolicySave),
        (rf"/policies/(?P<name>{policies.NAME})/delete", policies.PolicyDelete),
        (rf"/policies/(?P<name>{policies.NAME})/rollback", policies.PolicyRollback),
        (r"/access/(?P<id>ar_[0-9a-f]{16})/approve", policies.AccessApprove),
        (r"/access/(?P<id>ar_[0-9a-f]{16})/deny", policies.AccessDeny),
        (rf"/grants/(?P<name>{policies.NAME})/revoke", policies.GrantRevoke),
        (r"/vault", vault_pages.VaultPage),
        (r"/vault/secrets", vault_pages.SecretPut),
        (rf"/vault/secrets/(?P<tenant>{_NAME.pattern})/(?P<id>{_NAME.pattern})/rotate", vault_pages.SecretRotate),
        (rf"/vault/secrets/(?P<tenant>{_NAME.pattern})/(?P<id>{_NAME.pattern})/versions/(?P<version>[0-9]{{1,9}})/"
         r"(?P<op>disable|enable|destroy)", vault_pages.VersionState),
        (r"/vault/bindings", vault_pages.BindingAdd),
        (rf"/vault/bindings/(?P<id>{_NAME.pattern})/delete", vault_pages.BindingDelete),
        (r"/vault/tokens/(?P<id>[a-z0-9]{12})/revoke", vault_pages.TokenRevoke),
        (r"/audit", audit_pages.AuditPage),
        (r"/audit/export", audit_pages.AuditExport),
        (r"/api/overview", overview.OverviewData),
        (r"/api/exec/(?P<job>[A-Za-z0-9_-]{1,32})/events", sandboxes.ExecEvents),
        (r"/api/audit/stream", audit_pages.AuditStream),
    ]


def make_app(ctx: ConsoleContext, audit_hook=None) -> tornado.web.Application:
    kw = {"sessions": ctx.sessions, "ctx": ctx, "audit_hook": audit_hook}

    def log_request(handler: tornado.web.RequestHandler) -> None:
        # method, path and status only: never a query (filters) or a body (secret values)
        log.debug("%s %s %s", handler.get_status(), handler.request.method, handler.request.path)

    rules = [(p + "$", h, kw) for p, h in routes()]
    # (a page's state change subclasses the page: SandboxCreate also serves GET /sandboxes)
    rules += [(r"/static/(.*)", PublicStaticHandler, {"path": str(HERE / "static")}),
              (r"/favicon\.ico", NoFavicon)]
    return tornado.web.Application(
        rules, default_handler_class=NotFound, default_handler_args=kw, template_path=str(HERE / "templates"),
        autoescape="xhtml_escape", compress_response=False, xsrf_cookies=False, log_function=log_request,
        ui_methods={"when": lambda _h, ts: fmt_time(ts), "size": lambda _h, n: fmt_bytes(n)},
        static_path=None)
