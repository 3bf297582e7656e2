"""SQLite index over the JSONL audit files, for filtered queries.

The index is disposable: the JSONL files are the source of truth and
rebuild() recreates the index from them. sync() reads only what is new
(position per file, see segments.py), never consumes a line still being
written, and cannot insert a record twice (id is the primary key).
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from .filters import RecordFilter, normalize_host_pattern
from .record import parse_line
from .segments import CURRENT_NAME, Position, file_key, log_files, present_keys, read_lines

SCHEMA_VERSION = 1
_BATCH = 5000  # lines per transaction while ingesting

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id       TEXT PRIMARY KEY,
    ts       TEXT NOT NULL,
    ts_ms    INTEGER NOT NULL,
    event    TEXT NOT NULL,
    sandbox  TEXT,
    host     TEXT,            -- lowercased, no trailing dot
    port     INTEGER,
    decision TEXT,
    reason   TEXT,
    rule     TEXT,
    method   TEXT,
    path     TEXT,
    conn_id  TEXT,
    raw      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS records_ts ON records (ts_ms);
CREATE INDEX IF NOT EXISTS records_sandbox_ts ON records (sandbox, ts_ms);
CREATE INDEX IF NOT EXISTS records_host ON records (host);
CREATE INDEX IF NOT EXISTS records_decision_ts ON records (decision, ts_ms);
CREATE TABLE IF NOT EXISTS files (
    dev         INTEGER NOT NULL,
    ino         INTEGER NOT NULL,
    name        TEXT NOT NULL,       -- last seen name, for humans
    offset      INTEGER NOT NULL,
    fingerprint BLOB NOT NULL,
    PRIMARY KEY (dev, ino)
);
"""


