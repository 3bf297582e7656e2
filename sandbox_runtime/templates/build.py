"""Build a template's root filesystem with mmdebstrap (apt: mmdebstrap).

    mmdebstrap --mode=unshare --variant=essential --include=<packages> bookworm <tmp>/image.tar <mirror>
      with SOURCE_DATE_EPOCH fixed, docs/man/locales filtered out, the .deb files
      kept in <cache>/debs between builds (sync-in / sync-out hooks)
    → tar extracted (numeric owners, xattrs) into <cache>/<key>.tmp/rootfs
    → checked, manifest.json written (installed packages + versions, image SHA-256)
    → renamed to <cache>/<key> (atomic: a half-built template is never found)

Only argv construction and the status/manifest parsing are pure; the rest is
subprocess I/O with a time limit.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .definitions import DPKG_FILTERS, SOURCE_DATE_EPOCH, Definition
from .progress import Progress, extra_phase

MMDEBSTRAP = "/usr/bin/mmdebstrap"
BUILD_TIMEOUT_S = 1800
# What every template must contain for the namespace backend to start it.
REQUIRED = ("usr/bin/sh", "usr/bin/env", "etc/ssl/certs/ca-certificates.crt", "workspace", ".cubegate/agent")


class BuildError(RuntimeError):
    pass


def mmdebstrap_argv(d: Definition, image: Path, debs: Path) -> list[str]:
    a = [MMDEBSTRAP, "--mode=unshare", f"--variant={d.variant}", f"--architectures={d.arch}",
         "--include=" + ",".join(d.packages), "--skip=essential/unlink",
         '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
         f"--setup-hook=sync-in {debs} /var/cache/apt/archives/",
         f"--customize-hook=sync-out /var/cache/apt/archives {debs}",
         '--customize-hook=rm -f "$1"/var/cache/apt/archives/*.deb',
         # mount points the namespace backend binds onto (it cannot create them in a read-only image)
         '--customize-hook=mkdir -p "$1"/workspace "$1"/.cubegate && : > "$1"/.cubegate/agent',
         # fresh per sandbox, never baked in
         '--customize-hook=rm -f "$1"/etc/machine-id "$1"/var/lib/dbus/machine-id "$1"/etc/hostname',
         ]
    a += [f"--dpkgopt={f}" for f in DPKG_FILTERS]
    a += [d.suite, str(image), d.mirror]
    return a


def parse_dpkg_status(text: str) -> dict[str, str]:
    """{package: version} of the installed packages in a dpkg status file."""
    out, pkg, ver, ok = {}, None, None, False
    for line in text.splitlines() + [""]:
        if not line.strip():
            if pkg and ver and ok:
                out[pkg] = ver
            pkg, ver, ok = None, None, False
        elif line.startswith("Package: "):
            pkg = line[9:].strip()
        elif line.startswith("Version: "):
            ver = line[9:].strip()
        elif line.startswith("Status: "):
            ok = line.strip().endswith(" installed")
    return dict(sorted(out.items()))


def missing_paths(rootfs: Path) -> list[str]:
    return [p for p in REQUIRED if not os.path.lexists(rootfs / p)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _run_mmdebstrap(argv: list[str], progress: Progress, log_path: Path, timeout: float) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH),
           "TMPDIR": str(log_path.parent)}
    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True, errors="replace", start_new_session=True)
        try:
            for line in proc.stdout:
                log.write(line)
                progress.line(line)
                if time.monotonic() > deadline:
                    raise BuildError(f"mmdebstrap took longer than {timeout:.0f}s")
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        raise BuildError(f"mmdebstrap failed (exit {rc}):\n" + "\n".join(tail))


def build(d: Definition, cache_dir: Path, *, progress: Progress | None = None,
          timeout: float = BUILD_TIMEOUT_S) -> Path:
    """Build `d` into cache_dir/<key> and return that directory (the caller holds the build lock)."""
    if not os.access(MMDEBSTRAP, os.X_OK):
        raise BuildError("mmdebstrap not found (apt-get install mmdebstrap)")
    progress = progress or Progress(d.name)
    final = cache_dir / d.key
    work = cache_dir / f"{d.key}.tmp"
    debs = cache_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.monotonic()
    try:
        image = work / "image.tar"
        _run_mmdebstrap(mmdebstrap_argv(d, image, debs), progress, work / "build.log", timeout)
        progress.phase(extra_phase("extracting the image"))
        rootfs = work / "rootfs"
        rootfs.mkdir()
        r = subprocess.run(["tar", "-x", "--numeric-owner", "-p", "--xattrs", "--xattrs-include=*",
                            "-f", str(image), "-C", str(rootfs)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise BuildError(f"extracting the image failed: {r.stderr.strip()[-500:]}")
        progress.phase(extra_phase("checking the image"))
        missing = missing_paths(rootfs)
        if missing:
            raise BuildError(f"built image lacks {', '.join(missing)}")
        status = (rootfs / "var/lib/dpkg/status").read_text(errors="replace")
        manifest = {
            "name": d.name, "key": d.key, "description": d.description, "inputs": d.inputs(), "env": d.env,
            "installed": parse_dpkg_status(status), "image_sha256": _sha256(image),
            "size_bytes": _du(rootfs), "build_seconds": round(time.monotonic() - t0, 1), "built": time.time(),
            "tools": {"certutil": (rootfs / "usr/bin/certutil").exists(),
                      "keytool": os.path.lexists(rootfs / "usr/bin/keytool")},
        }
        image.unlink()
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.chmod(work, 0o755)        # sandboxes run as their own uid: they must traverse to rootfs
        shutil.rmtree(final, ignore_errors=True)
        work.rename(final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    progress.done(f"built {d.key[:12]}")
    return final
