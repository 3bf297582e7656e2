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
"""
from __future__ import annotations

import os
from pathlib import Path

WAL_INDEX_HEADER_BYTES = 96


class WalChangeMark:
    def __init__(self, db_path: str | Path) -> None:
        self._shm_path = os.fspath(db_path) + "-shm"
        self._fd: int | None = None

    def read(self) -> bytes | None:
        """Bytes that differ after every commit to the database; None when they cannot be read
        (the caller then asks the database itself, e.g. a generation counter)."""
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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
