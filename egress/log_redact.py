"""Log lines from the proxy engine never carry request or response bytes.

mitmproxy's messages quote what failed to parse ("Invalid header name b'...'"),
and an "Addon error" carries a traceback whose frames hold body bytes — a key
echoed by an upstream ends up in the daemon log. This filter sits on every
handler: records from mitmproxy keep their logger, level and the shape of the
message, with every quoted literal and anything after the first line removed,
and no traceback (its exception's type name stays).
"""
from __future__ import annotations

import logging
import re

_QUOTED = re.compile(r"""b?'(?:[^'\\]|\\.)*'|b?"(?:[^"\\]|\\.)*"|<[^<>]*>""", re.S)
_MAX = 300


def redact_engine_message(text: str) -> str:
    first = text.split("\n", 1)[0]
    return _QUOTED.sub("<…>", first)[:_MAX]


class EngineLogRedactor(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("mitmproxy", "asyncio")):
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string must not leak its args either
            text = str(record.msg)
        if record.exc_info and record.exc_info[0] is not None:
            text += f" [{record.exc_info[0].__name__}]"
        record.msg, record.args = redact_engine_message(text), None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def install(root: logging.Logger | None = None) -> None:
    """Put the redactor on every handler of the root logger (and on the root itself)."""
    root = root or logging.getLogger()
    redactor = EngineLogRedactor()
    for h in root.handlers:
        if not any(isinstance(f, EngineLogRedactor) for f in h.filters):
            h.addFilter(redactor)
