"""Admin HTTP API (tornado) for remote administration of a Vault.

Bearer tokens (TokenStore) with scopes: `read` for GET, `admin` for everything
else. Responses carry metadata only, never a value. Every request, allowed or
not, is reported to `audit_hook(record)`; records never contain a value.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
from typing import Any, Callable

import tornado.httpserver
import tornado.httputil
import tornado.netutil
import tornado.web

from .core import Vault
from .errors import (Conflict, InvalidBinding, InvalidName, InvalidValue, KeyFileError, NotFound,
                     VaultCorrupt, VaultError, VaultSealed, WrongMasterKey)
from .openapi import openapi_document
from .tokens import TokenInfo, TokenStore

log = logging.getLogger("cubegate.vault.api")
AuditHook = Callable[[dict], None]
DEFAULT_PORT = 8474
MAX_BODY = 1024 * 1024
_NAME = r"[a-z0-9][a-z0-9_.-]{0,63}"


class _ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, reasons: list[str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.reasons = status, code, message, reasons


_ERROR_MAP: list[tuple[type, int, str]] = [
    (NotFound, 404, "not_found"), (Conflict, 409, "conflict"), (InvalidBinding, 400, "invalid_binding"),
    (InvalidName, 400, "invalid_name"), (InvalidValue, 400, "invalid_value"),
    (WrongMasterKey, 400, "wrong_master_key"), (KeyFileError, 400, "key_error"),
    (VaultSealed, 503, "sealed"), (VaultCorrupt, 500, "vault_corrupt"), (VaultError, 500, "vault_error"),
]


class _Base(tornado.web.RequestHandler):
    action = "unknown"

    def initialize(self, vault: Vault, tokens: TokenStore, audit_hook: AuditHook | None) -> None:
        self.vault, self.tokens, self.audit_hook = vault, tokens, audit_hook
        self.actor: TokenInfo | None = None
        self.audit: dict[str, Any] = {}
        self.reason: str | None = None

    # -- auth ----------------------------------------------------------------
    def prepare(self) -> None:
        method = self.request.method.lower()
        self.action = f"{type(self).action}.{method}"
        header = self.request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        info = self.tokens.verify(token.strip()) if scheme.lower() == "bearer" else None
        if info is None:
            self.set_header("WWW-Authenticate", 'Bearer realm="cubegate-vault"')
            raise _ApiError(401, "unauthorized", "missing, invalid or expired bearer token")
        self.actor = info
        needed = "read" if self.request.method in ("GET", "HEAD") else "admin"
        if needed == "admin" and info.scope != "admin":
            raise _ApiError(403, "forbidden", f"token scope {info.scope!r} cannot {self.request.method}")

    # -- helpers -----------------------------------------------------------------
    def body(self) -> dict:
        try:
            doc = json.loads(self.request.body or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise _ApiError(400, "bad_json", "request body is not valid JSON") from None
        if not isinstance(doc, dict):
            raise _ApiError(400, "bad_json", "request body must be a JSON object")
        return doc

    def reply(self, status: int, doc: Any = None) -> None:
        self.set_status(status)
        if doc is None:
            self.finish()
        else:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(doc))

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.clear_header("Server")

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, _ApiError):
            err = e
        elif isinstance(e, tornado.web.HTTPError):
            err = _ApiError(e.status_code, "http_error", tornado.httputil.responses.get(e.status_code, "error"))
        else:
            for exc_type, status, code in _ERROR_MAP:
                if isinstance(e, exc_type):
                    err = _ApiError(status, code, str(e), getattr(e, "reasons", None))
                    break
            else:
                if isinstance(e, ValueError):
                    err = _ApiError(400, "invalid", str(e))
                else:
                    # never log the exception text or traceback locals: they may hold request data
                    log.error("vault admin API: internal error %s in %s", type(e).__name__, self.action)
                    err = _ApiError(500, "internal", "internal error")
        if self._finished:
            return
        self.reason = err.message
        self.clear()
        self.set_default_headers()
        if err.status == 401:
            self.set_header("WWW-Authenticate", 'Bearer realm="cubegate-vault"')
        doc = {"error": err.code, "message": err.message}
        if err.reasons:
            doc["reasons"] = err.reasons
        self.reply(err.status, doc)

    def write_error(self, status_code: int, **kwargs: Any) -> None:  # e.g. 405, 413
        self.reply(status_code, {"error": "http_error",
                                 "message": tornado.httputil.responses.get(status_code, "error")})

    def on_finish(self) -> None:
        if self.audit_hook is None:
            return
        status = self.get_status()
        record = {"event": "admin", "action": self.action,
                  "tenant": self.audit.get("tenant"), "secret_id": self.audit.get("secret_id"),
                  "version": self.audit.get("version"), "binding_id": self.audit.get("binding_id"),
                  "actor": self.actor.id if self.actor else None, "status": status,
                  "outcome": "ok" if status < 400 else ("denied" if status in (401, 403) else "error"),
                  "reason": self.reason, "remote": self.request.remote_ip}
        try:
            self.audit_hook(record)
        except Exception as e:  # the action is done; make the failure visible
            log.error("vault admin API: audit hook failed: %s", type(e).__name__)


class SecretsHandler(_Base):
    action = "secrets"

    def get(self) -> None:
        tenant = self.get_query_argument("tenant", None)
        self.audit["tenant"] = tenant
        self.reply(200, {"secrets": [s.to_dict() for s in self.vault.list_secrets(tenant)]})

    def post(self) -> None:
        doc = self.body()
        tenant, sid = doc.get("tenant"), doc.get("id")
        self.audit.update(tenant=tenant, secret_id=sid)
        if not isinstance(doc.get("value"), str):
            raise _ApiError(400, "invalid_value", "'value' (string) is required")
        info = self.vault.put_secret(tenant, sid, doc["value"], description=str(doc.get("description", "")))
        self.audit["version"] = info.current_version
        self.reply(201, info.to_dict())


class SecretHandler(_Base):
    action = "secret"

    def get(self, tenant: str, sid: str) -> None:
        self.audit.update(tenant=tenant, secret_id=sid)
        self.reply(200, self.vault.get_secret(tenant, sid).to_dict())

    def delete(self, tenant: str, sid: str) -> None:
        self.audit.update(tenant=tenant, secret_id=sid)
        self.vault.delete_secret(tenant, sid)
        self.reply(204)


class RotateHandler(_Base):
    action = "secret.rotate"

    def post(self, tenant: str, sid: str) -> None:
        self.audit.update(tenant=tenant, secret_id=sid)
        doc = self.body()
        if not isinstance(doc.get("value"), str):
            raise _ApiError(400, "invalid_value", "'value' (string) is required")
        info = self.vault.rotate(tenant, sid, doc["value"], previous=doc.get("previous", "disable"))
        self.audit["version"] = info.current_version
        self.reply(200, info.to_dict())


def _version_handler(state: str) -> type[_Base]:
    op = {"disable": Vault.disable_version, "enable": Vault.enable_version, "destroy": Vault.destroy_version}[state]

    class VersionHandler(_Base):
        action = f"version.{state}"

        def post(self, tenant: str, sid: str, version: str) -> None:
            self.audit.update(tenant=tenant, secret_id=sid, version=int(version))
            self.reply(200, op(self.vault, tenant, sid, int(version)).to_dict())

    VersionHandler.__name__ = f"Version{state.capitalize()}Handler"
    return VersionHandler


class BindingsHandler(_Base):
    action = "bindings"

    def get(self) -> None:
        tenant = self.get_query_argument("tenant", None)
        self.audit["tenant"] = tenant
        self.reply(200, {"bindings": [b.to_dict() for b in self.vault.list_bindings(tenant)]})

    def post(self) -> None:
        doc = self.body()
        self.audit.update(tenant=doc.get("tenant"), secret_id=doc.get("secret_id"), binding_id=doc.get("id"))
        self.reply(201, self.vault.add_binding(doc).to_dict())


class BindingHandler(_Base):
    action = "binding"

    def get(self, bid: str) -> None:
        self.audit["binding_id"] = bid
        self.reply(200, self.vault.get_binding(bid).to_dict())

    def delete(self, bid: str) -> None:
        self.audit["binding_id"] = bid
        self.vault.remove_binding(bid)
        self.reply(204)


def _status(vault: Vault) -> dict:
    return vault.status()


class SealHandler(_Base):
    action = "seal"

    def post(self) -> None:
        self.vault.seal()
        self.reply(200, _status(self.vault))


class UnsealHandler(_Base):
    action = "unseal"

    async def post(self) -> None:
        doc = self.body()
        if isinstance(doc.get("key_file"), str):
            fn, arg = self.vault.unseal_with_key_file, doc["key_file"]
        elif isinstance(doc.get("passphrase"), str):
            fn, arg = self.vault.unseal_with_passphrase, doc["passphrase"]
        else:
            raise _ApiError(400, "invalid", "give 'key_file' (server path) or 'passphrase'")
        await asyncio.get_running_loop().run_in_executor(None, fn, arg)  # scrypt takes ~0.1 s
        self.reply(200, _status(self.vault))


class StatusHandler(_Base):
    action = "status"

    def get(self) -> None:
        self.reply(200, _status(self.vault))


class OpenAPIHandler(_Base):
    action = "openapi"

    def get(self) -> None:
        self.reply(200, openapi_document())


def _path(p: str) -> str:
    """OpenAPI path template -> tornado regex ("{version}" numeric, other params names)."""
    return re.sub(r"\{(\w+)\}", lambda m: r"([0-9]{1,9})" if m.group(1) == "version" else f"({_NAME})", p) + "$"


# (OpenAPI path, handler): the single source of the routes
ROUTES: list[tuple[str, type[_Base]]] = [
    ("/v1/secrets", SecretsHandler),
    ("/v1/secrets/{tenant}/{id}", SecretHandler),
    ("/v1/secrets/{tenant}/{id}/rotate", RotateHandler),
    *[(f"/v1/secrets/{{tenant}}/{{id}}/versions/{{version}}/{s}", _version_handler(s))
      for s in ("disable", "enable", "destroy")],
    ("/v1/bindings", BindingsHandler),
    ("/v1/bindings/{id}", BindingHandler),
    ("/v1/seal", SealHandler),
    ("/v1/unseal", UnsealHandler),
    ("/v1/status", StatusHandler),
    ("/v1/openapi.json", OpenAPIHandler),
]


class _NotFoundHandler(_Base):
    action = "not_found"

    def prepare(self) -> None:
        super().prepare()  # unauthenticated callers learn nothing about routes
        raise _ApiError(404, "not_found", "no such endpoint")


def make_app(vault: Vault, tokens: TokenStore | None = None, *,
             audit_hook: AuditHook | None = None) -> tornado.web.Application:
    """The admin API as a tornado Application (not yet listening)."""
    kw = {"vault": vault, "tokens": tokens if tokens is not None else vault.tokens, "audit_hook": audit_hook}
    handlers = [(_path(p), h, kw) for p, h in ROUTES]
    return tornado.web.Application(handlers, default_handler_class=_NotFoundHandler, default_handler_args=kw,
                                   compress_response=False, xsrf_cookies=False, log_function=_log_request)


def _log_request(handler: tornado.web.RequestHandler) -> None:
    # Not tornado's default (5xx at ERROR): an embedding daemon may treat ERROR as fatal.
    # Only method, path and status are logged: never a body (values live there).
    logging.getLogger("vault.api").info("%s %s %s", handler.get_status(), handler.request.method,
                                        handler.request.path)


def check_bind_address(host: str, allow_non_loopback: bool = False) -> None:
    """Refuse anything but a loopback address unless explicitly allowed."""
    if allow_non_loopback or host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"refusing to bind the vault admin API to {host!r}: not a loopback address "
                         "(pass allow_non_loopback=True to override)")


class AdminServer:
    def __init__(self, server: tornado.httpserver.HTTPServer, sockets: list, unix_socket: str | None):
        self.server, self.sockets, self.unix_socket = server, sockets, unix_socket

    @property
    def port(self) -> int | None:
        for s in self.sockets:
            addr = s.getsockname()
            if isinstance(addr, tuple):
                return addr[1]
        return None

    def stop(self) -> None:
        self.server.stop()
        if self.unix_socket:
            try:
                os.unlink(self.unix_socket)
            except FileNotFoundError:
                pass


def serve(vault: Vault, host: str = "127.0.0.1", port: int = DEFAULT_PORT, unix_socket: str | None = None, *,
          tokens: TokenStore | None = None, audit_hook: AuditHook | None = None,
          allow_non_loopback: bool = False) -> AdminServer:
    """Start listening on the current asyncio loop (call from inside it); returns the server.

    With `unix_socket` only that socket (mode 0600) is bound; otherwise host:port,
    which must be loopback unless allow_non_loopback=True. port=0 picks a free port.
    """
    app = make_app(vault, tokens, audit_hook=audit_hook)
    server = tornado.httpserver.HTTPServer(app, max_body_size=MAX_BODY, xheaders=False)
    if unix_socket:
        sockets = [tornado.netutil.bind_unix_socket(unix_socket, mode=0o600)]
    else:
        check_bind_address(host, allow_non_loopback)
        sockets = tornado.netutil.bind_sockets(port, address=host)
    server.add_sockets(sockets)
    return AdminServer(server, sockets, unix_socket)
