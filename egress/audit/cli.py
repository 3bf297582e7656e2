"""`cubegate audit ...`: query and tail the audit log from the host.

The CLI reads the JSONL files (the source of truth); `query` keeps a SQLite
index next to them (or in memory when the directory is read-only for us).
Mounted under `cubegate`, the parent's context object supplies the directory
(its `audit_dir`); standalone, --dir or CUBEGATE_AUDIT_DIR does.
"""
from __future__ import annotations

import collections
import json
import os
import threading
import unicodedata
from pathlib import Path
from typing import Any, Iterable

import click

from .filters import RecordFilter
from .index import AuditIndex
from .record import EVENTS
from .tail import LogReader, follow

DEFAULT_DIR = "/var/lib/cubegate/audit"
INDEX_NAME = "index.sqlite3"

COLUMNS = ("TS", "SANDBOX", "EVENT", "DECISION", "REASON", "HOST:PORT", "REQUEST", "RULE")
_MAX_WIDTH = {"REQUEST": 60, "REASON": 40, "HOST:PORT": 50, "RULE": 40, "SANDBOX": 32}


def _resolve_dir(directory: str | None) -> Path:
    """--dir, else CUBEGATE_AUDIT_DIR, else the parent command's context object (.audit_dir), else the default."""
    ctx = click.get_current_context(silent=True)
    from_parent = getattr(ctx.find_root().obj, "audit_dir", None) if ctx is not None else None
    path = Path(directory or os.environ.get("CUBEGATE_AUDIT_DIR") or from_parent or DEFAULT_DIR)
    if not path.is_dir():
        raise click.ClickException(
            f"audit directory not found: {path} (use --dir or set CUBEGATE_AUDIT_DIR)"
        )
    return path


_NAMED_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\x1b"}


def _escape_char(ch: str) -> str:
    named = _NAMED_ESCAPES.get(ch)
    if named is not None:
        return named
    # Control (C0, DEL, C1), format (bidi overrides, zero-width), separators: never raw to a
    # terminal. Everything else, IDN letters included, stays readable.
    cat = unicodedata.category(ch)
    if cat[0] == "C" or cat in ("Zl", "Zp"):
        code = ord(ch)
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return ch


def terminal_safe(text: str) -> str:
    """Record text as the table prints it: a record holds what a sandbox sent (paths, hosts),
    and ESC/CR/... in it must not move the cursor, clear the screen or hide a line.
    Backslashes are doubled so an escape cannot be forged."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape_char(ch) for ch in text)


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else terminal_safe(str(value))


def _row(rec: dict[str, Any]) -> list[str]:
    host = rec.get("host") or rec.get("sni")
    hostport = _cell(host) + (f":{rec['port']}" if rec.get("port") is not None else "")
    request = " ".join(str(x) for x in (rec.get("method"), rec.get("path")) if x)  # escaped by _cell
    return [
        _cell(rec.get("ts")), _cell(rec.get("sandbox")), _cell(rec.get("event")),
        _cell(rec.get("decision")), _cell(rec.get("reason")), hostport, _cell(request),
        _cell(rec.get("rule")),
    ]


def _clip(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: width - 3] + "..."


def format_table(records: Iterable[dict[str, Any]]) -> str:
    """Aligned columns; the full record is always available with --json."""
    rows = [[_clip(c, _MAX_WIDTH.get(h)) for h, c in zip(COLUMNS, _row(r))] for r in records]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(COLUMNS)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(list(COLUMNS))] + [line(r) for r in rows])


def _emit(records: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for rec in records:
            click.echo(json.dumps(rec, separators=(",", ":")))
    elif records:
        click.echo(format_table(records))


def _dir_option(f):
    return click.option(
        "--dir", "directory", metavar="DIR",
        help=f"Audit log directory [env CUBEGATE_AUDIT_DIR, default {DEFAULT_DIR}].",
    )(f)


def _filter_options(f):
    for opt in reversed([
        click.option("--sandbox", help="Only this sandbox id."),
        click.option("--host", help="Exact host or *.suffix (subdomains only)."),
        click.option("--decision", type=click.Choice(["allow", "deny"])),
        click.option("--reason", help="Exact decision reason."),
        click.option("--event", type=click.Choice(sorted(EVENTS))),
    ]):
        f = opt(f)
    return f


@click.group("audit")
def audit() -> None:
    """Query and follow the egress audit log."""


@audit.command("query")
@_dir_option
@_filter_options
@click.option("--since", help="RFC3339 time or age like 15m, 2h, 1d.")
@click.option("--until", help="RFC3339 time or age like 15m, 2h, 1d.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--order", type=click.Choice(["desc", "asc"]), default="desc", show_default=True,
              help="desc = newest first.")
@click.option("--index", "index_path", metavar="FILE",
              help=f"SQLite index file [default DIR/{INDEX_NAME}; in memory if DIR is read-only].")
@click.option("--json", "as_json", is_flag=True, help="One JSON record per line.")
def query_cmd(directory, sandbox, host, decision, reason, event, since, until, limit, order,
              index_path, as_json) -> None:
    """Filtered search over the audit log (indexed)."""
    log_dir = _resolve_dir(directory)
    _check_filters(host=host, since=since, until=until)
    if index_path is None:
        index_path = log_dir / INDEX_NAME if os.access(log_dir, os.W_OK) else ":memory:"
    try:
        with AuditIndex(index_path, log_dir) as idx:
            idx.sync()
            records = idx.query(sandbox=sandbox, host=host, decision=decision, reason=reason,
                                event=event, since=since, until=until, limit=limit, order=order)
    except (OSError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    _emit(records, as_json)


@audit.command("tail")
@_dir_option
@_filter_options
@click.option("-n", "--lines", type=click.IntRange(min=0), default=10, show_default=True,
              help="Show the last N matching records first.")
@click.option("-f", "--follow", "follow_", is_flag=True, help="Keep printing new records.")
@click.option("--poll", type=click.FloatRange(min=0.01), default=0.2, show_default=True, hidden=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON record per line.")
def tail_cmd(directory, sandbox, host, decision, reason, event, lines, follow_, poll,
             as_json) -> None:
    """Last records of the audit log, optionally following new ones (reads the files)."""
    log_dir = _resolve_dir(directory)
    flt = _check_filters(sandbox=sandbox, host=host, decision=decision, reason=reason, event=event)
    reader = LogReader(log_dir)
    last = collections.deque((r for r in reader.read_new() if flt.matches(r)), maxlen=lines)
    _emit(list(last), as_json)
    if not follow_:
        return
    stop = threading.Event()
    try:
        for rec in follow(log_dir, poll=poll, stop_event=stop, reader=reader):
            if flt.matches(rec):
                # One line per record while following: a table cannot align ahead of time.
                click.echo(json.dumps(rec, separators=(",", ":")) if as_json
                           else format_table([rec]).splitlines()[1])
    except KeyboardInterrupt:
        stop.set()


def _check_filters(**kwargs) -> RecordFilter:
    try:
        return RecordFilter.build(**kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
