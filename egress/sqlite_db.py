"""Opening the small SQLite files the daemon, its workers and the CLIs share
(identities, API policies, access requests)."""
from __future__ import annotations

import sqlite3
from pathlib import Path


def open_db(path: str | Path) -> sqlite3.Connection:
    """Its directory made; autocommit (each statement commits: a change of several statements
    says BEGIN itself); WAL, so readers in other processes never block the writer; synchronous
    FULL, so a committed change survives a power cut; usable from any thread (callers hold
    their own lock around it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db
