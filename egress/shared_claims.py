"""The per-sandbox connection budget across worker processes: one small shared file.

Same interface as egress.conn_state.ConnectionClaims (claim/release on a ConnState).
The file is a fixed table of SLOTS entries, each a sandbox id and one counter per
*column*; every worker process writes only its own column (given by the daemon),
and a sandbox's open connections are the sum over the columns. When a worker dies,
the daemon zeroes its column (`clear_column`), so a crash never leaks budget.
Every read-modify-write holds the file's flock: exact across processes.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import zlib
from pathlib import Path

from egress.conn_state import ConnState
from egress.identity import Identity

SLOTS = 4096                 # sandboxes holding connections at once (more: refused, fail closed)
COLUMNS = 64                 # worker processes alive at once (a rolling restart holds two per slot)
ID_BYTES = 64                # sandbox ids are at most 64 characters (egress.identity.SANDBOX_ID_RE)
_COUNTS = struct.Struct(f"<{COLUMNS}i")
ENTRY = ID_BYTES + _COUNTS.size
SIZE = SLOTS * ENTRY


def create(path: str | os.PathLike) -> None:
    """A new, empty table (the daemon, before it starts any worker)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(SIZE)


class _Table:
    def __init__(self, path: str | os.PathLike) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        if os.fstat(self._fd).st_size != SIZE:
            os.close(self._fd)
            raise ValueError(f"{path}: not a claims table")
        self._map = mmap.mmap(self._fd, SIZE)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def _locked(self):
        return _Flock(self._fd)

    def _find(self, key: bytes, *, create: bool) -> int | None:
        """Offset of key's entry; with create, a free one (never used, or all counts zero) for it."""
        m = self._map
        start = zlib.crc32(key) % SLOTS
        reusable = None
        for i in range(SLOTS):
            off = ((start + i) % SLOTS) * ENTRY
            stored = m[off:off + ID_BYTES]
            if stored == key:
                return off
            if stored[0] == 0:                     # never used: key is not further along
                break
            if reusable is None and not any(_COUNTS.unpack_from(m, off + ID_BYTES)):
                reusable = off
        else:
            off = None
        if not create:
            return None
        if reusable is None:
            reusable = off
        if reusable is not None:
            m[reusable:reusable + ENTRY] = key + bytes(_COUNTS.size)
        return reusable

    def clear_column(self, column: int) -> None:
        with self._locked():
            m = self._map
            for slot in range(SLOTS):
                struct.pack_into("<i", m, slot * ENTRY + ID_BYTES + 4 * column, 0)


class SharedClaims(_Table):
    """A worker's view: it counts in `column`, sees everyone's."""

    def __init__(self, path: str | os.PathLike, limit: int | None, column: int) -> None:
        if not 0 <= column < COLUMNS:
            raise ValueError(f"column must be in [0, {COLUMNS})")
        super().__init__(path)
        self.limit = limit
        self._at = ID_BYTES + 4 * column

    def claim(self, st: ConnState, identity: Identity) -> bool:
        """Count `st` against its sandbox's budget; False when the budget is spent (or the table is full)."""
        st.identity = identity
        sandbox = identity.sandbox_id
        if st.counted_for == sandbox:
            return True
        if st.counted_for is not None:
            self.release(st)
        key = _key(sandbox)
        with self._locked():
            off = self._find(key, create=True)
            if off is None:
                return False
            if self.limit and sum(_COUNTS.unpack_from(self._map, off + ID_BYTES)) >= self.limit:
                return False
            (n,) = struct.unpack_from("<i", self._map, off + self._at)
            struct.pack_into("<i", self._map, off + self._at, n + 1)
        st.counted_for = sandbox
        return True

    def release(self, st: ConnState) -> None:
        sandbox, st.counted_for = st.counted_for, None
        if sandbox is None:
            return
        with self._locked():
            off = self._find(_key(sandbox), create=False)
            if off is not None:
                (n,) = struct.unpack_from("<i", self._map, off + self._at)
                struct.pack_into("<i", self._map, off + self._at, max(0, n - 1))

    def open_count(self, sandbox: str) -> int:
        with self._locked():
            off = self._find(_key(sandbox), create=False)
            return 0 if off is None else sum(_COUNTS.unpack_from(self._map, off + ID_BYTES))


class ClaimsColumns(_Table):
    """The daemon's view: hands out columns, and clears a dead worker's."""

    def __init__(self, path: str | os.PathLike) -> None:
        create(path)
        super().__init__(path)
        self._free = list(range(COLUMNS))

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"more than {COLUMNS} worker processes at once")
        return self._free.pop(0)

    def give_back(self, column: int) -> None:
        """The worker that counted in `column` is gone: its connections are too."""
        self.clear_column(column)
        self._free.append(column)
        self._free.sort()


def _key(sandbox: str) -> bytes:
    raw = sandbox.encode()[:ID_BYTES]
    return raw + bytes(ID_BYTES - len(raw))


class _Flock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
