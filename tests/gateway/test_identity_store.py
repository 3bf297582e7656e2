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
