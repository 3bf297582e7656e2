"""A sandbox's root filesystem from a template: the template read-only, a writable layer.

    <mdir> = <roots_dir>/<sandbox id>  (default /run/cubegate/roots: 0711, so bwrap, already
                  running as the sandbox's uid, reaches it whatever the state dir's mode)
    <mdir>/rw     tmpfs, size = the sandbox's disk limit (its pages are charged to the
                  memory cgroup of whoever writes them: the sandbox), inodes bounded by it
    <mdir>/rw/upper, /rw/work       overlayfs upper and work directories
    <mdir>/root   overlay: lowerdir=<template rootfs> (shared, never written),
                  upperdir=rw/upper — what bwrap binds as the sandbox's /

Before the overlay is mounted, the generated /etc files and the trust files
(trust.py) are written into the upper layer as root: the sandbox reads them
and cannot change them. /workspace and /tmp in the upper layer belong to the
sandbox's host uid. The snapshot of a sandbox is this upper layer.

Mounts are made with mount(2) through ctypes (no fork) in the daemon's mount
namespace and detached on release; release never deletes files under a mount
that is still there.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
import subprocess
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
MNT_DETACH = 2
MS_NOSUID, MS_NODEV = 0x2, 0x4
ROOTS_DIR = Path("/run/cubegate/roots")


class RootfsError(RuntimeError):
    pass


def _mount(src: str, target: Path, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(src.encode(), str(target).encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise RootfsError(f"mount {fstype} on {target}: {os.strerror(err)}")


def _umount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):      # EINVAL: not a mount point; ENOENT: gone
            raise RootfsError(f"umount {target}: {os.strerror(err)}")


def is_mounted(path: Path) -> bool:
    p = str(path)
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split(" ")[4] == p for line in f)
    except OSError:
        return True          # cannot tell: treat as mounted (never delete under it)


def _write_root_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".cg-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    tmp.replace(path)


def layer_inodes(disk_mb: int) -> int:
    """Files a layer may hold: one per 4 KiB of its size (what mke2fs gives a small disk). A
    tmpfs's default is half the host's RAM pages: a sandbox could make millions of empty files
    (cheap in its memory limit), and each snapshot copied them all onto the host's disk."""
    return max(1024, int(disk_mb) * 256)


def upper_dir(mdir: Path) -> Path:
    return mdir / "rw" / "upper"


def root_dir(mdir: Path) -> Path:
    return mdir / "root"


