"""Attack pass 6 on the sandbox runtime: what a sandbox leaves in its writable layer against
the host-side code that handles that layer as root (clone/rollback seeding), and the
manager's snapshot/clone/rollback calls against a destroy of the same sandbox.

Layer shapes are made by the sandbox's own means (a sparse file, hard links) on a real tmpfs
like the one a sandbox's layer lives on; the code under test runs in a child process, so a
crash of it (SIGBUS) fails the test instead of killing pytest."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OLD, NEW = b"cg-ph-0123456789abcdef0123", b"cg-ph-fedcba9876543210fedc"


def _in_tmpfs(script: str, size_mb: int = 8, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run `script` (python; `d` is a fresh tmpfs of size_mb) in its own mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tmpfs mount)")
    code = textwrap.dedent(f"""
        import os, subprocess, sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from sandbox_runtime.templates import rootfs
        d = Path(tempfile.mkdtemp(prefix="a6tm"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size={size_mb}m", "a6", str(d)], check=True)
        OLD, NEW = {OLD!r}, {NEW!r}
    """) + textwrap.dedent(script)
    return subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=timeout)


def test_a_sparse_file_in_a_layer_does_not_crash_the_token_replacement():
    # A sandbox runs `truncate -s 64G x` in its 8 MiB layer (holes cost nothing); a clone of its
    # snapshot replaces placeholders in the copied layer. Faulting the holes in (mmap) allocates
    # tmpfs pages past the size limit: SIGBUS, the daemon is gone for every tenant.
    r = _in_tmpfs("""
        with open(d / "sparse", "wb") as f:
            f.write(b"x" * 100 + OLD)
            f.truncate(64 << 30)
            f.seek(32 << 30)
            f.write(OLD + b"tail")
        n = rootfs.replace_tokens(d, {OLD: NEW})
        data = open(d / "sparse", "rb")
        head = data.read(200); data.seek(32 << 30); mid = data.read(len(NEW) + 4)
        print(n, OLD in head, NEW in head, mid == NEW + b"tail", os.stat(d / "sparse").st_blocks * 512 < (1 << 20))
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert r.stdout.split() == ["1", "False", "True", "True", "True"], r.stdout


def test_hard_links_are_replaced_once_and_tokens_across_chunks_are_found():
    # Thousands of links to one big file: each inode is read once (not once per name), and a
    # token that straddles the reader's chunk boundary is still replaced.
    r = _in_tmpfs("""
        import resource
        def io():
            rchar = int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
            return rchar + resource.getrusage(resource.RUSAGE_SELF).ru_minflt * 4096
        blob = bytearray(b"a" * (3 << 20))
        at = (1 << 20) - 5                    # straddles a 1 MiB boundary
        blob[at:at + len(OLD)] = OLD
        (d / "big").write_bytes(bytes(blob))
        for i in range(2000):
            os.link(d / "big", d / f"l{i}")
        before = io()
        n = rootfs.replace_tokens(d, {OLD: NEW})
        touched = io() - before               # bytes read + pages faulted in
        got = (d / "l7").read_bytes()
        print(n, got[at:at + len(NEW)] == NEW, OLD not in got, touched < (64 << 20), touched >> 20, file=sys.stderr)
        print(n, got[at:at + len(NEW)] == NEW, OLD not in got, touched < (64 << 20))
    """, size_mb=16)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert r.stdout.split() == ["1", "True", "True", "True"], r.stdout
