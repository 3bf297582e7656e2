"""Audit log file naming, ordering and incremental line reading.

The writer appends to `audit-current.jsonl` and renames it to
`audit-YYYYmmddTHHMMSS-N.jsonl` on rotation, N a sequence number that only
grows (files are ordered by N, so a clock jump cannot reorder them).

Readers remember a position per file by (st_dev, st_ino) — a rename keeps the
inode — plus a fingerprint of the file's first bytes (which hold the first
record's unique id), so a reused inode is noticed and read from the start.
"""
from __future__ import annotations

import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

CURRENT_NAME = "audit-current.jsonl"
_ROTATED_RE = re.compile(r"^audit-(\d{8}T\d{6})-(\d+)\.jsonl$")
FINGERPRINT_LEN = 64


def rotated_name(when: datetime, seq: int) -> str:
    return f"audit-{when.astimezone(timezone.utc):%Y%m%dT%H%M%S}-{seq}.jsonl"


def rotated_seq(name: str) -> int | None:
    m = _ROTATED_RE.match(name)
    return int(m.group(2)) if m else None


def rotated_files(log_dir: str | os.PathLike) -> list[Path]:
    """Rotated files, oldest first."""
    found = []
    for entry in os.scandir(log_dir):
        seq = rotated_seq(entry.name)
        if seq is not None and entry.is_file():
            found.append((seq, entry.name))
    found.sort()
    return [Path(log_dir) / name for _, name in found]


def log_files(log_dir: str | os.PathLike) -> list[Path]:
    """All log files in write order: rotated (oldest first), then the current file."""
    files = rotated_files(log_dir)
    current = Path(log_dir) / CURRENT_NAME
    if current.exists():
        files.append(current)
    return files


def present_keys(log_dir: str | os.PathLike) -> set["FileKey"]:
    """Keys of the log files that exist right now.

    The current file is looked at first: if it is renamed right after, the
    listing of rotated files that follows already shows it under its new name.
    """
    keys = set()
    try:
        keys.add(file_key(os.stat(Path(log_dir) / CURRENT_NAME)))
    except FileNotFoundError:
        pass
    for path in rotated_files(log_dir):
        try:
            keys.add(file_key(os.stat(path)))
        except FileNotFoundError:
            pass  # removed by retention
    return keys


class Position(NamedTuple):   # (a tuple: one is made per line read, and a frozen dataclass costs ~1 us)
    offset: int          # byte offset just past the last consumed line
    fingerprint: bytes   # first bytes of the file when last read


FileKey = tuple[int, int]  # (st_dev, st_ino)


def file_key(st: os.stat_result) -> FileKey:
    return (st.st_dev, st.st_ino)


def _start_offset(f: BinaryIO, known: Position | None, size: int) -> int:
    if known is None or known.offset > size:
        return 0
    f.seek(0)
    if f.read(len(known.fingerprint)) != known.fingerprint:
        return 0
    return known.offset


def read_lines(
    f: BinaryIO, known: Position | None, *, final: bool
) -> Iterator[tuple[bytes, Position]]:
    """Yield (complete_line, position_after_it) from where `known` left off.

    A trailing line without "\\n" is a write in progress (or torn by a crash):
    it is not yielded and not consumed — unless `final` (a rotated file, which
    never grows again), where it is yielded as-is so the caller can count it as
    garbage and move past it.
    """
    size = os.fstat(f.fileno()).st_size
    start = _start_offset(f, known, size)
    f.seek(0)
    fingerprint = f.read(FINGERPRINT_LEN)
    f.seek(start)
    offset = start
    for line in f:
        if not line.endswith(b"\n") and not final:
            return
        offset += len(line)
        yield line, Position(offset, fingerprint)


def last_line_end(f: BinaryIO) -> int:
    """Offset just past the last "\\n" in the file (0 if none)."""
    size = os.fstat(f.fileno()).st_size
    end = size
    block = 4096
    while end > 0:
        start = max(0, end - block)
        f.seek(start)
        chunk = f.read(end - start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        end = start
    return 0


def fingerprint(f: BinaryIO) -> bytes:
    f.seek(0)
    return f.read(FINGERPRINT_LEN)
