"""Compile cubevs/bpf/<name>.c (switch.c, splice.c) into BPF objects (clang -target bpf), cached.

Callable from Python (`build()`, `build(name="splice")`) and as `python -m cubevs.build [OUT_DIR]`
for install/CI (builds every program).  Rebuilds when the .c is newer than the cached .o.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BPF_DIR = Path(__file__).resolve().parent / "bpf"
SOURCE = BPF_DIR / "switch.c"
PROGRAMS = ("switch", "splice")


class BuildError(RuntimeError):
    pass


def _multiarch() -> str:
    try:
        return subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "x86_64-linux-gnu"


def _clang() -> str:
    for name in ("clang", "clang-16", "clang-15", "clang-14"):
        path = shutil.which(name)
        if path:
            return path
    raise BuildError("clang not found (apt install clang libbpf-dev)")


def default_out_dir() -> Path:
    """Next to the source if writable, else a per-user cache dir."""
    if os.access(BPF_DIR, os.W_OK):
        return BPF_DIR / "build"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cubevs"


def build(out_dir: str | os.PathLike | None = None, *, force: bool = False, name: str = "switch") -> Path:
    """Return the path of an up-to-date <name>.o, compiling it if needed."""
    if name not in PROGRAMS:
        raise BuildError(f"unknown BPF program {name!r}")
    source = BPF_DIR / f"{name}.c"
    out = Path(out_dir) if out_dir else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    obj = out / f"{name}.o"
    if not force and obj.exists() and obj.stat().st_mtime >= source.stat().st_mtime:
        return obj
    cmd = [_clang(), "-O2", "-g", "-Wall", "-target", "bpf",
           f"-I/usr/include/{_multiarch()}", "-c", str(source)]
    # compile to a temp file and rename: concurrent builders never see a half-written .o
    fd, tmp = tempfile.mkstemp(dir=out, suffix=".o.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"clang failed ({proc.returncode}):\n{proc.stderr}")
        os.replace(tmp, obj)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return obj


if __name__ == "__main__":
    for prog in PROGRAMS:
        print(build(sys.argv[1] if len(sys.argv) > 1 else None, force=True, name=prog))
