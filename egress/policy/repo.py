"""Versioned policy documents in SQLite (the policy API's store): every change a new row.

Kinds: `policy` (admin policies), `grant` (approved access requests),
`network` (per-sandbox network options). A row is one version of one
document; a deletion is a version whose doc is NULL. Nothing is ever updated
or removed, so history and rollback are reads. WAL + synchronous=FULL: a
change the API acknowledged survives a crash or kill -9.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..sqlite_db import open_db

KINDS = ("policy", "grant", "network")
MAX_HISTORY = 1000   # versions one read returns at most

_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL, name TEXT NOT NULL, version INTEGER NOT NULL,
  doc TEXT, action TEXT NOT NULL, actor TEXT NOT NULL, ts REAL NOT NULL, note TEXT,
  UNIQUE (kind, name, version))
"""


@dataclass(frozen=True)
class Version:
    seq: int
    kind: str
    name: str
    version: int
    doc: dict | None          # None: deleted in this version
    action: str               # create | replace | delete | rollback | expire
    actor: str
    ts: float
    note: str | None

    def public(self) -> dict:
        return {"kind": self.kind, "name": self.name, "version": self.version, "action": self.action,
                "actor": self.actor, "ts": self.ts, "note": self.note, "deleted": self.doc is None}


def _row(r) -> Version:
    return Version(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] is not None else None, r[5], r[6], r[7], r[8])


_COLS = "seq, kind, name, version, doc, action, actor, ts, note"


class PolicyRepo:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = open_db(self.path)
        self._db.execute(_SCHEMA)
        ok = self._db.execute("PRAGMA quick_check").fetchone()[0]
        if ok != "ok":
            raise sqlite3.DatabaseError(f"policy store {self.path} is damaged: {ok}")

    def close(self) -> None:
        self._db.close()

    def head(self) -> int:
        """The last change's sequence number (0: none): part of the policy digest."""
        with self._lock:
            return self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM versions").fetchone()[0]

    def current(self, kind: str) -> dict[str, Version]:
        """The newest version of every document of `kind` that is not deleted."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLS} FROM versions v WHERE kind = ? AND version = "
                "(SELECT MAX(version) FROM versions w WHERE w.kind = v.kind AND w.name = v.name)", (kind,)).fetchall()
        return {r[2]: v for r in rows if (v := _row(r)).doc is not None}

    def latest(self, kind: str, name: str) -> Version | None:
        with self._lock:
            r = self._db.execute(f"SELECT {_COLS} FROM versions WHERE kind = ? AND name = ? "
                                 "ORDER BY version DESC LIMIT 1", (kind, name)).fetchone()
        return _row(r) if r else None

    def get(self, kind: str, name: str, version: int) -> Version | None:
        with self._lock:
            r = self._db.execute(f"SELECT {_COLS} FROM versions WHERE kind = ? AND name = ? AND version = ?",
                                 (kind, name, version)).fetchone()
        return _row(r) if r else None

    def history(self, kind: str, name: str) -> list[Version]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLS} FROM versions WHERE kind = ? AND name = ? "
                                    "ORDER BY version DESC LIMIT ?", (kind, name, MAX_HISTORY)).fetchall()
        return [_row(r) for r in rows]

    def commit(self, kind: str, name: str, doc: dict | None, *, action: str, actor: str,
               note: str | None = None) -> Version:
        """Append one version (one transaction)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        text = json.dumps(doc, sort_keys=True, separators=(",", ":")) if doc is not None else None
        ts = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (last,) = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM versions WHERE kind = ? AND name = ?",
                                           (kind, name)).fetchone()
                cur = self._db.execute(
                    "INSERT INTO versions (kind, name, version, doc, action, actor, ts, note) VALUES (?,?,?,?,?,?,?,?)",
                    (kind, name, last + 1, text, action, actor, ts, note))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return Version(cur.lastrowid, kind, name, last + 1, doc, action, actor, ts, note)
