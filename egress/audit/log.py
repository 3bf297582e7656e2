"""Append-only JSON-lines audit log with size rotation and retention.

One record = one os.write() on an O_APPEND fd, so a record whose append()
returned is wholly in the kernel: kill -9 cannot leave half of it. A crash in
the middle of a write can leave a torn last line; readers skip it, and opening
the log again cuts it off before new records are appended after it.

append() raising AuditWriteError means "not recorded": the gateway must refuse
the flow (fail closed).
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import record as rec_mod
from .segments import CURRENT_NAME, last_line_end, rotated_files, rotated_name, rotated_seq

FSYNC_MODES = ("always", "interval", "never")
# writable() says no below this much free space: one record must fit, with margin.
MIN_FREE_BYTES = 16 * 1024


class AuditWriteError(Exception):
    """The audit log could not record something; the flow must be refused."""

    def __init__(self, message: str, path: str | os.PathLike | None = None, errno_: int | None = None):
        super().__init__(message)
        self.path = str(path) if path is not None else None
        self.errno = errno_


def _os_error(action: str, path: Path, exc: OSError) -> AuditWriteError:
    text = (exc.strerror or os.strerror(exc.errno)) if exc.errno else str(exc)
    return AuditWriteError(f"audit log: cannot {action} {path}: {text}", path, exc.errno)


class AuditLog:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        keep_files: int = 20,
        retention_days: float | None = None,
        fsync: str = "interval",
        fsync_interval: float = 1.0,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        if keep_files < 0:
            raise ValueError("keep_files must be >= 0")
        if retention_days is not None and retention_days <= 0:
            raise ValueError("retention_days must be > 0 or None")
        if fsync_interval <= 0:
            raise ValueError("fsync_interval must be > 0")
        self.directory = Path(directory)
        self.path = self.directory / CURRENT_NAME
        self.max_bytes = max_bytes
        self.keep_files = keep_files
        self.retention_days = retention_days
        self.fsync_mode = fsync
        self.fsync_interval = fsync_interval

        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._dirty = False          # written but not fsync'd (interval mode)
        self._closed = False
        self._fsync_error: AuditWriteError | None = None

        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise _os_error("create directory", self.directory, exc) from None
        with self._lock:
            self._open()
            self._apply_retention()

        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if fsync == "interval":
            self._flusher = threading.Thread(target=self._flush_loop, name="audit-fsync", daemon=True)
            self._flusher.start()

    # -- public -----------------------------------------------------------

    def append(self, record: dict[str, Any]) -> None:
        """Write one record; returns once it is in the kernel (fsync'd if fsync="always").

        ValueError for a record that does not fit the schema; AuditWriteError
        if it could not be written.
        """
        line = rec_mod.to_line(record)
        with self._lock:
            if self._closed:
                raise AuditWriteError(f"audit log: {self.path} is closed", self.path)
            if self._fsync_error is not None:
                # An earlier fsync failed: earlier records may be lost. Stay failed.
                raise self._fsync_error
            if self._fd is None:
                self._open()
            if self._size > 0 and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._write(line)
            if self.fsync_mode == "always":
                self._fsync()
            elif self.fsync_mode == "interval":
                self._dirty = True

    def writable(self) -> bool:
        """Readiness probe: open, still the file on disk, directory writable, space left."""
        with self._lock:
            if self._closed or self._fd is None or self._fsync_error is not None:
                return False
            try:
                st_fd = os.fstat(self._fd)
                st_path = os.stat(self.path)
                if (st_fd.st_dev, st_fd.st_ino) != (st_path.st_dev, st_path.st_ino):
                    return False  # deleted or replaced behind our back
                if not stat.S_ISREG(st_fd.st_mode):
                    return False  # a device or pipe cannot be rotated or indexed
                if not os.access(self.directory, os.W_OK):
                    return False
                vfs = os.statvfs(self.directory)
            except OSError:
                return False
            return vfs.f_bavail * vfs.f_frsize >= MIN_FREE_BYTES

    def apply_retention(self) -> None:
        """Run retention now (it also runs at open and after each rotation)."""
        with self._lock:
            self._apply_retention()

    def flush(self) -> None:
        """fsync now (a no-op when nothing is pending)."""
        with self._lock:
            if self._fd is not None and self._dirty:
                self._fsync()

    def close(self) -> None:
        if self._flusher is not None:
            self._stop.set()
            self._flusher.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._fd is not None:
                if self.fsync_mode != "never" and self._dirty:
                    try:
                        os.fsync(self._fd)
                    except OSError:
                        pass
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "AuditLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (caller holds self._lock) --------------------------------

    def _open(self) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise _os_error("open", self.path, exc) from None
        try:
            size = os.fstat(fd).st_size
            size = self._cut_torn_tail(fd, size)
        except OSError as exc:
            os.close(fd)
            raise _os_error("open", self.path, exc) from None
        self._fd = fd
        self._size = size

    def _cut_torn_tail(self, fd: int, size: int) -> int:
        # A crash mid-write leaves a line without "\n"; never append after it. Writers hold
        # an exclusive flock for each append, so under the lock a torn tail is a crash
        # leftover, never the record a still-draining gateway (rolling restart) is writing.
        if size == 0:
            return 0
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_ino != os.fstat(fd).st_ino:
                    return size
                end = last_line_end(f)
            if end != size:
                os.ftruncate(fd, end)
            return end
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _write(self, line: bytes) -> None:
        assert self._fd is not None
        # One writer at a time per file, across processes (old + new gateway in a restart).
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            try:
                n = os.write(self._fd, line)
            except OSError as exc:
                raise _os_error("append to", self.path, exc) from None
            if n != len(line):
                # Short write (typically the disk just filled): remove our fragment (we hold
                # the lock: nobody appended after it, so it is the file's last n bytes) so the
                # next record does not glue onto it.
                try:
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - n)
                except OSError:
                    pass  # readers skip it; _open cuts it next time
                raise AuditWriteError(
                    f"audit log: cannot append to {self.path}: short write "
                    f"({n} of {len(line)} bytes), probably {os.strerror(errno.ENOSPC)}",
                    self.path,
                    errno.ENOSPC,
                )
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._size += n

    def _fsync(self) -> None:
        assert self._fd is not None
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            err = _os_error("fsync", self.path, exc)
            self._fsync_error = err
            raise err from None
        self._dirty = False

    def _rotate(self) -> None:
        assert self._fd is not None
        if self.fsync_mode != "never":
            self._fsync()
        os.close(self._fd)
        self._fd = None
        seqs = [rotated_seq(p.name) for p in rotated_files(self.directory)]
        seq = max(seqs, default=0) + 1
        target = self.directory / rotated_name(datetime.now(timezone.utc), seq)
        try:
            os.rename(self.path, target)
        except OSError as exc:
            raise _os_error("rotate", self.path, exc) from None
        self._fsync_dir()
        self._open()
        self._apply_retention()

    def _fsync_dir(self) -> None:
        if self.fsync_mode == "never":
            return
        try:
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass  # best effort: the rename itself succeeded

    def _apply_retention(self) -> None:
        """Delete rotated files beyond keep_files or older than retention_days."""
        try:
            files = rotated_files(self.directory)
        except OSError:
            return
        doomed = files[: max(0, len(files) - self.keep_files)]
        if self.retention_days is not None:
            cutoff = time.time() - self.retention_days * 86400
            for path in files[len(doomed):]:
                try:
                    if path.stat().st_mtime < cutoff:
                        doomed.append(path)
                except FileNotFoundError:
                    pass
        for path in doomed:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                pass  # retention is housekeeping; never fail an append for it

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval):
            try:
                self.flush()
            except AuditWriteError:
                pass  # remembered in _fsync_error; the next append raises it
