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


def test_our_own_exceptions_keep_the_message_but_not_the_exception_text():
    """Our loggers keep their arguments; an exception they log (log.exception) is named by its
    type and file:line frames: its text can quote whatever the code was reading (a store row)."""
    def emit(lg):
        try:
            raise RuntimeError(f"no such row: {KEY}")
        except RuntimeError:
            lg.exception("worker %d: label watch failed", 3)
    out = _capture("cubegate.worker", emit)
    assert KEY not in out and "sk-live" not in out and "Traceback" not in out
    assert "worker 3: label watch failed [RuntimeError at test_log_redact.py:" in out, out


def test_the_daemon_process_installs_the_redactor(tmp_path):
    """`cubegate run` (the daemon: tornado APIs, vault, policy store) filters its libraries' lines too."""
    import subprocess, sys
    code = ("import logging, sys\n"
            "from click.testing import CliRunner\n"
            "import cubegate.daemon as d\n"
            "async def run(self):\n"
            "    logging.getLogger('tornado.application').error('Uncaught %s', 'Bearer " + KEY + "')\n"
            "    try:\n"
            "        raise ValueError('" + KEY + "')\n"
            "    except ValueError:\n"
            "        logging.getLogger('cubegate.daemon').exception('failed')\n"
            "    return 0\n"
            "d.Daemon.run = run\n"
            "from cubegate.cli import main\n"
            "sys.argv = ['cubegate', '-c', sys.argv[1], 'run']\n"
            "main()\n")
    settings = tmp_path / "settings.yaml"
    settings.write_text(f"state_dir: {tmp_path}/state\npolicy_dir: {tmp_path}/policies\n")
    (tmp_path / "policies").mkdir()
    p = subprocess.run([sys.executable, "-c", code, str(settings)], capture_output=True, text=True, timeout=60)
    assert "Uncaught" in p.stderr and "failed [ValueError at" in p.stderr, (p.returncode, p.stderr[-2000:])
    assert KEY not in p.stderr and "sk-live" not in p.stderr
