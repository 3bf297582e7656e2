"""SessionHandler: the base of browser-facing handlers (pages, their JSON, server-sent events).

The cookie-authenticated sibling of JsonHandler. For every request it does:
- security headers on every answer, errors included: a strict Content-Security-Policy
  (scripts, styles, images and connections from this origin only: no inline code),
  no framing, no referrer to other sites, no caching, no sniffing;
- the Host header must name this server (a DNS-rebinding page cannot talk to it);
- the session from its cookie (HttpOnly, SameSite=Strict, Secure and `__Host-` over TLS),
  re-checked by the app's `session_valid` (a revoked login ends its sessions);
- on every state change (anything but GET/HEAD) the session's CSRF token, from the form
  field `_csrf` or the `X-CSRF-Token` header, compared in constant time, and a
  cross-origin Origin header refused;
- exceptions mapped like JsonHandler's (ApiError as-is, anything unexpected a bare 500
  whose text is never sent or logged) and an audit record when the request finishes.

Login itself is a state change without a session yet: `login_csrf()` / `check_login_csrf()`
give it a double-submit token held in a short-lived cookie of its own.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
from typing import Any

import tornado.iostream
import tornado.web

from .audited import AuditedHandler, AuditHook
from .errors import ApiError, ErrorMap, phrase
from .session import Session, SessionStore

SAFE_METHODS = ("GET", "HEAD")
STRICT_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
              "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
LOGIN_CSRF_COOKIE = "login_csrf"


def loopback_host(host_name: str) -> bool:
    if host_name == "localhost":
        return True
    try:
        return ipaddress.ip_address(host_name.strip("[]")).is_loopback
    except ValueError:
        return False


def security_headers(handler: tornado.web.RequestHandler, csp: str = STRICT_CSP) -> None:
    handler.set_header("Content-Security-Policy", csp)
    handler.set_header("X-Content-Type-Options", "nosniff")
    handler.set_header("X-Frame-Options", "DENY")
    handler.set_header("Referrer-Policy", "same-origin")   # "no-referrer" makes Chromium send Origin: null
    handler.set_header("Cross-Origin-Opener-Policy", "same-origin")
    handler.set_header("Cross-Origin-Resource-Policy", "same-origin")
    handler.clear_header("Server")


class SessionHandler(AuditedHandler):
    action = "unknown"          # audit action (one handler = one action: name it fully)
    public = False              # True: no session needed (login page, static assets)
    touch = True                # False: a poll or stream, which must not keep an idle session alive
    cookie = "session"          # cookie name (`__Host-` prefixed over TLS)
    csrf_field, csrf_header = "_csrf", "X-CSRF-Token"
    csp = STRICT_CSP
    error_map: ErrorMap = ()

    def initialize(self, sessions: SessionStore, audit_hook: AuditHook | None = None, **_: Any) -> None:
        self.sessions, self.audit_hook = sessions, audit_hook
        self.session: Session | None = None
        self.actor: str | None = None
        self.audit: dict[str, Any] = {}
        self.reason: str | None = None
        self.events_open = False

    # -- the app's hooks -----------------------------------------------------
    def session_valid(self, session: Session) -> bool:
        """False ends the session (e.g. the token it was opened with was revoked or expired)."""
        return True

    def authorize(self) -> None:
        """Raise ApiError(403, ...) when the session may not do this request."""

    def unauthenticated(self) -> None:
        """No live session: by default 401; a page handler may redirect to its login page instead."""
        raise ApiError(401, "unauthenticated", "not logged in, or the session expired")

    def allowed_host(self, host_name: str) -> bool:
        return loopback_host(host_name)

    def send_error_reply(self, err: ApiError) -> None:
        """How an error is answered (JSON here; pages render HTML)."""
        self.set_status(err.status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(err.body()))

    # -- request ---------------------------------------------------------------
    @property
    def tls(self) -> bool:
        return self.request.protocol == "https"

    @property
    def cookie_name(self) -> str:
        return ("__Host-" if self.tls else "") + self.cookie

    def set_default_headers(self) -> None:
        security_headers(self, self.csp)
        self.set_header("Cache-Control", "no-store")

    def compute_etag(self) -> None:   # nothing here is cacheable (no-store)
        return None

    def prepare(self) -> Any:
        if not self.allowed_host(self.request.host_name):
            raise ApiError(421, "unknown_host", "this server does not answer for that host name")
        sid = self.get_cookie(self.cookie_name)
        self.session = self.sessions.get(sid, touch=self.touch)
        if self.session is not None and not self.session_valid(self.session):
            self.sessions.end(sid)
            self.session = None
        if self.session is not None:
            self.actor = self.session.actor
        if self.request.method not in SAFE_METHODS:
            self.check_origin()
        if self.public:
            return None
        if self.session is None:
            return self.unauthenticated()
        if self.request.method not in SAFE_METHODS:
            self.check_csrf()
        self.authorize()
        return None

    def check_origin(self) -> None:
        origin = self.request.headers.get("Origin")
        if origin is not None and origin != f"{self.request.protocol}://{self.request.host}":
            raise ApiError(403, "cross_origin", "cross-origin request refused")

    def presented_csrf(self) -> str | None:
        return self.request.headers.get(self.csrf_header) or self.get_body_argument(self.csrf_field, None)

    def check_csrf(self) -> None:
        if not self.session.csrf_ok(self.presented_csrf()):
            raise ApiError(403, "csrf", "missing or wrong CSRF token: reload the page and try again")

    # -- sessions ----------------------------------------------------------------
    def start_session(self, actor: str, scope: str) -> Session:
        """Log in: any previous session of this browser ends, a new id is issued (no fixation)."""
        self.sessions.end(self.get_cookie(self.cookie_name))
        sid, self.session = self.sessions.create(actor, scope)
        self.actor = actor
        self.set_cookie(self.cookie_name, sid, path="/", httponly=True, secure=self.tls, samesite="Strict")
        self.clear_cookie(self.login_cookie_name, path="/")
        return self.session

    def end_session(self) -> None:
        self.sessions.end(self.get_cookie(self.cookie_name))
        self.session = None
        self.clear_cookie(self.cookie_name, path="/", secure=self.tls, samesite="Strict")

    @property
    def login_cookie_name(self) -> str:
        return ("__Host-" if self.tls else "") + LOGIN_CSRF_COOKIE

    def login_csrf(self) -> str:
        """The login form's CSRF token (double submit: the same value in a cookie of its own)."""
        token = self.get_cookie(self.login_cookie_name)
        if not token or len(token) > 64:
            token = secrets.token_urlsafe(24)
            self.set_cookie(self.login_cookie_name, token, path="/", httponly=True, secure=self.tls,
                            samesite="Strict", max_age=3600)
        return token

    def check_login_csrf(self) -> None:
        cookie, presented = self.get_cookie(self.login_cookie_name), self.presented_csrf()
        if not cookie or not presented or not hmac.compare_digest(cookie.encode(), presented.encode()):
            raise ApiError(403, "csrf", "missing or wrong CSRF token: reload the login page and try again")

    # -- server-sent events ------------------------------------------------------
    def begin_events(self) -> None:
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("X-Accel-Buffering", "no")
        self.events_open = True

    async def send_event(self, data: Any, *, event: str | None = None) -> bool:
        """One event (data as JSON); False once the client has gone."""
        if not self.events_open:
            return False
        text = (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"
        return await self._flush_text(text)

    async def send_comment(self, text: str = "") -> bool:
        return await self._flush_text(f": {text}\n\n") if self.events_open else False

    async def _flush_text(self, text: str) -> bool:
        try:
            self.write(text)
            await self.flush()
            return True
        except tornado.iostream.StreamClosedError:
            self.events_open = False
            return False

    def on_connection_close(self) -> None:
        self.events_open = False
        super().on_connection_close()

    # -- errors ----------------------------------------------------------------
    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, tornado.iostream.StreamClosedError):
            self.events_open = False
            return
        err = self.api_error(e)
        self.reason = err.message
        if self._finished:
            return
        if self._headers_written:   # a stream already started: it can only be cut
            self.finish()
            return
        self.clear()
        self.set_default_headers()
        self.send_error_reply(err)

    def write_error(self, status_code: int, **kwargs: Any) -> None:   # what tornado itself refuses
        self.send_error_reply(ApiError(status_code, "http_error", phrase(status_code)))


class PublicStaticHandler(tornado.web.StaticFileHandler):
    """Static assets with the same security headers (no session: they hold nothing private)."""

    def set_default_headers(self) -> None:
        security_headers(self)

    def prepare(self) -> None:
        if not loopback_host(self.request.host_name) and not self.settings.get("httpkit_any_host"):
            raise tornado.web.HTTPError(421)
