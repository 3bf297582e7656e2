"""Each sandbox's own pseudo-terminals: a devpts instance that holds at most PTYS_PER_SANDBOX.

bwrap's --dev mounts a new devpts instance without a `max`, and every instance but the
host's draws from one kernel-wide pool (kernel.pty.max minus kernel.pty.reserve: 3072
here). One sandbox opening /dev/ptmx in a loop took all of it, and no other sandbox could
open a terminal (python's pty, script, ssh, a shell under expect) until it let go.

The daemon mounts the instance (as root: `max=` is ours to set, not the sandbox's), the
start clones it into the launcher's view like the sandbox's other trees (launcher.py), bwrap
binds it over /dev/pts (/dev/ptmx is its pts/ptmx), and the host's mount goes right after
the claim: the clone keeps the instance for as long as the sandbox lives.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

PTYS_PER_SANDBOX = 64
MS_NOSUID, MS_NOEXEC, MNT_DETACH = 0x2, 0x8, 0x2

_libc = ctypes.CDLL(None, use_errno=True)


def options(max_ptys: int = PTYS_PER_SANDBOX) -> str:
    """devpts mount options: what bwrap's own instance has, and the bound."""
    return f"newinstance,ptmxmode=0666,mode=0620,max={max_ptys}"


def mount_instance(path: Path, max_ptys: int = PTYS_PER_SANDBOX) -> None:
    """A new devpts instance at `path` (made here, empty); OSError if the kernel refuses."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if _libc.mount(b"devpts", os.fsencode(path), b"devpts", ctypes.c_ulong(MS_NOSUID | MS_NOEXEC),
                   options(max_ptys).encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount devpts at {path}: {os.strerror(err)}")


def release(path: Path) -> None:
    """The host's mount of the instance (lazily: a clone of it may still be attached)."""
    _libc.umount2(os.fsencode(path), MNT_DETACH)
    try:
        path.rmdir()
    except OSError:
        pass
