"""Who is talking: per-sandbox proxy credentials, stored hashed.

Tokens are 32 random bytes, so a single SHA-256 is enough (no slow KDF needed:
there is nothing to brute-force). Lookup is by sandbox id, then a
constant-time comparison of the hashes. The table lives in SQLite so that
`cubegate identity add` in another process takes effect without a restart.

Successful authentications are cached in memory (every CONNECT authenticates):
the cache is dropped whenever the database changes, ours or another process's
(SQLite's data_version), so a removed or re-keyed sandbox is refused at once. A hit runs
no SQL: data_version is asked only when the WAL-index header (walmark) moved, or every
time when that mark cannot be read (in the event loop the mark is read once per loop iteration).
Failures are never cached (a sandbox cannot fill memory with wrong tokens).

A sandbox's token is accepted only from that sandbox's address when the switch gave it one
(`accepted_from`): a token taken out of one sandbox opens nothing from another sandbox or host.
Identities of no sandbox (`identity add` for an agent outside the switch) work from anywhere.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

from walmark import WalChangeMark

from egress.sqlite_db import open_db

SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CACHE_MAX = 65536   # cached (sandbox, token hash) pairs; cleared whole when full
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}$")


class IdentityError(ValueError):
    pass


@dataclass(frozen=True)
class Identity:
    sandbox_id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    issued: float | None = field(default=None, compare=False)   # when its token was made (re-key: new)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_proxy_authorization(value: str | None) -> tuple[str, str] | None:
    """`Basic base64(sandbox_id:token)` → (sandbox_id, token); anything else → None."""
    if not value:
        return None
    scheme, _, param = value.strip().partition(" ")
    if scheme.lower() != "basic" or not param:
        return None
    try:
        decoded = base64.b64decode(param.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, token = decoded.partition(":")
    if not sep or not user or not token:
        return None
    return user, token


class SandboxAddresses(Protocol):
    """The switch's record (cubevs registry): the address it gave a sandbox, None for no sandbox."""

    def address_of(self, sandbox_id: str) -> str | None: ...


def _canonical_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    return (addr.ipv4_mapped or addr) if isinstance(addr, ipaddress.IPv6Address) else addr


def accepted_from(bound: str | None, source: str) -> bool:
    """May a token whose sandbox has address `bound` (None: no sandbox) be used from `source`?
    A dual-stack listener's ::ffff:a.b.c.d is a.b.c.d; an unreadable address is refused."""
    if bound is None:
        return True
    want = _canonical_ip(bound)
    return want is not None and want == _canonical_ip(source)


class IdentityStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = open_db(self.path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS identities ("
            " sandbox_id TEXT PRIMARY KEY, labels TEXT NOT NULL, token_hash TEXT NOT NULL,"
            " created REAL NOT NULL)"
        )
        self._cache: dict[tuple[str, str], Identity] = {}
        self._cache_version: int | None = None
        self._writes = 0
        self._wal_mark = WalChangeMark(self.path)   # valid while self._db stays open
        self._cache_mark: bytes | None = None       # the wal mark when _cache_version was read

    def close(self) -> None:
        with self._lock:
            self._wal_mark.close()
            self._db.close()

    @staticmethod
    def _check_labels(labels: Mapping[str, str]) -> dict[str, str]:
        out = {}
        for k, v in labels.items():
            if not LABEL_RE.match(k) or not isinstance(v, str) or not LABEL_RE.match(v):
                raise IdentityError(f"invalid label {k!r}={v!r}: use [A-Za-z0-9_./-], at most 63 chars")
            out[k] = v
        return out

    def add(self, sandbox_id: str, labels: Mapping[str, str] | None = None, *, replace: bool = False) -> str:
        """Create (or with replace=True, re-key) a sandbox identity; returns the token once."""
        if not SANDBOX_ID_RE.match(sandbox_id):
            raise IdentityError(f"invalid sandbox id {sandbox_id!r}: use [A-Za-z0-9_.-], at most 64 chars")
        clean = self._check_labels(labels or {})
        token = secrets.token_urlsafe(32)
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        with self._lock:
            try:
                self._db.execute(
                    f"{verb} INTO identities VALUES (?, ?, ?, ?)",
                    (sandbox_id, json.dumps(clean, sort_keys=True), _hash(token), time.time()),
                )
            except sqlite3.IntegrityError:
                raise IdentityError(f"sandbox {sandbox_id!r} already exists (use --replace to re-key)") from None
            self._cache.clear()   # data_version only counts other connections' commits
            self._wal_mark.forget()
            self._writes += 1
        return token

    def remove(self, sandbox_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM identities WHERE sandbox_id = ?", (sandbox_id,))
            self._cache.clear()
            self._wal_mark.forget()
            self._writes += 1
        return cur.rowcount > 0

    def forget_cached(self) -> None:
        """The table could not be read: no authentication is answered from memory until it is again."""
        with self._lock:
            self._cache.clear()

    def generation(self) -> tuple[int, int]:
        """Changes whenever the table may have (any process's commit, or ours): a cheap poll, which
        raises when the table cannot be read (one row is read: a lost table or page is seen at once)."""
        with self._lock:
            self._db.execute("SELECT 1 FROM identities LIMIT 1").fetchall()
            return self._db.execute("PRAGMA data_version").fetchone()[0], self._writes

    def get(self, sandbox_id: str) -> Identity | None:
        with self._lock:
            row = self._db.execute(
                "SELECT sandbox_id, labels, created FROM identities WHERE sandbox_id = ?", (sandbox_id,)
            ).fetchone()
        return Identity(row[0], json.loads(row[1]), row[2]) if row else None

    def list(self) -> list[Identity]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id, labels, created FROM identities ORDER BY sandbox_id").fetchall()
        return [Identity(r[0], json.loads(r[1]), r[2]) for r in rows]

    def labels_by_sandbox(self) -> dict[str, dict[str, str]]:
        with self._lock:
            rows = self._db.execute("SELECT sandbox_id, labels FROM identities").fetchall()
        return {r[0]: json.loads(r[1]) for r in rows}

    def data_version(self) -> int:
        """Changes when another connection (another process) commits to the database."""
        with self._lock:
            return self._db.execute("PRAGMA data_version").fetchone()[0]

    def _cached(self, key: tuple[str, str]) -> Identity | None:
        """Caller holds the lock. data_version changes when another connection commits."""
        mark = self._wal_mark.read()     # read before data_version: a commit in between
        if mark is None or mark != self._cache_mark:   # makes the next mark differ, never missed
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version != self._cache_version:
                self._cache.clear()
                self._cache_version = version
            self._cache_mark = mark
        return self._cache.get(key)

    def authenticate(self, sandbox_id: str, token: str) -> Identity | None:
        key = (sandbox_id, _hash(token))
        with self._lock:   # one hold: a cached entry is never older than the version it is filed under
            hit = self._cached(key)
            if hit is not None:
                return hit
            row = self._db.execute(
                "SELECT labels, token_hash, created FROM identities WHERE sandbox_id = ?", (sandbox_id,)
            ).fetchone()
            # Compare even when the id is unknown so timing does not reveal which ids exist.
            stored = row[1] if row else "0" * 64
            ok = hmac.compare_digest(stored, key[1])
            if not (row and ok):
                return None
            ident = Identity(sandbox_id, json.loads(row[0]), row[2])
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[key] = ident
            return ident

    def authenticate_header(self, value: str | None) -> Identity | None:
        creds = parse_proxy_authorization(value)
        return self.authenticate(*creds) if creds else None


class LabelWatch:
    """Which sandboxes' labels changed since the last look (`identity add --replace` or `rm` in
    another process): sandbox id → its labels now ({} once its identity is gone, as a
    transparent connection from its address would be decided). One PRAGMA per look while
    nothing changed; the whole table is read only after a commit."""

    def __init__(self, store: IdentityStore) -> None:
        self.store = store
        self._version = store.data_version()
        self._labels = store.labels_by_sandbox()

    def changed(self) -> dict[str, dict[str, str]]:
        version = self.store.data_version()
        if version == self._version:
            return {}
        self._version = version   # before the read: a commit during it is seen on the next look
        now = self.store.labels_by_sandbox()
        out = {sid: now.get(sid, {}) for sid in now.keys() | self._labels.keys()
               if now.get(sid, {}) != self._labels.get(sid, {})}
        self._labels = now
        return out
