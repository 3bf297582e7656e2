"""walmark in an event loop: one read per loop iteration, and never older than that. A commit by
another connection is seen by the first read of the next iteration and by any callback queued
after the read; a missing mark (None) is never reused; forget() makes the next read read.
Both loops the worker runs (asyncio, uvloop)."""
from __future__ import annotations

import asyncio
import os
import sqlite3

import pytest

from walmark import WalChangeMark

LOOPS = ["asyncio", "uvloop"]


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _run(kind: str, coro_fn):
    loop = _new_loop(kind)
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "x.db"
    ours = sqlite3.connect(path, isolation_level=None)        # keeps the -shm in place, as callers do
    ours.execute("PRAGMA journal_mode=WAL")
    ours.execute("CREATE TABLE t (v INTEGER)")
    other = sqlite3.connect(path, isolation_level=None)       # "another process": its own connection
    mark = WalChangeMark(path)
    yield path, other, mark
    mark.close()
    other.close()
    ours.close()


def _commit(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO t VALUES (1)")


@pytest.mark.parametrize("kind", LOOPS)
def test_one_read_per_iteration_and_a_commit_is_seen_in_the_next(kind, db):
    path, other, mark = db

    async def scenario():
        first = mark.read()
        assert first is not None
        _commit(other)
        assert mark.read() == first            # the same iteration: the mark read at its start
        await asyncio.sleep(0)                 # the next iteration
        second = mark.read()
        assert second is not None and second != first
        for _ in range(3):                     # several commits, each seen one iteration later
            _commit(other)
            await asyncio.sleep(0)
            now = mark.read()
            assert now != second
            second = now

    _run(kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_callback_queued_after_the_read_reads_again(kind, db):
    path, other, mark = db
    seen: list[bytes | None] = []

    async def scenario():
        first = mark.read()
        _commit(other)
        done = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(lambda: (seen.append(mark.read()), done.set_result(None)))
        await done
        assert seen[0] is not None and seen[0] != first

    _run(kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_reused_mark_is_not_read_again_and_an_unlinked_file_is_seen_next_iteration(kind, db):
    """Within the iteration the file is not touched (unlinking it changes nothing); in the next
    one the unlinked -shm gives None, every time (fail closed: no mark is never reused)."""
    path, other, mark = db

    async def scenario():
        first = mark.read()
        os.unlink(str(path) + "-shm")
        assert mark.read() == first
        await asyncio.sleep(0)
        assert mark.read() is None
        assert mark.read() is None

    _run(kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_no_mark_is_never_reused(kind, tmp_path):
    path = tmp_path / "later.db"
    mark = WalChangeMark(path)

    async def scenario():
        assert mark.read() is None                       # no database yet
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t (v INTEGER)")
            assert mark.read() is not None               # the same iteration, read again
        finally:
            conn.close()

    try:
        _run(kind, scenario)
    finally:
        mark.close()


@pytest.mark.parametrize("kind", LOOPS)
def test_forget_makes_the_next_read_read(kind, db):
    path, other, mark = db

    async def scenario():
        first = mark.read()
        _commit(other)          # say, our own connection's commit
        mark.forget()
        assert mark.read() != first

    _run(kind, scenario)


def test_outside_a_loop_every_read_reads(db):
    path, other, mark = db
    first = mark.read()
    _commit(other)
    assert mark.read() != first
