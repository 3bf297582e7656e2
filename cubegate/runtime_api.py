"""Sandbox REST API (tornado, loopback only, bearer tokens), served by the daemon.

    GET    /v1/sandboxes                      list
    POST   /v1/sandboxes                      create (201 when the agent answered and the network is attached)
    GET    /v1/sandboxes/{id}                 get (+ measured usage)
    DELETE /v1/sandboxes/{id}                 destroy (204)
    POST   /v1/sandboxes/{id}/exec            {argv, timeout, env, stdin_b64, cwd}
    POST   /v1/sandboxes/{id}/init            {env, files, secret_env}  idempotent
    PUT    /v1/sandboxes/{id}/files?path=P    raw body → file
    GET    /v1/sandboxes/{id}/files?path=P    file → raw body
    POST   /v1/sandboxes/{id}/pause | resume
    GET    /v1/openapi.json

Tokens: the daemon's runtime token file (created 0600 at first start) or a vault
admin token. Blocking backend calls run in a dedicated thread pool so a long
exec never stalls the gateway's event loop.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import tornado.httpserver
import tornado.netutil
import tornado.web

from sandbox_runtime.backend import Limits, NotSupported, SandboxError
from sandbox_runtime.capacity import CapacityError
from sandbox_runtime.manager import Conflict, CreateRequest, InvalidRequest, NotFound, SandboxManager

log = logging.getLogger("cubegate.runtime_api")
MAX_BODY = 48 * 1024 * 1024
_ID = r"([a-z0-9][a-z0-9-]{0,39})"
_ERRORS = [(NotFound, 404, "not_found"), (Conflict, 409, "conflict"), (InvalidRequest, 400, "invalid"),
           (CapacityError, 429, "capacity"), (NotSupported, 501, "not_supported"), (SandboxError, 500, "sandbox_error")]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def ensure_token_file(path: Path) -> None:
    """The local admin token: created once (0600), read by `cubegate sandbox ...`."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("cgrt_" + secrets.token_urlsafe(32) + "\n")


class TokenCheck:
    def __init__(self, token_file: Path, vault_tokens=None):
        self._hash = hashlib.sha256(token_file.read_text().strip().encode()).hexdigest()
        self._vault_tokens = vault_tokens

    def actor(self, token: str) -> str | None:
        if hmac.compare_digest(self._hash, hashlib.sha256(token.encode()).hexdigest()):
            return "local"
        if self._vault_tokens is not None:
            info = self._vault_tokens.verify(token)
            if info is not None and info.scope == "admin":
                return info.id
        return None


class _Base(tornado.web.RequestHandler):
    action = "sandbox"

    def initialize(self, manager: SandboxManager, tokens: TokenCheck, pool: ThreadPoolExecutor,
                   audit_hook: Callable[[dict], None] | None) -> None:
        self.manager, self.tokens, self.pool, self.audit_hook = manager, tokens, pool, audit_hook
        self.actor = None
        self.audit: dict[str, Any] = {}
        self.reason = None

    def prepare(self) -> None:
        self.action = f"{type(self).action}.{self.request.method.lower()}"
        scheme, _, token = self.request.headers.get("Authorization", "").partition(" ")
        self.actor = self.tokens.actor(token.strip()) if scheme.lower() == "bearer" and token else None
        if self.actor is None:
            self.set_header("WWW-Authenticate", 'Bearer realm="cubegate-runtime"')
            raise ApiError(401, "unauthorized", "missing or invalid bearer token")

    async def run(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kw))

    def body(self) -> dict:
        try:
            doc = json.loads(self.request.body or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "bad_json", "request body is not valid JSON") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "bad_json", "request body must be a JSON object")
        return doc

    def reply(self, status: int, doc: Any = None, compact: bool = False) -> None:
        self.set_status(status)
        if doc is None:
            self.finish()
        else:
            self.set_header("Content-Type", "application/json")
            # compact: no \uXXXX escapes (6 bytes per non-ASCII char) for large exec output
            self.finish(json.dumps(doc, ensure_ascii=not compact))

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.clear_header("Server")

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, ApiError):
            err = e
        elif isinstance(e, tornado.web.HTTPError):
            err = ApiError(e.status_code, "http_error", e.log_message or "error")
        else:
            for t, status, code in _ERRORS:
                if isinstance(e, t):
                    err = ApiError(status, code, str(e))
                    break
            else:
                log.error("runtime API: internal error %s in %s", type(e).__name__, self.action)
                err = ApiError(500, "internal", "internal error")
        if self._finished:
            return
        self.reason = err.message
        self.clear()
        self.set_default_headers()
        self.reply(err.status, {"error": err.code, "message": err.message})

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.reply(status_code, {"error": "http_error", "message": str(status_code)})

    def on_finish(self) -> None:
        if self.audit_hook is None or self.request.method == "GET":
            return
        status = self.get_status()
        try:
            self.audit_hook({"action": self.action, "actor": self.actor, "status": status,
                             "outcome": "ok" if status < 400 else ("denied" if status in (401, 403) else "error"),
                             "reason": self.reason, "remote": self.request.remote_ip, **self.audit})
        except Exception as e:  # noqa: BLE001
            log.error("runtime API: audit hook failed: %s", type(e).__name__)


