"""Sandbox records in SQLite: what the manager needs to find its sandboxes again
after a daemon restart (the sandboxes themselves keep running)."""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .backend import Handle, Limits

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    backend TEXT NOT NULL,
    labels TEXT NOT NULL,
    limits TEXT NOT NULL,
    state TEXT NOT NULL,          -- creating | running | paused | failed
    handle TEXT,                  -- backend Handle as JSON
    ip TEXT,
    created REAL NOT NULL,
    start_ms REAL,
    error TEXT,
    template TEXT,                -- root filesystem template (NULL: the host's /usr)
    paused_by TEXT                -- api | idle (auto-pause) while paused
);
"""
# columns added since the first schema: a state file from before them gets them
ADDED_COLUMNS = {"template": "TEXT", "paused_by": "TEXT"}


@dataclass
class SandboxRecord:
    id: str
    tenant: str
    backend: str
    labels: dict = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    state: str = "creating"
    handle: Handle | None = None
    ip: str | None = None
    created: float = field(default_factory=time.time)
    start_ms: float | None = None
    error: str | None = None
    template: str | None = None
    paused_by: str | None = None     # "api" | "idle" while paused

    def public(self) -> dict:
        """The API view (no backend internals)."""
        return {"id": self.id, "tenant": self.tenant, "backend": self.backend, "labels": self.labels,
                "limits": asdict(self.limits), "state": self.state, "ip": self.ip,
                "created": self.created, "start_ms": self.start_ms, "error": self.error,
                "template": self.template, "paused_by": self.paused_by}


class StateStore:
    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL (WAL): a commit is durable against a crash of the daemon, which sandboxes
        # outlive; a power loss, which could drop the last commits, kills every sandbox anyway
        # (recover() marks a surviving record of one failed). FULL fsynced twice per create,
        # inside the admission lock.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        for name, kind in ADDED_COLUMNS.items():
            if name not in cols:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {kind}")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put(self, r: SandboxRecord) -> None:
        h = json.dumps({"sandbox_id": r.handle.sandbox_id, "backend": r.handle.backend,
                        "netns": r.handle.netns, "data": r.handle.data}) if r.handle else None
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO sandboxes (id, tenant, backend, labels, limits, state, handle, ip, created,"
                " start_ms, error, template, paused_by) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (r.id, r.tenant, r.backend, json.dumps(r.labels), json.dumps(asdict(r.limits)), r.state,
                 h, r.ip, r.created, r.start_ms, r.error, r.template, r.paused_by))

    def insert_new(self, r: SandboxRecord) -> bool:
        """Claim the id; False if it is taken (two creates of one id race here, one wins)."""
        with self._lock:
            try:
                self._db.execute("INSERT INTO sandboxes (id, tenant, backend, labels, limits, state, created, "
                                 "template) VALUES (?,?,?,?,?,?,?,?)",
                                 (r.id, r.tenant, r.backend, json.dumps(r.labels), json.dumps(asdict(r.limits)),
                                  r.state, r.created, r.template))
                return True
            except sqlite3.IntegrityError:
                return False

    def finish_create(self, r: SandboxRecord) -> bool:
        """Store the created sandbox only if its row is still the one being created
        (a destroy in between must not be undone by the create finishing)."""
        h = json.dumps({"sandbox_id": r.handle.sandbox_id, "backend": r.handle.backend,
                        "netns": r.handle.netns, "data": r.handle.data}) if r.handle else None
        with self._lock:
            cur = self._db.execute(
                "UPDATE sandboxes SET state = ?, handle = ?, ip = ?, start_ms = ?, error = ? "
                "WHERE id = ? AND state = 'creating'", (r.state, h, r.ip, r.start_ms, r.error, r.id))
            return cur.rowcount == 1

    def put_handle(self, sandbox_id: str, h: Handle) -> None:
        """The handle only (a backend changed its data): never overwrites a state change."""
        with self._lock:
            self._db.execute("UPDATE sandboxes SET handle = ? WHERE id = ?", (_handle_json(h), sandbox_id))

    def delete(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {COLUMNS} FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _record(row) if row else None

    def charges(self) -> list[SandboxRecord]:
        """Every record with only id, tenant, backend, limits and state filled in: what admission
        reads for each create, without parsing every handle."""
        with self._lock:
            rows = self._db.execute("SELECT id, tenant, backend, limits, state FROM sandboxes").fetchall()
        return [SandboxRecord(sid, tenant, backend, {}, Limits(**json.loads(limits)), state)
                for sid, tenant, backend, limits, state in rows]

    def all(self) -> list[SandboxRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {COLUMNS} FROM sandboxes ORDER BY created").fetchall()
        return [_record(r) for r in rows]


def _handle_json(h: Handle | None) -> str | None:
    return json.dumps({"sandbox_id": h.sandbox_id, "backend": h.backend, "netns": h.netns, "data": h.data}) if h else None


COLUMNS = "id, tenant, backend, labels, limits, state, handle, ip, created, start_ms, error, template, paused_by"


def _record(row) -> SandboxRecord:
    (sid, tenant, backend, labels, limits, state, handle, ip, created, start_ms, error, template, paused_by) = row
    h = json.loads(handle) if handle else None
    return SandboxRecord(sid, tenant, backend, json.loads(labels), Limits(**json.loads(limits)), state,
                         Handle(**h) if h else None, ip, created, start_ms, error, template,
                         paused_by)
