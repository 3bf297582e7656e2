"""Secret sweep: search files and captured outputs for a secret in every encoding we know.

Encodings: raw, base64 (standard and url-safe) at the 3 byte alignments,
url-encoded (quote, quote_plus), hex (lower, upper), and optionally the
HTTP Basic form base64("user:secret"). A base64 "alignment" is the run of
characters that depend only on the secret's bytes when it starts at offset
0, 1 or 2 of a 3-byte group: whatever surrounds it, one of the three shows up.
"""
from __future__ import annotations

import base64
import os
import urllib.parse
from pathlib import Path

MAX_FILE_BYTES = 512 * 1024 * 1024  # bounded: nothing in a test run is this big


def encodings(secret: str, basic_users: tuple[str, ...] = ()) -> dict[str, bytes]:
    raw = secret.encode()
    out = {"raw": raw,
           "url": urllib.parse.quote(secret, safe="").encode(),
           "url_plus": urllib.parse.quote_plus(secret).encode(),
           "hex": raw.hex().encode(), "HEX": raw.hex().upper().encode()}
    for k in range(3):
        full = base64.b64encode(bytes(k) + raw)
        lead, end = -(-8 * k // 6), 8 * (k + len(raw)) // 6   # chars made only of secret bits
        out[f"b64_{k}"] = full[lead:end]
        out[f"b64url_{k}"] = full[lead:end].replace(b"+", b"-").replace(b"/", b"_")
    for user in basic_users:
        out[f"basic_{user}"] = base64.b64encode(f"{user}:{secret}".encode())
    return out


def search_blob(name: str, data: bytes, patterns: dict[str, dict[str, bytes]]) -> list[tuple[str, str, str]]:
    """Hits as (where, secret label, encoding)."""
    hits = []
    for label, encs in patterns.items():
        for enc, pat in encs.items():
            if pat and pat in data:
                hits.append((name, label, enc))
    return hits


def walk(roots) -> list[Path]:
    files = []
    for root in roots:
        root = Path(root)
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            for dirpath, _dirs, names in os.walk(root):
                files.extend(Path(dirpath) / n for n in names)
    return sorted(set(files))


def search_files(roots, patterns) -> tuple[list[tuple[str, str, str]], int]:
    """(hits, files searched). Sockets, fifos and oversize files are skipped."""
    hits, n = [], 0
    for f in walk(roots):
        try:
            if not f.is_file() or f.stat().st_size > MAX_FILE_BYTES:
                continue
            data = f.read_bytes()
        except OSError:
            continue
        n += 1
        hits += search_blob(str(f), data, patterns)
    return hits, n


def core_files(extra_dirs=()) -> list[Path]:
    """Core dumps where this machine would put them (core_pattern) plus given dirs."""
    dirs = [Path(d) for d in extra_dirs]
    try:
        pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
    except OSError:
        pattern = "core"
    if pattern.startswith("/"):
        dirs.append(Path(pattern).parent)
    out = []
    for d in dirs:
        if d.is_dir():
            out += [p for p in d.iterdir() if p.is_file() and p.name.startswith("core")]
    return out
