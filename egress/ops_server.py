"""/healthz, /readyz and /metrics on a host-only port.

/healthz answers "is the process up"; /readyz answers "may traffic be sent
here": every registered check must pass (policy loaded, CA present,
listeners bound, audit writable, ...). A check that raises counts as failed.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

import tornado.web
from tornado.httpserver import HTTPServer

Check = Callable[[], tuple[bool, str]]


class Readiness:
    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}

    def add(self, name: str, check: Check) -> None:
        self._checks[name] = check

    def evaluate(self) -> tuple[bool, dict[str, dict]]:
        results = {}
        for name, check in self._checks.items():
            try:
                ok, detail = check()
            except Exception as e:  # a broken check means "not ready", never "ready"
                ok, detail = False, f"check failed: {type(e).__name__}: {e}"
            results[name] = {"ok": bool(ok), "detail": detail}
        ready = bool(results) and all(r["ok"] for r in results.values())
        return ready, results


class _Health(tornado.web.RequestHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"status": "up"}))


class _Ready(tornado.web.RequestHandler):
    def initialize(self, readiness: Readiness) -> None:
        self.readiness = readiness

    def get(self) -> None:
        ready, results = self.readiness.evaluate()
        self.set_status(200 if ready else 503)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"ready": ready, "checks": results}, indent=1))


class _Metrics(tornado.web.RequestHandler):
    def initialize(self, render: Callable[[], bytes]) -> None:
        self.render_metrics = render

    def get(self) -> None:
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.write(self.render_metrics())


def _log_request(handler: tornado.web.RequestHandler) -> None:
    logging.getLogger("cubegate.ops").debug("%s %s %s", handler.get_status(), handler.request.method,
                                             handler.request.uri)


def start_ops_server(host: str, port: int, readiness: Readiness, render_metrics: Callable[[], bytes]) -> HTTPServer:
    # tornado logs 5xx at ERROR; mitmproxy's errorcheck treats any ERROR during
    # startup as fatal, and /readyz answers 503 by design then. Log at DEBUG.
    app = tornado.web.Application([
        (r"/healthz", _Health),
        (r"/readyz", _Ready, {"readiness": readiness}),
        (r"/metrics", _Metrics, {"render": render_metrics}),
    ], log_function=_log_request)
    server = HTTPServer(app, xheaders=False)
    server.listen(port, address=host)
    return server
