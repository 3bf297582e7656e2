"""walmark: has anything been committed to this SQLite database since the last look? — without a query.

A leaf package: it imports nothing of ours, so every package may use it (vault included).

The WAL-index header is the first 96 bytes of the `-shm` file (two copies of a 48-byte header,
https://www.sqlite.org/walformat.html). Every commit, by any connection of any process,
rewrites it (its change counter, the last frame, its checksum; the salts when the WAL
restarts after a checkpoint): the same bytes mean nothing was committed since. The caller
keeps a connection to the database open for the mark's life: that keeps the file from being
truncated or replaced (SQLite does that only for the first or last connection to it).

    mark = WalChangeMark(db_path)
    mark.read() -> bytes | None   # None: cannot tell (no -shm, unreadable, unlinked): ask the database
    mark.close()

Not thread-safe: the caller reads it under the lock that guards its connection.

Read in a running event loop, a mark is read once per loop iteration: later reads return it
until a callback queued at the first read runs (the loop's next iteration), so a request
handled after that re-reads, while a burst handled in one iteration costs one read (an fstat
and a pread). Exactness: a read reuses the mark only for callbacks queued before it was read
(their bytes had arrived already), or for I/O handled in the same iteration. Outside a loop
(threads, CLIs) every read reads. A write through the caller's own connection calls forget():
its commit is seen by the very next read.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop


def _running_loop():
    """The running event loop, if any: never imports asyncio (a CLI command without a loop must not
    pay for it; tests/cubegate/test_cli_startup.py), so no running loop when it is not loaded."""
    aio = sys.modules.get("asyncio")
    return aio._get_running_loop() if aio is not None else None


WAL_INDEX_HEADER_BYTES = 96


class WalChangeMark:
    def __init__(self, db_path: str | Path) -> None:
        self._shm_path = os.fspath(db_path) + "-shm"
        self._fd: int | None = None
        self._tick: tuple[AbstractEventLoop, bytes] | None = None   # (loop, mark read in its iteration)

    def read(self) -> bytes | None:
        """Bytes that differ after every commit to the database; None when they cannot be read
        (the caller then asks the database itself, e.g. a generation counter)."""
        loop = _running_loop()
        if loop is None:
            return self._read()
        tick = self._tick
        if tick is not None and tick[0] is loop:
            return tick[1]
        mark = self._read()
        if mark is not None and tick is None:   # None is never reused: it is asked again every time
            self._tick = (loop, mark)
            loop.call_soon(self._end_tick, loop)
        return mark

    def _end_tick(self, loop: AbstractEventLoop) -> None:
        tick = self._tick
        if tick is not None and tick[0] is loop:
            self._tick = None

    def forget(self) -> None:
        """The caller committed through its own connection: the next read reads."""
        self._tick = None

    def _read(self) -> bytes | None:
        if self._fd is None:
            try:
                self._fd = os.open(self._shm_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            if os.fstat(self._fd).st_nlink == 0:   # unlinked: nobody writes this one any more
                self.close()
                return None
            mark = os.pread(self._fd, WAL_INDEX_HEADER_BYTES, 0)
        except OSError:
            return None
        return mark if len(mark) == WAL_INDEX_HEADER_BYTES else None

    def close(self) -> None:
        self._tick = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
