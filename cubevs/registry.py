"""Sandbox id <-> ip <-> mac <-> ifindex <-> netns, persisted in SQLite.

The switch writes it; the gateway reads it (`Registry(state_dir).lookup_by_ip`)
to identify transparent-mode clients by source address.  WAL mode so readers
in other processes never block the writer.
"""
from __future__ import annotations

import ipaddress
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

DB_NAME = "cubevs.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id  TEXT PRIMARY KEY,
    sandbox_no  INTEGER NOT NULL UNIQUE,
    ip          TEXT NOT NULL UNIQUE,
    mac         TEXT NOT NULL,
    ifindex     INTEGER NOT NULL,
    netns       TEXT NOT NULL,
    host_ifname TEXT NOT NULL,
    l4_allow    TEXT NOT NULL DEFAULT '[]',
    created     REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Entry:
    sandbox_id: str
    sandbox_no: int
    ip: str
    mac: str
    ifindex: int
    netns: str
    host_ifname: str
    l4_allow: tuple[tuple[str, int, str], ...]


def mac_for_ip(ip: str) -> str:
    """Locally administered unicast MAC derived from the IP (unique per pool address)."""
    b = ipaddress.IPv4Address(ip).packed
    return "02:cb:" + ":".join(f"{x:02x}" for x in b)


class Registry:
    def __init__(self, state_dir: str | os.PathLike):
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(state_dir) / DB_NAME
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=10)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # -- meta (switch settings, counters)
    def get_meta(self, key: str, default=None):
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_meta(self, key: str, value) -> None:
        with self._lock:
            self._db.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE "
                             "SET value=excluded.value", (key, json.dumps(value)))

    # -- allocation
    def allocate(self, sandbox_id: str, pool: str, reserved: set[str]) -> tuple[int, str, str]:
        """Reserve (sandbox_no, ip, mac) for a new sandbox; raises if the pool is full."""
        net = ipaddress.IPv4Network(pool)
        with self._lock:
            used = {r[0] for r in self._db.execute("SELECT ip FROM sandboxes")} | reserved
            ip = next((str(h) for h in net.hosts() if str(h) not in used), None)
            if ip is None:
                raise RuntimeError(f"address pool {pool} exhausted")
            # sandbox numbers are never reused, so stale counters cannot be misattributed
            no = int(self.get_meta("next_sandbox_no", 1))
            self._db.execute("INSERT INTO meta(key,value) VALUES('next_sandbox_no',?) ON CONFLICT(key)"
                             " DO UPDATE SET value=excluded.value", (json.dumps(no + 1),))
        return no, ip, mac_for_ip(ip)

    def add(self, e: Entry) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO sandboxes(sandbox_id,sandbox_no,ip,mac,ifindex,netns,host_ifname,l4_allow)"
                " VALUES(?,?,?,?,?,?,?,?)",
                (e.sandbox_id, e.sandbox_no, e.ip, e.mac, e.ifindex, e.netns, e.host_ifname,
                 json.dumps([list(x) for x in e.l4_allow])))

    def rename(self, old_id: str, new_id: str) -> bool:
        """Give a prepared slot (registered under its pool token) its sandbox id; False if
        the token is gone or the id is taken."""
        with self._lock:
            try:
                cur = self._db.execute("UPDATE sandboxes SET sandbox_id=? WHERE sandbox_id=?", (new_id, old_id))
            except sqlite3.IntegrityError:
                return False
            return cur.rowcount == 1

    def set_l4(self, sandbox_id: str, l4_allow) -> None:
        with self._lock:
            self._db.execute("UPDATE sandboxes SET l4_allow=? WHERE sandbox_id=?",
                             (json.dumps([list(x) for x in l4_allow]), sandbox_id))

    def remove(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))

    # -- queries
    _COLS = "sandbox_id,sandbox_no,ip,mac,ifindex,netns,host_ifname,l4_allow"

    @staticmethod
    def _entry(row) -> Entry:
        return Entry(*row[:7], tuple(tuple(x) for x in json.loads(row[7])))

    def get(self, sandbox_id: str) -> Entry | None:
        row = self._db.execute(f"SELECT {self._COLS} FROM sandboxes WHERE sandbox_id=?",
                               (sandbox_id,)).fetchone()
        return self._entry(row) if row else None

    def lookup_by_ip(self, ip: str) -> str | None:
        row = self._db.execute("SELECT sandbox_id FROM sandboxes WHERE ip=?", (ip,)).fetchone()
        return row[0] if row else None

    def by_no(self) -> dict[int, str]:
        return dict(self._db.execute("SELECT sandbox_no, sandbox_id FROM sandboxes"))

    def all(self) -> list[Entry]:
        return [self._entry(r) for r in
                self._db.execute(f"SELECT {self._COLS} FROM sandboxes ORDER BY sandbox_no")]
