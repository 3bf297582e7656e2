"""Identities in SQLite shared by processes: a change in one store is seen by another at once."""
from __future__ import annotations

import base64

import pytest

from egress.identity import Identity, IdentityError, IdentityStore
from egress.sqlite_db import open_db


@pytest.fixture
def stores(tmp_path):
    daemon, cli = IdentityStore(tmp_path / "state" / "identities.db"), IdentityStore(tmp_path / "state" / "identities.db")
    yield daemon, cli
    daemon.close()
    cli.close()


def _basic(sandbox: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{sandbox}:{token}".encode()).decode()


def test_another_stores_change_is_seen_at_once(stores):
    daemon, cli = stores
    token = cli.add("sb-1", {"team": "research"})
    assert daemon.authenticate_header(_basic("sb-1", token)) == Identity("sb-1", {"team": "research"})
    new = cli.add("sb-1", replace=True)                    # re-keyed by the CLI: the cached old token is refused
    assert daemon.authenticate("sb-1", token) is None
    assert daemon.authenticate("sb-1", new) == Identity("sb-1", {})
    assert cli.remove("sb-1") and daemon.authenticate("sb-1", new) is None


def test_refusals(stores):
    daemon, _ = stores
    daemon.add("sb-1")
    with pytest.raises(IdentityError):
        daemon.add("sb-1")
    with pytest.raises(IdentityError):
        daemon.add("../etc")
    assert daemon.authenticate("sb-1", "wrong") is None and daemon.authenticate("nobody", "x") is None
    assert daemon.authenticate_header("Bearer x") is None and daemon.authenticate_header(None) is None


def test_shared_files_are_wal_and_fully_synchronous(tmp_path):
    db = open_db(tmp_path / "a" / "b.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2      # FULL
    assert db.isolation_level is None
    db.close()


@pytest.mark.parametrize("bound, source, ok", [
    (None, "203.0.113.9", True),                  # an identity of no sandbox: from anywhere
    ("10.200.0.5", "10.200.0.5", True),
    ("10.200.0.5", "::ffff:10.200.0.5", True),    # a dual-stack listener's spelling
    ("10.200.0.5", "10.200.0.6", False),          # another sandbox
    ("10.200.0.5", "127.0.0.1", False),           # the host
    ("10.200.0.5", "not-an-address", False),
    ("garbage", "10.200.0.5", False),             # an unreadable record: refused (fail closed)
])
def test_a_sandbox_token_is_accepted_from_its_address_only(bound, source, ok):
    from egress.identity import accepted_from
    assert accepted_from(bound, source) is ok


def test_a_lost_table_is_seen_by_the_poll_and_no_hit_is_served_from_memory_after(tmp_path):
    """generation() reads a row (a renamed or lost table raises there, not only in list()); once the
    follow-up forgot the cache, an authentication asks the store again (and fails closed)."""
    import sqlite3
    store = IdentityStore(tmp_path / "ids.db")
    token = store.add("sb-1")
    assert store.authenticate("sb-1", token) is not None      # cached now
    db = sqlite3.connect(tmp_path / "ids.db")
    db.execute("ALTER TABLE identities RENAME TO gone")
    db.commit()
    with pytest.raises(sqlite3.OperationalError):
        store.generation()
    store.forget_cached()
    with pytest.raises(sqlite3.OperationalError):
        store.authenticate("sb-1", token)
    db.execute("ALTER TABLE gone RENAME TO identities")
    db.commit()
    db.close()
    store.generation()
    assert store.authenticate("sb-1", token) is not None
    store.close()
