"""Read the audit JSONL files directly: all records in order, or follow new ones.

Torn trailing lines (a write in progress, or a crash mid-write) are never
yielded; garbage lines are skipped.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from .record import from_line
from .segments import (
    CURRENT_NAME, FileKey, Position, file_key, fingerprint, last_line_end, log_files, present_keys,
    read_lines, rotated_files,
)


_MAX_RESTARTS = 10


class LogReader:
    """Incremental reader over one audit directory; remembers where each file was left."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        if not self.log_dir.is_dir():
            raise FileNotFoundError(f"audit directory not found: {self.log_dir}")
        self._positions: dict[FileKey, Position] = {}

    def read_new(self) -> Iterator[dict[str, Any]]:
        """Yield records appended since the last call, in write order."""
        # If the current file is rotated while we read, start the pass over:
        # the rotated file's tail must come before the new current file.
        for _ in range(_MAX_RESTARTS):
            if not (yield from self._pass()):
                break
        # Forget files that are gone (retention); a rotated file keeps its key.
        present = present_keys(self.log_dir)
        for gone in set(self._positions) - present:
            del self._positions[gone]

    def _pass(self) -> Iterator[dict[str, Any]]:
        """One pass over the files; returns True if it must be restarted."""
        files = log_files(self.log_dir)
        listed_rotated = {p.name for p in files if p.name != CURRENT_NAME}
        for path in files:
            is_current = path.name == CURRENT_NAME
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                if is_current:
                    return True   # renamed between listing and open
                continue          # removed by retention
            with f:
                if is_current and {p.name for p in rotated_files(self.log_dir)} - listed_rotated:
                    return True   # rotated since listing: read the rotated file first
                key = file_key(os.fstat(f.fileno()))
                for line, pos in read_lines(f, self._positions.get(key), final=not is_current):
                    self._positions[key] = pos
                    rec = from_line(line)
                    if rec is not None:
                        yield rec
                if is_current and self._rotated_since(key):
                    return True
        return False

    def _rotated_since(self, key: FileKey) -> bool:
        """Was the current file (key) renamed while we read it? Then re-read it as rotated."""
        try:
            return file_key(os.stat(self.log_dir / CURRENT_NAME)) != key
        except FileNotFoundError:
            return True

    def skip_existing(self) -> None:
        """Mark everything written so far as read (like `tail -f -n 0`)."""
        for path in log_files(self.log_dir):
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                continue
            with f:
                key = file_key(os.fstat(f.fileno()))
                self._positions[key] = Position(last_line_end(f), fingerprint(f))


def iter_records(log_dir: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """All records currently in the directory, oldest file first."""
    yield from LogReader(log_dir).read_new()


def follow(
    log_dir: str | os.PathLike,
    poll: float = 0.2,
    stop_event: threading.Event | None = None,
    *,
    from_start: bool = False,
    reader: LogReader | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield records as they are appended (across rotation) until stop_event is set.

    Starts at the end of the existing files unless from_start, or continues
    wherever `reader` left off when one is given.
    """
    if reader is None:
        reader = LogReader(log_dir)
        if not from_start:
            reader.skip_existing()
    while stop_event is None or not stop_event.is_set():
        got = False
        for rec in reader.read_new():
            got = True
            yield rec
        if not got:
            if stop_event is not None:
                stop_event.wait(poll)
            else:
                time.sleep(poll)
