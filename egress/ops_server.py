"""/healthz, /readyz and /metrics on a host-only port.

/healthz answers "is the process up"; /readyz answers "may traffic be sent
here": every registered check must pass (policy loaded, CA present,
listeners bound, audit writable, ...). A check that raises counts as failed.
"""
from __future__ import annotations

import logging
from typing import Callable

import httpkit
from httpkit import JsonHandler, Reply, operation

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


MAX_BODY = 64 * 1024   # only GETs here


class Health(Reply):
    status: str


class CheckResult(Reply):
    ok: bool
    detail: str


class ReadyReply(Reply):
    ready: bool
    checks: dict[str, CheckResult]


class _Base(JsonHandler):
    public = True   # host-only port, nothing secret: probes and Prometheus carry no token

    def initialize(self, readiness: Readiness, render: Callable[[], bytes]) -> None:
        super().initialize()
        self.readiness, self.render_metrics = readiness, render


class _Health(_Base):
    @operation("Is the process up", reply=Health)
    def get(self) -> None:
        self.reply(200, {"status": "up"})


class _Ready(_Base):
    @operation("May traffic be sent here: 200 when every check passes, else 503 (same body)", reply=ReadyReply,
               errors=(503,))
    def get(self) -> None:
        ready, results = self.readiness.evaluate()
        self.reply(200 if ready else 503, {"ready": ready, "checks": results})


class _Metrics(_Base):
    @operation("Prometheus metrics", reply_media="text/plain; version=0.0.4")
    def get(self) -> None:
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(self.render_metrics())


ROUTES = [("/healthz", _Health), ("/readyz", _Ready), ("/metrics", _Metrics),
          ("/openapi.json", httpkit.openapi_handler(_Base, public=True))]


def make_app(readiness: Readiness, render_metrics: Callable[[], bytes]):
    # tornado logs 5xx at ERROR; mitmproxy's errorcheck treats any ERROR during
    # startup as fatal, and /readyz answers 503 by design then. Log at DEBUG.
    return httpkit.make_app(ROUTES, base=_Base, kwargs={"readiness": readiness, "render": render_metrics},
                            title="cubegate ops", log_name="cubegate.ops", log_level=logging.DEBUG)


def start_ops_server(host: str, port: int, readiness: Readiness,
                     render_metrics: Callable[[], bytes]) -> httpkit.Server:
    # any address settings.ops.listen_host names (Prometheus may scrape from elsewhere)
    return httpkit.serve(make_app(readiness, render_metrics), max_body=MAX_BODY, host=host, port=port,
                         loopback_only=False)