def prepare(mdir: Path, lower: Path, *, disk_mb: int, uid: int, files: dict[str, bytes],
            seed_upper: Path | None = None, seed_uid: int | None = None,
            seed_tokens: dict[str, str] | None = None) -> Path:
    """Mount the sandbox's root; returns <mdir>/root. `files`: absolute path -> content,
    written into the upper layer. `seed_upper`: a snapshot's upper layer to start from
    (its files owned by `seed_uid` are given to `uid`, and every `seed_tokens` key in them
    is replaced by its value: the snapshotted sandbox's placeholders by this one's)."""
    if not (lower / "usr").is_dir():
        raise RootfsError(f"template root {lower} is missing or incomplete")
    rw, root = mdir / "rw", root_dir(mdir)
    mdir.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(mdir.parent, 0o711)
    mdir.mkdir(mode=0o711)
    rw.mkdir(mode=0o700)
    root.mkdir(mode=0o755)
    try:
        _mount("cubegate-rw", rw, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={int(disk_mb)}m,nr_inodes={layer_inodes(disk_mb)},mode=0700")
        upper, work = upper_dir(mdir), rw / "work"
        if seed_upper is not None:
            copy_layer(seed_upper, upper, from_uid=seed_uid, to_uid=uid)
            replace_tokens(upper, {k.encode(): v.encode() for k, v in (seed_tokens or {}).items() if k != v})
        else:
            upper.mkdir(mode=0o755)
        work.mkdir(mode=0o700)
        for d, mode in (("workspace", 0o700), ("tmp", 0o1777)):
            p = upper / d
            p.mkdir(mode=mode, exist_ok=True)
            if d == "workspace":
                os.chown(p, uid, uid)
            os.chmod(p, mode)
        for abspath, data in files.items():
            _write_root_file(upper / abspath.lstrip("/"), data)
        _mount("cubegate-root", root, "overlay", MS_NOSUID | MS_NODEV,
               f"lowerdir={lower},upperdir={upper},workdir={work},volatile")
    except BaseException:
        release(mdir)
        raise
    return root


def copy_layer(src: Path, dst: Path, *, from_uid: int | None, to_uid: int) -> None:
    """Copy an upper layer with `cp -a` (overlay whiteouts are 0:0 char devices and opaque
    directories are xattrs: both kept); files of the old sandbox uid become the new one's."""
    r = subprocess.run(["cp", "-a", "--no-target-directory", str(src), str(dst)], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        raise RootfsError(f"copying the writable layer failed: {r.stderr.strip()[-300:]}")
    if from_uid is None or from_uid == to_uid:
        return
    for base, dirs, files in os.walk(dst):
        for name in (*dirs, *files):
            p = os.path.join(base, name)
            st = os.lstat(p)
            if st.st_uid == from_uid:
                os.lchown(p, to_uid, to_uid if st.st_gid == from_uid else st.st_gid)


def replace_tokens(root: Path, tokens: dict[bytes, bytes]) -> int:
    """Replace each key by its value (same length: offsets in binary files stay) in every
    regular file under root, in place. Returns how many files changed.

    The layer is the sandbox's: only the data it holds is read (a sparse file's holes hold no
    token and are never faulted in: on tmpfs that would allocate past the size limit and
    SIGBUS the daemon), each inode once (hard links), in bounded chunks."""
    if not tokens:
        return 0
    if any(len(k) != len(v) or not k or b"\0" in k for k, v in tokens.items()):
        raise RootfsError("token replacement needs non-empty tokens of equal length without NUL")
    changed, seen = 0, set()
    for base, _, names in os.walk(root):
        for name in names:
            p = os.path.join(base, name)
            try:
                fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue          # symlinks, devices (whiteouts), sockets
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                changed += _replace_in_file(fd, st.st_size, tokens)
            finally:
                os.close(fd)
    return changed


_CHUNK = 1 << 20


def _data_extents(fd: int, size: int):
    """(start, end) of each data region (SEEK_DATA/SEEK_HOLE; the whole file where unsupported)."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == 6:          # ENXIO: no data after pos
                return
            yield pos, size           # no hole support: all of it is data
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        pos = end


def _replace_in_file(fd: int, size: int, tokens: dict[bytes, bytes]) -> bool:
    """A token holds no NUL, so none spans a hole: each data region is searched on its own,
    chunk by chunk with an overlap of the longest token."""
    overlap = max(len(k) for k in tokens) - 1
    hit = False
    for start, end in _data_extents(fd, size):
        pos = start
        while pos < end:
            buf = bytearray(os.pread(fd, min(_CHUNK + overlap, end - pos), pos))
            if not buf:
                break
            dirty = False
            for old, new in tokens.items():
                i = buf.find(old)
                while i >= 0:
                    buf[i:i + len(old)] = new
                    dirty = True
                    i = buf.find(old, i + len(old))
            if dirty:
                view, at = memoryview(buf), pos
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
                hit = True
            if pos + len(buf) >= end:
                break
            pos += max(len(buf) - overlap, 1)
    return hit


def release(mdir: Path) -> None:
    """Unmount overlay and tmpfs (lazily: a process still inside keeps its view until it dies)."""
    for target in (root_dir(mdir), mdir / "rw"):
        if target.exists():
            _umount(target)
            if is_mounted(target):
                raise RootfsError(f"{target} is still mounted")
    for d in (root_dir(mdir), mdir / "rw", mdir):   # empty mount points only: never a recursive delete
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
