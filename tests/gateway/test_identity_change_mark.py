"""An authentication served from the cache runs no SQL, and still sees at once what another
process committed: re-keys, removals and relabels, across a WAL checkpoint, and with the
-shm file unlinked (no mark: data_version is asked every time)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from egress.identity import Identity, IdentityStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "state" / "identities.db"


@pytest.fixture
def daemon(db_path):
    store = IdentityStore(db_path)
    yield store
    store.close()


def _statements(store: IdentityStore, fn) -> list[str]:
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    try:
        fn()
    finally:
        store._db.set_trace_callback(None)
    return seen


def _in_another_process(db_path: Path, code: str) -> str:
    """Run `code` with `store` an IdentityStore on db_path in a fresh interpreter; its stdout."""
    script = f"from egress.identity import IdentityStore\nstore = IdentityStore({str(db_path)!r})\n{code}\nstore.close()\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_cached_authentication_runs_no_sql(daemon):
    token = daemon.add("sb-1", {"team": "a"})
    assert daemon.authenticate("sb-1", token) == Identity("sb-1", {"team": "a"})
    assert _statements(daemon, lambda: [daemon.authenticate("sb-1", token) for _ in range(5)]) == []


def test_another_processes_changes_are_seen_on_the_next_request(daemon, db_path):
    token = _in_another_process(db_path, "print(store.add('sb-1', {'team': 'a'}))")
    assert daemon.authenticate("sb-1", token) == Identity("sb-1", {"team": "a"})
    for i in range(3):          # several commits in a row, none of them missed
        token = _in_another_process(db_path, f"print(store.add('sb-1', {{'team': 't{i}'}}, replace=True))")
        assert daemon.authenticate("sb-1", token) == Identity("sb-1", {"team": f"t{i}"})
    # a checkpoint that empties the WAL: the next commit starts it again from its first frame
    _in_another_process(db_path, "store._db.execute('PRAGMA wal_checkpoint(TRUNCATE)')")
    assert daemon.authenticate("sb-1", token) == Identity("sb-1", {"team": "t2"})
    new = _in_another_process(db_path, "print(store.add('sb-1', {'team': 'b'}, replace=True))")
    assert daemon.authenticate("sb-1", token) is None
    assert daemon.authenticate("sb-1", new) == Identity("sb-1", {"team": "b"})
    _in_another_process(db_path, "store.remove('sb-1')")
    assert daemon.authenticate("sb-1", new) is None


def test_an_unlinked_shm_file_gives_no_mark_and_changes_are_still_seen(daemon, db_path):
    """Fail closed: a -shm file nobody writes any more never says "unchanged"."""
    cli = IdentityStore(db_path)     # another connection sharing this process's view of the WAL
    try:
        token = cli.add("sb-1")
        assert daemon.authenticate("sb-1", token) == Identity("sb-1", {})
        assert daemon._wal_mark.read() is not None
        os.unlink(str(db_path) + "-shm")
        assert daemon._wal_mark.read() is None
        assert cli.remove("sb-1")
        assert daemon.authenticate("sb-1", token) is None
        again = cli.add("sb-1", {"team": "c"})
        assert daemon.authenticate("sb-1", again) == Identity("sb-1", {"team": "c"})
        new = cli.add("sb-1", replace=True)
        assert daemon.authenticate("sb-1", again) is None and daemon.authenticate("sb-1", new) == Identity("sb-1", {})
    finally:
        cli.close()
