"""JsonHandler: the base of every JSON API handler.

It does, for every request: bearer auth (unless `public`), JSON replies,
exceptions mapped to the one error shape (never an internal's text), and an
audit record when the request finishes. An app subclasses it once to say how
tokens are checked, which domain errors map to which status, and what its
audit record holds; each route is then a small class with `@operation` methods.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .audited import AuditedHandler, AuditHook
from .errors import ApiError, ErrorMap, phrase

__all__ = ["AuditHook", "JsonHandler", "NotFoundHandler"]


class JsonHandler(AuditedHandler):
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
        err = self.api_error(e)
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


class NotFoundHandler(JsonHandler):
    """Unknown paths: 404 after the app's auth (unless public: the caller learns nothing of routes)."""
    action = "not_found"

    def prepare(self) -> None:
        super().prepare()
        raise ApiError(404, "not_found", "no such endpoint")
