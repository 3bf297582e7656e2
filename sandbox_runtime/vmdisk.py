"""A built template as a read-only disk image for microVMs: <template dir>/rootfs.<FORMAT>.ext4.

One image per template key (the key addresses the root filesystem's content, so the image
needs no key of its own beyond its format), made once with `mkfs.ext4 -d` (e2fsprogs; ext4
is built into the guest kernel), under an exclusive lock, bounded in time, written to a
temporary name and renamed, then made read-only. It lives next to the template, so
`cubegate template rm` removes it with it. Guests mount it read-only under an overlay
whose writable layer is guest memory (assets.INIT); the image itself never changes.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from contextlib import suppress
from pathlib import Path

from sandbox_runtime import filelock

FORMAT = 1                  # bump when the mkfs recipe changes
MKFS_TIMEOUT_S = 300.0
BLOCK = 4096
# fixed so the same tree gives the same filesystem identity (not byte-identical: inode order)
FS_UUID = "c0be9a7e-0000-4000-8000-000000000001"
HASH_SEED = "c0be9a7e-0000-4000-8000-000000000002"


class DiskError(RuntimeError):
    pass


def image_path(template_dir: Path) -> Path:
    return Path(template_dir) / f"rootfs.{FORMAT}.ext4"


def image_id(img: Path) -> str | None:
    """Which build of the image this is (None: there is none). A memory snapshot holds the
    guest's cache of the disk: it may only be restored over the very image it was taken on,
    and a template rebuilt under the same key (newer packages) gives a new image."""
    try:
        st = os.stat(img)
    except OSError:
        return None
    return hashlib.sha256(f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}".encode()).hexdigest()[:16]


def tree_usage(root: Path) -> tuple[int, int]:
    """(bytes rounded up to blocks, number of inodes) of a tree, symlinks not followed."""
    total, inodes = 0, 0
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            inodes += 1
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            total += -(-st.st_size // BLOCK) * BLOCK
    return total, inodes + 1


def image_size(used_bytes: int, inodes: int) -> tuple[int, int]:
    """(image bytes, inode count): the tree plus room for metadata and inode tables; the image
    is sparse, so slack costs no disk. Nothing is ever written to it."""
    n_inodes = inodes + inodes // 4 + 1024
    size = used_bytes + used_bytes // 5 + n_inodes * 256 + (64 << 20)
    return -(-size // (1 << 20)) * (1 << 20), n_inodes


def mkfs_argv(src: Path, dest: Path, size: int, n_inodes: int) -> list[str]:
    return ["mkfs.ext4", "-q", "-F", "-t", "ext4", "-d", str(src), "-b", str(BLOCK), "-N", str(n_inodes),
            "-m", "0", "-L", "cgroot", "-U", FS_UUID, "-E", f"hash_seed={HASH_SEED},root_owner=0:0",
            # no journal (mounted read-only), no resize reserve
            "-O", "^has_journal,^resize_inode", str(dest), str(size // 1024) + "k"]


def ensure_image(template_dir: Path, rootfs: Path, *, timeout: float = MKFS_TIMEOUT_S) -> Path:
    """The image of `rootfs` (built if missing); raises DiskError with the reason."""
    img = image_path(template_dir)
    if img.is_file():
        return img
    if shutil.which("mkfs.ext4") is None:
        raise DiskError("mkfs.ext4 not installed (apt: e2fsprogs)")
    if not Path(rootfs).is_dir():
        raise DiskError(f"template root {rootfs} missing")
    with filelock.exclusive(Path(template_dir) / f".rootfs.{FORMAT}.ext4.lock"):
        if img.is_file():
            return img
        tmp = img.with_name(img.name + f".tmp-{os.getpid()}")
        used, inodes = tree_usage(rootfs)
        size, n_inodes = image_size(used, inodes)
        try:
            r = subprocess.run(mkfs_argv(rootfs, tmp, size, n_inodes), capture_output=True, text=True,
                               timeout=timeout, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                                     "E2FSPROGS_FAKE_TIME": "1704067200"})
            if r.returncode != 0:
                raise DiskError(f"mkfs.ext4 -d {rootfs} failed: {(r.stderr or r.stdout).strip()[-300:]}")
            os.chmod(tmp, 0o444)      # qemu (as the sandbox's uid) reads it; nobody writes it
            os.replace(tmp, img)
        except subprocess.TimeoutExpired:
            raise DiskError(f"mkfs.ext4 -d {rootfs} took longer than {timeout:.0f} s") from None
        finally:
            with suppress(FileNotFoundError):
                tmp.unlink()
    return img
