"""Log lines from the proxy engine and its libraries never carry request or response bytes.

mitmproxy's messages quote what failed to parse ("Invalid header name b'...'"), an
"Addon error" carries the exception's text and a traceback whose frames hold body
bytes, and at DEBUG hpack logs every header it adds to its table, name and value (the
injected Authorization included). This filter sits on every handler: a record from any
logger that is not ours keeps its logger, level and the shape of its message; its
%-arguments are dropped (the library's own template stays), every quoted literal and
anything after the first line is removed, a record carrying an exception keeps only
the text before its first ": " and the exception's type name, never a traceback.
Our own loggers keep their message and arguments (we log no values), but an exception
they log is reduced the same way to its type and file:line frames: an exception's text
can quote whatever the code was reading (a store row, a header, a body).
"""
from __future__ import annotations

import logging
import os
import re

_QUOTED = re.compile(r"""b?'(?:[^'\\]|\\.)*'|b?"(?:[^"\\]|\\.)*"|<[^<>]*>""", re.S)
_MAX = 300
_OURS = frozenset({"cubegate", "egress", "vault", "sandbox_runtime", "cubevs", "httpkit"})   # our code logs no values


def ours(logger_name: str) -> bool:
    return logger_name.split(".", 1)[0] in _OURS


def redact_engine_message(text: str) -> str:
    first = text.split("\n", 1)[0]
    return _QUOTED.sub("<…>", first)[:_MAX]


def where(exc: BaseException, limit: int = 6) -> str:
    """Where an exception was raised, as file:line in function frames: no message, no values."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append(f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} {code.co_name}")
        tb = tb.tb_next
    return " < ".join(reversed(frames[-limit:]))


class EngineLogRedactor(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if ours(record.name):
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                record.msg, record.args = f"{record.getMessage()} [{type(exc).__name__} at {where(exc)}]", None
                record.exc_info = record.exc_text = None
            return True
        # never the arguments ("Adding %s=%s to the header table"), nor an object's text (logger.error(exc))
        text = record.msg if isinstance(record.msg, str) else f"[{type(record.msg).__name__}]"
        if record.exc_info and record.exc_info[0] is not None:
            # "Addon error: <the exception's text>": the text may quote anything, unquoted
            text = text.split("\n", 1)[0].split(": ", 1)[0] + f" [{record.exc_info[0].__name__}]"
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
