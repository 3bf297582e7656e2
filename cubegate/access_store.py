"""Access requests filed by sandboxes (cubegate.internal) and decided by admins; SQLite.

A request is pending until an admin approves it (which creates a grant through
the policy store: versioned, audited, revocable) or denies it. Only what the
sandbox asked is stored: host, port and its own short reason text.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

from egress.sqlite_db import open_db

STATES = ("pending", "approved", "denied")
_COLS = "id, sandbox, labels, host, port, reason, state, created, decided, decided_by, scope, grant_name, expires, note"
MAX_LIST = 1000


def _row(r) -> dict:
    keys = [c.strip() for c in _COLS.split(",")]
    d = dict(zip(keys, r))
    d["labels"] = json.loads(d["labels"])
    d["grant"] = d.pop("grant_name")
    return d


class AccessStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = open_db(self.path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS requests (id TEXT PRIMARY KEY, sandbox TEXT NOT NULL, labels TEXT NOT NULL,"
            " host TEXT NOT NULL, port INTEGER NOT NULL, reason TEXT NOT NULL, state TEXT NOT NULL,"
            " created REAL NOT NULL, decided REAL, decided_by TEXT, scope TEXT, grant_name TEXT, expires REAL,"
            " note TEXT)")
        self._db.execute("CREATE INDEX IF NOT EXISTS requests_sandbox ON requests (sandbox, state)")

    def close(self) -> None:
        self._db.close()

    def file(self, sandbox: str, labels: dict, host: str, port: int, reason: str) -> dict:
        rid = "ar_" + secrets.token_hex(8)
        with self._lock:
            self._db.execute("INSERT INTO requests (id, sandbox, labels, host, port, reason, state, created) "
                             "VALUES (?,?,?,?,?,?,?,?)",
                             (rid, sandbox, json.dumps(labels, sort_keys=True), host, port, reason, "pending",
                              time.time()))
        return self.get(rid)

    def get(self, rid: str) -> dict | None:
        with self._lock:
            r = self._db.execute(f"SELECT {_COLS} FROM requests WHERE id = ?", (rid,)).fetchone()
        return _row(r) if r else None

    def pending_for(self, sandbox: str, host: str | None = None, port: int | None = None) -> list[dict]:
        sql, args = f"SELECT {_COLS} FROM requests WHERE sandbox = ? AND state = 'pending'", [sandbox]
        if host is not None:
            sql += " AND host = ? AND port = ?"
            args += [host, port]
        with self._lock:
            return [_row(r) for r in self._db.execute(sql, args).fetchall()]

    def list(self, *, state: str | None = None, sandbox: str | None = None) -> list[dict]:
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(state)
        if sandbox:
            where.append("sandbox = ?")
            args.append(sandbox)
        sql = f"SELECT {_COLS} FROM requests" + (" WHERE " + " AND ".join(where) if where else "")
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created DESC LIMIT ?", (*args, MAX_LIST)).fetchall()
        return [_row(r) for r in rows]

    def decide(self, rid: str, state: str, *, actor: str, scope: str | None = None, grant: str | None = None,
               expires: float | None = None, note: str | None = None) -> dict | None:
        """pending → approved/denied; None when there is no pending request with that id."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE requests SET state = ?, decided = ?, decided_by = ?, scope = ?, grant_name = ?, expires = ?,"
                " note = ? WHERE id = ? AND state = 'pending'",
                (state, time.time(), actor, scope, grant, expires, note, rid))
        return self.get(rid) if cur.rowcount else None

    def forget_sandbox(self, sandbox: str) -> int:
        """A destroyed sandbox's requests go with it (ids are reused: the next sandbox of that
        name must not read them). Their approvals stay in the audit log and the grant history."""
        with self._lock:
            return self._db.execute("DELETE FROM requests WHERE sandbox = ?", (sandbox,)).rowcount
