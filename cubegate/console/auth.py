"""Log in with a vault token, log out. Both are state changes: CSRF-checked and audited."""
from __future__ import annotations

import time

from httpkit import ApiError

from .base import ConsoleHandler

FAILURES_PER_MINUTE = 20   # more failed logins than this in a minute: wrong tokens get 429 for a while


class LoginHandler(ConsoleHandler):
    action = "console.login"
    public = True
    template = None

    def get(self) -> None:
        if self.session is not None:
            self.redirect("/")
            return
        self._login_page(200)

    def _login_page(self, status: int, error: str | None = None) -> None:
        self.set_status(status)
        self.render("login.html", login_csrf=self.login_csrf(), error=error)

    def post(self) -> None:
        self.check_login_csrf()
        token = self.get_body_argument("token", "", strip=True)
        info = self.login_tokens.verify(token) if token else None
        if info is None:
            # Every client is loopback: the count is everyone's, so it holds off wrong tokens
            # only — a valid one always logs in (else anyone could keep the operators out).
            recent = self._recent_failures()
            if len(recent) >= FAILURES_PER_MINUTE:
                self.reason = "too many failed logins"
                self._login_page(429, "Too many failed logins in the last minute: wait and try again.")
                return
            recent.append(time.monotonic())
            self.reason = "invalid, expired or missing token"
            self._login_page(401, "That token is not valid (wrong, revoked or expired).")
            return
        self.start_session(info.id, info.scope)
        self.redirect("/", status=303)

    def _recent_failures(self) -> list:
        now = time.monotonic()
        recent = self.ctx.login_failures
        recent[:] = [t for t in recent if now - t < 60.0][-FAILURES_PER_MINUTE:]
        return recent

    def send_error_reply(self, err: ApiError) -> None:   # e.g. the login CSRF check
        self.set_status(err.status)
        self.render("login.html", login_csrf=self.login_csrf(), error=err.message)


class LogoutHandler(ConsoleHandler):
    action = "console.logout"
    SUPPORTED_METHODS = ("POST",)

    def authorize(self) -> None:   # read-scope sessions may log out too
        pass

    def post(self) -> None:
        self.end_session()
        self.redirect("/login", status=303)