def _utf8_or_none(data: bytes) -> str | None:
    """Text only when the bytes are valid UTF-8 (else use the *_b64 field): bounded size."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _str_dict(doc: dict, key: str) -> dict:
    v = doc.get(key, {})
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise ApiError(400, "invalid", f"{key} must be an object of strings")
    return v


def _files(doc: dict) -> dict[str, bytes]:
    out = {}
    for path, b64 in _str_dict(doc, "files").items():
        try:
            out[path] = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "invalid", f"files[{path!r}] must be base64") from None
    return out


def _limits(doc: dict, default: Limits) -> Limits:
    raw = doc.get("limits", {})
    if not isinstance(raw, dict):
        raise ApiError(400, "invalid", "limits must be an object")
    known = {"memory_mb": int, "cpus": float, "pids": int, "disk_mb": int}
    unknown = set(raw) - set(known)
    if unknown:
        raise ApiError(400, "invalid", f"limits: unknown key(s) {', '.join(sorted(unknown))}")
    vals = {}
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ApiError(400, "invalid", f"limits.{k} must be a positive number")
        vals[k] = known[k](v)
    return Limits(**{**default.__dict__, **vals})


def _template(doc: dict, default: str | None) -> str | None:
    t = doc.get("template", default)
    if t is not None and not isinstance(t, str):
        raise ApiError(400, "invalid", "template must be a string")
    return t


class SandboxesHandler(_Base):
    action = "sandbox"

    async def get(self) -> None:
        self.reply(200, {"sandboxes": await self.run(self.manager.list)})

    async def post(self) -> None:
        doc = self.body()
        sid, tenant = doc.get("id"), doc.get("tenant")
        self.audit.update(sandbox=sid, tenant=tenant)
        labels = _str_dict(doc, "labels")
        req = CreateRequest(sandbox_id=sid if isinstance(sid, str) else "",
                            tenant=tenant if isinstance(tenant, str) else "",
                            backend=str(doc.get("backend", self.settings["default_backend"])),
                            labels=labels, limits=_limits(doc, self.settings["default_limits"]),
                            env=_str_dict(doc, "env"), files=_files(doc), secret_env=_str_dict(doc, "secret_env"),
                            template=_template(doc, self.settings.get("default_template")))
        self.reply(201, await self.run(self.manager.create, req))


class SandboxHandler(_Base):
    action = "sandbox"

    async def get(self, sid: str) -> None:
        self.reply(200, await self.run(self.manager.get, sid))

    async def delete(self, sid: str) -> None:
        self.audit["sandbox"] = sid
        await self.run(self.manager.destroy, sid)
        self.reply(204)


class ExecHandler(_Base):
    action = "sandbox.exec"

    async def post(self, sid: str) -> None:
        doc = self.body()
        argv = doc.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ApiError(400, "invalid", "argv must be a non-empty list of strings")
        timeout = doc.get("timeout", 30)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ApiError(400, "invalid", "timeout must be a number of seconds")
        try:
            stdin = base64.b64decode(doc.get("stdin_b64", ""), validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise ApiError(400, "invalid", "stdin_b64 must be base64") from None
        cwd = doc.get("cwd", "/workspace")
        if not isinstance(cwd, str):
            raise ApiError(400, "invalid", "cwd must be a string")
        self.audit.update(sandbox=sid, program=argv[0])   # not the arguments: they may carry data
        res = await self.run(self.manager.exec, sid, argv, timeout=float(timeout), env=_str_dict(doc, "env"),
                             stdin=stdin, cwd=cwd)
        self.audit["exit_code"] = res.exit_code
        self.reply(200, {"exit_code": res.exit_code, "timed_out": res.timed_out,
                         "duration_s": round(res.duration_s, 4),
                         "stdout": _utf8_or_none(res.stdout), "stderr": _utf8_or_none(res.stderr),
                         "stdout_b64": base64.b64encode(res.stdout).decode(),
                         "stderr_b64": base64.b64encode(res.stderr).decode()}, compact=True)


class InitHandler(_Base):
    action = "sandbox.init"

    async def post(self, sid: str) -> None:
        doc = self.body()
        self.audit["sandbox"] = sid
        self.reply(200, await self.run(self.manager.init, sid, env=_str_dict(doc, "env"), files=_files(doc),
                                       secret_env=_str_dict(doc, "secret_env")))


class FilesHandler(_Base):
    action = "sandbox.files"

    def _path(self) -> str:
        path = self.get_query_argument("path", "")
        if not path.startswith("/") or "\0" in path:
            raise ApiError(400, "invalid", "path must be an absolute path inside the sandbox")
        return path

    async def get(self, sid: str) -> None:
        data = await self.run(self.manager.read_file, sid, self._path())
        self.set_header("Content-Type", "application/octet-stream")
        self.finish(data)

    async def put(self, sid: str) -> None:
        path = self._path()
        self.audit.update(sandbox=sid, path=path)
        await self.run(self.manager.write_file, sid, path, self.request.body)
        self.reply(204)


def _state_handler(op: str) -> type[_Base]:
    class StateHandler(_Base):
        action = f"sandbox.{op}"

        async def post(self, sid: str) -> None:
            self.audit["sandbox"] = sid
            self.reply(200, await self.run(getattr(self.manager, op), sid))
    StateHandler.__name__ = f"{op.capitalize()}Handler"
    return StateHandler


class OpenApiHandler(_Base):
    def prepare(self) -> None:  # the document is public: it holds no data
        pass

    def get(self) -> None:
        from cubegate.runtime_openapi import openapi_document
        self.reply(200, openapi_document())


class _NotFound(_Base):
    def prepare(self) -> None:
        raise ApiError(404, "not_found", "no such endpoint")


ROUTES = [
    (r"/v1/sandboxes", SandboxesHandler),
    (rf"/v1/sandboxes/{_ID}", SandboxHandler),
    (rf"/v1/sandboxes/{_ID}/exec", ExecHandler),
    (rf"/v1/sandboxes/{_ID}/init", InitHandler),
    (rf"/v1/sandboxes/{_ID}/files", FilesHandler),
    (rf"/v1/sandboxes/{_ID}/pause", _state_handler("pause")),
    (rf"/v1/sandboxes/{_ID}/resume", _state_handler("resume")),
    (r"/v1/openapi.json", OpenApiHandler),
]


def _log_request(handler) -> None:
    # Not tornado's default (5xx at ERROR): mitmproxy's errorcheck treats ERROR at startup as fatal.
    logging.getLogger("cubegate.runtime_api").info("%s %s %s", handler.get_status(), handler.request.method,
                                                   handler.request.path)


class RuntimeServer:
    def __init__(self, server, sockets, pool):
        self.server, self.sockets, self.pool = server, sockets, pool

    @property
    def port(self) -> int:
        return self.sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)


def serve(manager: SandboxManager, *, host: str, port: int, token_file: Path, vault_tokens=None,
          audit_hook=None, default_backend: str = "namespace", default_limits: Limits = Limits(),
          workers: int = 64, default_template: str | None = None) -> RuntimeServer:
    from vault.api import check_bind_address
    check_bind_address(host)   # loopback only: sandboxes must never reach it
    ensure_token_file(token_file)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="runtime")
    kw = {"manager": manager, "tokens": TokenCheck(token_file, vault_tokens), "pool": pool, "audit_hook": audit_hook}
    app = tornado.web.Application([(p, h, kw) for p, h in ROUTES], default_handler_class=_NotFound,
                                  default_handler_args=kw, log_function=_log_request,
                                  default_backend=default_backend, default_limits=default_limits,
                                  default_template=default_template)
    server = tornado.httpserver.HTTPServer(app, max_body_size=MAX_BODY)
    sockets = tornado.netutil.bind_sockets(port, address=host)
    server.add_sockets(sockets)
    return RuntimeServer(server, sockets, pool)
