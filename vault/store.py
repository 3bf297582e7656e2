"""SQLite persistence of the vault (no crypto, no policy).

WAL mode, one write transaction per change (BEGIN IMMEDIATE), a `generation`
counter in meta bumped by every write so readers in this or another process
see changes cheaply; `change_mark()` tells, without a query, whether anything
was committed since the last look. secure_delete is on so destroyed ciphertexts are zeroed
in the file, and the WAL is checkpointed after a destroy.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from typing import Any, Iterator

from walmark import WalChangeMark   # a leaf, like httpkit: imports nothing of ours

from .errors import VaultCorrupt, VaultNotFound

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS secrets (
  tenant TEXT NOT NULL, id TEXT NOT NULL, created REAL NOT NULL, description TEXT NOT NULL DEFAULT '',
  PRIMARY KEY (tenant, id));
CREATE TABLE IF NOT EXISTS versions (
  tenant TEXT NOT NULL, id TEXT NOT NULL, version INTEGER NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('active', 'disabled', 'destroyed')),
  wrapped_key BLOB, nonce BLOB, ciphertext BLOB, fingerprint TEXT NOT NULL, created REAL NOT NULL,
  PRIMARY KEY (tenant, id, version),
  FOREIGN KEY (tenant, id) REFERENCES secrets (tenant, id) ON DELETE CASCADE);
CREATE TABLE IF NOT EXISTS bindings (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, secret_id TEXT NOT NULL, spec TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
  id TEXT PRIMARY KEY, hash TEXT NOT NULL, scope TEXT NOT NULL CHECK (scope IN ('admin', 'read')),
  description TEXT NOT NULL DEFAULT '', created REAL NOT NULL, expires REAL);
"""
_TABLES = {"meta", "secrets", "versions", "bindings", "tokens"}


class Store:
    """One SQLite connection, serialized by a lock (safe to share across threads)."""

    def __init__(self, path: str, conn: sqlite3.Connection):
        self.path = path
        self._conn = conn
        self._lock = threading.RLock()
        self._wal_mark = WalChangeMark(path)   # our connection, open for the Store's life, keeps it valid

    # -- opening -----------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, initial_meta: dict[str, Any]) -> "Store":
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise VaultCorrupt(f"{path} exists already; refusing to initialise over it") from None
        os.close(fd)
        store = cls(path, cls._connect(path))
        store._conn.executescript(_SCHEMA)
        with store.write() as c:
            for k, v in {"schema_version": SCHEMA_VERSION, "generation": 0, **initial_meta}.items():
                c.execute("INSERT INTO meta (k, v) VALUES (?, ?)", (k, v))
        return store

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Store":
        path = os.fspath(path)
        if not os.path.exists(path):
            raise VaultNotFound(f"no vault at {path} (run `vault init`)")
        try:
            with open(path, "rb") as f:
                header = f.read(100)
        except OSError as e:
            raise VaultCorrupt(f"cannot read vault file {path}: {e.strerror}") from None
        if len(header) < 100 or not header.startswith(b"SQLite format 3\0"):
            raise VaultCorrupt(f"vault file {path} is truncated or not a vault (no SQLite header)")
        try:
            conn = cls._connect(path)
            rows = conn.execute("PRAGMA integrity_check").fetchall()
            if rows != [("ok",)]:
                conn.close()
                raise VaultCorrupt(f"vault file {path} failed the integrity check: "
                                   f"{'; '.join(str(r[0]) for r in rows[:3])}")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not _TABLES <= tables:
                conn.close()
                raise VaultCorrupt(f"{path} is not a cubegate vault (tables missing: "
                                   f"{sorted(_TABLES - tables)})")
            meta = dict(conn.execute("SELECT k, v FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise VaultCorrupt(f"vault file {path} is damaged or not a vault: {e}") from None
        if meta.get("schema_version") != SCHEMA_VERSION or "vault_id" not in meta or "kcv" not in meta:
            conn.close()
            raise VaultCorrupt(f"{path}: vault metadata missing or of an unknown schema version")
        return cls(path, conn)

    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA secure_delete=ON")
        conn.execute("PRAGMA busy_timeout=10000")
        return conn

    def close(self) -> None:
        with self._lock:
            self._wal_mark.close()
            self._conn.close()

    # -- transactions --------------------------------------------------------
    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that bumps the generation counter on commit."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
                c.execute("UPDATE meta SET v = v + 1 WHERE k = 'generation'")
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            finally:
                self._wal_mark.forget()   # our own commit: the next change_mark() reads the file again

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A consistent snapshot for several SELECTs."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN")
            try:
                yield c
            finally:
                c.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def generation(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT v FROM meta WHERE k = 'generation'").fetchone()[0]

    def change_mark(self) -> bytes | None:
        """Bytes that differ after every commit to the store, by any process (walmark); None when
        they cannot be read (the caller then asks the generation counter)."""
        with self._lock:
            return self._wal_mark.read()

    def meta(self, key: str) -> Any:
        rows = self.query("SELECT v FROM meta WHERE k = ?", (key,))
        return rows[0][0] if rows else None

    def checkpoint(self) -> None:
        """Fold the WAL into the main file and truncate it (after destroying data)."""
        with self._lock:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def now() -> float:
    return time.time()