class AuditIndex:
    def __init__(self, db_path: str | os.PathLike, log_dir: str | os.PathLike, *, on_record=None) -> None:
        """on_record(rec): shown every record as it is read from the log (every process's appends:
        the daemon's view of what its worker processes wrote)."""
        self.db_path = Path(db_path)
        self.on_record = on_record
        self.log_dir = Path(log_dir)
        self.bad_lines = 0  # garbage lines skipped by sync() since this object was made
        self._lock = threading.Lock()
        try:
            self._conn = self._connect()
        except sqlite3.DatabaseError:
            # Corrupt or from another schema version: it is only an index.
            self._remove_db()
            self._conn = self._connect()

    # -- public -----------------------------------------------------------

    def sync(self) -> int:
        """Ingest what was appended since the last sync; returns records inserted."""
        with self._lock:
            inserted = 0
            seen: set[tuple[int, int]] = set()
            for path in log_files(self.log_dir):
                try:
                    f = open(path, "rb")
                except FileNotFoundError:
                    continue  # rotated or deleted since listing; next sync sees it
                with f:
                    key = file_key(os.fstat(f.fileno()))
                    seen.add(key)
                    inserted += self._ingest(f, key, path.name, final=path.name != CURRENT_NAME)
            self._forget_files(seen)
            return inserted

    def rebuild(self) -> int:
        """Throw the index away and ingest everything again; returns records inserted."""
        with self._lock:
            self._conn.close()
            self._remove_db()
            self._conn = self._connect()
        return self.sync()

    def query(
        self,
        sandbox: str | None = None,
        host: str | None = None,
        decision: str | None = None,
        reason: str | None = None,
        event: str | None = None,
        since: str | datetime | None = None,
        until: str | datetime | None = None,
        limit: int | None = 100,
        order: str = "desc",
    ) -> list[dict[str, Any]]:
        """Records matching all given filters, by time (newest first for "desc")."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"limit must be a positive int or None, got {limit!r}")
        flt = RecordFilter.build(
            sandbox=sandbox, host=host, decision=decision, reason=reason,
            event=event, since=since, until=until,
        )
        where, args = _where(flt)
        sql = "SELECT raw FROM records"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY ts_ms {order.upper()}, rowid {order.upper()}"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            rows = self._conn.execute(sql, args).fetchall()
        return [json.loads(raw) for (raw,) in rows]

    def top_hosts(self, *, decision: str = "deny", since: str | datetime | None = None,
                  limit: int = 10) -> list[tuple[str, int]]:
        """(host, records) with that decision since then, most first (the console's top denied hosts)."""
        flt = RecordFilter.build(decision=decision, since=since)
        where, args = _where(flt)
        sql = ("SELECT host, count(*) AS n FROM records WHERE host IS NOT NULL AND " + " AND ".join(where)
               + " GROUP BY host ORDER BY n DESC, host LIMIT ?")
        with self._lock:
            return [(h, n) for h, n in self._conn.execute(sql, [*args, int(limit)]).fetchall()]

    def count(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT count(*) FROM records").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> "AuditIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _remove_db(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(f"{self.db_path}{suffix}")
            except FileNotFoundError:
                pass

    def _connect(self) -> sqlite3.Connection:
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.db_path, timeout=10.0, check_same_thread=False,
                               isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"audit index schema v{version}, want v{SCHEMA_VERSION}")
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _ingest(self, f, key: tuple[int, int], name: str, *, final: bool) -> int:
        row = self._conn.execute(
            "SELECT offset, fingerprint FROM files WHERE dev=? AND ino=?", key
        ).fetchone()
        known = Position(row[0], bytes(row[1])) if row else None
        inserted = 0
        rows: list[tuple] = []
        pos = committed = known
        for line, pos in read_lines(f, known, final=final):
            parsed = parse_line(line)
            if parsed is None:
                self.bad_lines += 1
            else:
                rec, ts_ms = parsed
                try:
                    text = line.decode("ascii")      # what to_line writes
                except UnicodeDecodeError:           # not ours: stored with replacements
                    text = line.decode("ascii", "replace")
                rows.append(_row(rec, ts_ms, text))
                if self.on_record is not None:
                    self.on_record(rec)
            if len(rows) >= _BATCH:
                inserted += self._commit(rows, key, name, pos)
                rows, committed = [], pos
        if pos is not None and pos != committed:
            inserted += self._commit(rows, key, name, pos)
        return inserted

    def _commit(self, rows: list[tuple], key: tuple[int, int], name: str, pos: Position) -> int:
        """Insert a batch and move the file's position, atomically."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO records (id, ts, ts_ms, event, sandbox, host, port, decision,"
                " reason, rule, method, path, conn_id, raw) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                rows,
            )
            inserted = conn.total_changes - before
            conn.execute(
                "INSERT INTO files (dev, ino, name, offset, fingerprint) VALUES (?,?,?,?,?)"
                " ON CONFLICT (dev, ino) DO UPDATE SET name=excluded.name,"
                " offset=excluded.offset, fingerprint=excluded.fingerprint",
                (*key, name, pos.offset, pos.fingerprint),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return inserted

    def _forget_files(self, seen: set[tuple[int, int]]) -> None:
        # A file renamed mid-sync was not "seen" but still exists: keep its position.
        keep = seen | present_keys(self.log_dir)
        stored = self._conn.execute("SELECT dev, ino FROM files").fetchall()
        gone = [k for k in map(tuple, stored) if k not in keep]
        if gone:
            self._conn.executemany("DELETE FROM files WHERE dev=? AND ino=?", gone)


def _row(rec: dict[str, Any], ts_ms: int, text: str) -> tuple:
    host = rec.get("host")
    if isinstance(host, str):
        host = host.lower().rstrip(".")
    # id, ts, event and decision were matched against ASCII patterns and sets; raw is to_line's ASCII
    return (
        rec["id"], rec["ts"], ts_ms, rec["event"],
        _text(rec.get("sandbox")), _text(host), rec.get("port"), rec.get("decision"), _text(rec.get("reason")),
        _text(rec.get("rule")), _text(rec.get("method")), _text(rec.get("path")), _text(rec.get("conn_id")),
        text.rstrip("\n"),
    )


def _text(value: Any) -> Any:
    """A column value SQLite can store: a lone surrogate (a path read with surrogateescape, written
    by to_line as an escape) cannot be UTF-8; it would fail the whole batch, and every sync after."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("ascii")
    return value


def _where(flt: RecordFilter) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    args: list[Any] = []
    for col in ("sandbox", "decision", "reason", "event"):
        value = getattr(flt, col)
        if value is not None:
            where.append(f"{col} = ?")
            args.append(value)
    if flt.host is not None:
        pat, is_suffix = normalize_host_pattern(flt.host)
        if is_suffix:
            where.append("substr(host, -?) = ?")
            args += [len(pat), pat]
        else:
            where.append("host = ?")
            args.append(pat)
    if flt.since_ms is not None:
        where.append("ts_ms >= ?")
        args.append(flt.since_ms)
    if flt.until_ms is not None:
        where.append("ts_ms <= ?")
        args.append(flt.until_ms)
    return where, args
