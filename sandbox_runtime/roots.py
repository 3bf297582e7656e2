"""Per-instance roots directories: <ROOTS_DIR>/<instance> (template overlays, shared /etc builds).

Host-wide, so nothing else removes them: a live backend holds a shared flock on
<dir>/.instance.lock, whose text is the instance's state dir; it removes its directory when
it closes with no sandbox left, and at start the directories of dead instances (lock free)
are pruned — unless something is mounted under them or their state dir still lists
sandboxes (sandboxes outlive their daemon: the next one with that state dir adopts them and
their /etc). A directory without a lock file was made before this existed: it is pruned only
when nothing is mounted under it and it has not changed for LEGACY_AGE_S.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from pathlib import Path
from typing import IO

log = logging.getLogger("cubegate.runtime.roots")

LOCK_NAME = ".instance.lock"
LEGACY_AGE_S = 24 * 3600.0


def mounted_under(mountinfo: str, d: Path) -> bool:
    """Whether any mount point in a /proc/*/mountinfo text is `d` or below it."""
    p = str(d).rstrip("/")
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            mp = fields[4].replace("\\040", " ")
            if mp == p or mp.startswith(p + "/"):
                return True
    return False


def has_sandboxes(state_dir: str) -> bool:
    """Whether a (dead) instance's state dir still lists sandboxes (<state>/<id>/handle.json)."""
    return bool(state_dir) and any(Path(state_dir).glob("*/handle.json"))


def _mountinfo() -> str | None:
    try:
        return Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None


def _flock(d: Path, mode: int) -> IO | None:
    """The lock file of `d` opened and locked (`mode`, non-blocking unless LOCK_SH); None when
    another holder has it. Re-checked after locking: a pruner may have removed it meanwhile."""
    while True:
        d.mkdir(parents=True, exist_ok=True)
        try:
            f = os.fdopen(os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600), "a+")
        except FileNotFoundError:
            continue                    # the directory was removed between the two steps
        try:
            fcntl.flock(f, mode)
        except BlockingIOError:
            f.close()
            return None
        try:
            same = os.stat(d / LOCK_NAME).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()


def claim(d: Path, state_dir: Path) -> IO:
    """Mark `d` as used by a live instance (shared: backends of one state dir share it)."""
    f = _flock(d, fcntl.LOCK_SH)
    os.chmod(d, 0o711)
    f.seek(0)
    if f.read() != str(state_dir):
        f.truncate(0)
        f.write(str(state_dir))
        f.flush()
    return f


def release(d: Path, lock: IO, *, sandboxes_left: bool) -> bool:
    """Give up the claim; remove `d` when no other backend of the instance holds it, no
    sandbox is left and nothing is mounted under it. Returns whether it was removed."""
    lock.close()
    if sandboxes_left:
        return False
    return _remove_if_free(d, check_state=False)


def _remove_if_free(d: Path, *, check_state: bool) -> bool:
    f = _flock(d, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if f is None:
        return False                    # alive
    try:
        f.seek(0)
        info = _mountinfo()
        if info is None or mounted_under(info, d) or (check_state and has_sandboxes(f.read().strip())):
            return False
        shutil.rmtree(d, ignore_errors=True)
        return not d.exists()
    finally:
        f.close()


def prune_orphans(parent: Path, keep: Path, now: float | None = None) -> list[str]:
    """Remove the directories under `parent` of instances that are not alive (see the module
    text); never `keep`. Returns the names removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        dirs = [d for d in parent.iterdir() if d.is_dir() and d != keep]
    except OSError:
        return removed
    for d in dirs:
        try:
            if (d / LOCK_NAME).exists():
                gone = _remove_if_free(d, check_state=True)
            else:                       # made before instance locks: only when long unchanged
                info = _mountinfo()
                gone = (info is not None and not mounted_under(info, d)
                        and now - d.stat().st_mtime > LEGACY_AGE_S)
                if gone:
                    shutil.rmtree(d, ignore_errors=True)
                    gone = not d.exists()
        except OSError as e:
            log.warning("roots: cannot prune %s: %s", d, e)
            continue
        if gone:
            removed.append(d.name)
    if removed:
        log.info("roots: removed %d directory(ies) of instances no longer running", len(removed))
    return removed
