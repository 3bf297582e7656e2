"""JsonHandler: the base of every JSON API handler.

It does, for every request: bearer auth (unless `public`), JSON replies,
exceptions mapped to the one error shape (never an internal's text), and an
audit record when the request finishes. An app subclasses it once to say how
tokens are checked, which domain errors map to which status, and what its
audit record holds; each route is then a small class with `@operation` methods.
"""
from __future__ import annotations

import json
import logging
import traceback
from typing import Any, Callable

import tornado.web
from pydantic import BaseModel

from .errors import ApiError, ErrorMap, phrase, to_api_error

AuditHook = Callable[[dict], None]
log = logging.getLogger("httpkit")


class JsonHandler(tornado.web.RequestHandler):
    action = "unknown"          # audit action; ".<method>" is appended per request
    public = False              # True: no token asked (e.g. the OpenAPI document)
    realm = "api"               # WWW-Authenticate realm on 401
    error_map: ErrorMap = ()    # domain exceptions -> (status, code)

    def initialize(self, audit_hook: AuditHook | None = None) -> None:
        self.audit_hook = audit_hook
        self.actor: Any = None
        self.audit: dict[str, Any] = {}     # fields the handler adds to its audit record
        self.reason: str | None = None      # the error message, for the audit record

    # -- the app's hooks -----------------------------------------------------
    def authenticate(self, token: str) -> Any:
        """The actor a bearer token stands for, or None (-> 401)."""
        return None

    def authorize(self) -> None:
        """Raise ApiError(403, ...) when self.actor may not do this request."""

    def audit_record(self) -> dict | None:
        """The record for audit_hook when the request is done (None: nothing to record)."""
        return None

    # -- request ---------------------------------------------------------------
    def prepare(self) -> None:
        self.action = f"{type(self).action}.{self.request.method.lower()}"
        if self.public:
            return
        scheme, _, token = self.request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        self.actor = self.authenticate(token) if scheme.lower() == "bearer" and token else None
        if self.actor is None:
            raise ApiError(401, "unauthorized", "missing, invalid or expired bearer token")
        self.authorize()

    def reply(self, status: int, doc: Any = None, *, compact: bool = False) -> None:
        """Finish with a JSON body (a dict or a model); None: no body. compact: no \\uXXXX escapes."""
        self.set_status(status)
        if doc is None:
            self.finish()
            return
        if isinstance(doc, BaseModel):
            doc = doc.model_dump(mode="json")
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(doc, ensure_ascii=not compact))

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.clear_header("Server")

    # -- errors ----------------------------------------------------------------
    def _handle_request_exception(self, e: BaseException) -> None:
        err = to_api_error(e, self.error_map)
        if err is None:
            # the type and where, never the text or locals: they may hold request data
            frame = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
            where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
            log.error("%s: internal error %s in %s%s", type(self).__module__, type(e).__name__, self.action, where)
            err = ApiError(500, "internal", "internal error")
        if self._finished:
            return
        self.reason = err.message
        self.clear()
        self.set_default_headers()
        if err.status == 401:
            self.set_header("WWW-Authenticate", f'Bearer realm="{self.realm}"')
        self.reply(err.status, err.body())

    def write_error(self, status_code: int, **kwargs: Any) -> None:   # what tornado itself refuses
        self.reply(status_code, {"error": "http_error", "message": phrase(status_code)})

    def on_finish(self) -> None:
        if self.audit_hook is None:
            return
        record = self.audit_record()
        if record is None:
            return
        try:
            self.audit_hook(record)
        except Exception as e:  # the action is done; make the failure visible
            log.error("%s: audit hook failed: %s", type(self).__module__, type(e).__name__)

    def outcome(self) -> str:
        status = self.get_status()
        return "ok" if status < 400 else ("denied" if status in (401, 403) else "error")


class NotFoundHandler(JsonHandler):
    """Unknown paths: 404 after the app's auth (unless public: the caller learns nothing of routes)."""
    action = "not_found"

    def prepare(self) -> None:
        super().prepare()
        raise ApiError(404, "not_found", "no such endpoint")
