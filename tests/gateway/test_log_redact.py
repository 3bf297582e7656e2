"""Engine log lines never carry request or response bytes."""
from __future__ import annotations

import io
import logging

from egress import log_redact

KEY = "sk-live-7f3a9c1e5b2d4a6f8e0c"


def _capture(logger_name: str, emit) -> str:
    buf = io.StringIO()
    root = logging.Logger("test-root")
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    log_redact.install(root)
    logger = logging.Logger(logger_name)
    logger.addHandler(handler)
    emit(logger)
    return buf.getvalue()


def test_quoted_bytes_in_engine_messages_are_removed():
    out = _capture("mitmproxy.proxy.server", lambda lg: lg.warning(
        "HTTP/1 protocol error: Invalid header name b'x-%s\\x00'" % KEY))
    assert KEY not in out and "sk-live" not in out
    assert "protocol error" in out


def test_tracebacks_of_engine_errors_are_dropped_with_their_locals():
    def emit(lg):
        try:
            raise ValueError(f"decode failed near {KEY!r}")
        except ValueError:
            lg.exception("Addon error: %s", f"body={KEY.encode()!r}")
    out = _capture("mitmproxy.addonmanager", emit)
    assert KEY not in out and "sk-live" not in out
    assert "Addon error" in out and "[ValueError]" in out and "Traceback" not in out


def test_format_args_are_redacted_too_and_only_the_first_line_kept():
    out = _capture("mitmproxy.proxy.layers.http", lambda lg: lg.info("peer sent %r\nsecond %s", KEY.encode(), KEY))
    assert KEY not in out and "second" not in out


def test_our_own_loggers_are_untouched():
    out = _capture("cubegate.gate", lambda lg: lg.warning("policy %s reloaded", "'quoted'"))
    assert "'quoted'" in out


def test_library_loggers_lose_their_arguments():
    # hpack at DEBUG: "Adding b'authorization'=b'Bearer <key>' to the header table"
    out = _capture("hpack.hpack", lambda lg: lg.warning("Adding %s=%s to the header table", "authorization",
                                                         f"Bearer {KEY}"))
    assert KEY not in out and "sk-live" not in out
    assert "to the header table" in out


def test_an_exceptions_unquoted_text_never_reaches_the_line():
    def emit(lg):
        try:
            raise ValueError(f"bad value Bearer {KEY} in header")
        except ValueError as e:
            lg.error(f"Addon error: {e}", exc_info=True)
    out = _capture("mitmproxy.addonmanager", emit)
    assert KEY not in out and "sk-live" not in out
    assert "Addon error [ValueError]" in out


def test_a_logged_object_is_named_by_its_type_only():
    out = _capture("tornado.general", lambda lg: lg.error(ValueError(f"header Bearer {KEY}")))
    assert KEY not in out and "ValueError" in out
