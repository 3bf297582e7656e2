"""The template cache: <cache_dir>/<key>/{rootfs/, manifest.json}, keyed by content address.

A name resolves through its definition's key, so changing a definition (or the
recipe) makes a new key and an old build is never used by mistake; `ls` shows
what is built and whether it is still current; `rm` (and a forced rebuild) refuses a
template that a live sandbox uses: a namespace sandbox has its rootfs mounted as an
overlay's lower layer (removing it under the mount is undefined behaviour in the kernel),
a microVM's qemu holds its disk image (vmdisk, in the template's directory) open.
"""
from __future__ import annotations

import fcntl
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import definitions
from .build import build as _build
from .progress import Progress


class TemplateError(RuntimeError):
    pass


class TemplateNotBuilt(TemplateError):
    pass


@dataclass(frozen=True)
class Template:
    name: str
    key: str
    rootfs: Path
    env: dict = field(default_factory=dict)
    tools: dict = field(default_factory=dict)    # {"certutil": bool, "keytool": bool}


def overlay_lowerdirs(mountinfo: str) -> set[str]:
    """Every lower directory of the overlay mounts listed in a /proc/*/mountinfo text."""
    out = set()
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep or not post.startswith("overlay "):
            continue
        for opt in post.split(" ", 2)[-1].split(","):
            if opt.startswith("lowerdir="):
                out.update(p.replace("\\040", " ") for p in opt[9:].split(":"))
    return out


def held_open_under(targets: set[str], root: Path) -> bool:
    """Whether any of the open-file paths `targets` (readlink of /proc/*/fd/*) lies under `root`."""
    prefix = str(root).rstrip("/") + "/"
    return any(t.startswith(prefix) for t in targets)


def open_file_targets(proc: Path = Path("/proc")) -> set[str] | None:
    """The paths every process holds open; None when some process's files cannot be read
    (not root): the caller cannot tell, and fails closed."""
    out = set()
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            fds = list((pid / "fd").iterdir())
        except PermissionError:
            return None
        except OSError:
            continue            # exited meanwhile
        for fd in fds:
            try:
                out.add(str(fd.readlink()))
            except OSError:
                continue        # closed meanwhile
    return out


class TemplateStore:
    def __init__(self, cache_dir: str | Path, defs_dir: Path = definitions.DEFS_DIR):
        self.cache_dir = Path(cache_dir)
        self.defs_dir = defs_dir

    def definition(self, name: str) -> definitions.Definition:
        try:
            return definitions.load(name, self.defs_dir)
        except definitions.DefinitionError as e:
            raise TemplateError(str(e)) from None

    def _manifest(self, key: str) -> dict | None:
        try:
            return json.loads((self.cache_dir / key / "manifest.json").read_text())
        except (OSError, ValueError):
            return None

    def resolve(self, name: str) -> Template:
        d = self.definition(name)
        m = self._manifest(d.key)
        if m is None:
            raise TemplateNotBuilt(f"template {name!r} is not built (cubegate template build {name})")
        return Template(name=name, key=d.key, rootfs=self.cache_dir / d.key / "rootfs", env=dict(m.get("env", {})),
                        tools=dict(m.get("tools", {})))

    @contextmanager
    def _lock(self, key: str):
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cache_dir / f".lock-{key}", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)      # one build of a key at a time (CI jobs, two shells)
            yield

    def build(self, name: str, *, force: bool = False, progress: Progress | None = None) -> Template:
        d = self.definition(name)
        with self._lock(d.key):
            if self._manifest(d.key) is not None and not force:
                return self.resolve(name)
            if force and self._in_use(self.cache_dir / d.key):
                raise TemplateError(f"template {name!r} is in use by a running sandbox; not rebuilt")
            _build(d, self.cache_dir, progress=progress)
        return self.resolve(name)

    def list(self) -> list[dict]:
        """Built templates (current and stale) and the defined-but-unbuilt ones."""
        current = {}
        for n in definitions.names(self.defs_dir):
            try:
                current[definitions.load(n, self.defs_dir).key] = n
            except definitions.DefinitionError:
                continue
        rows = []
        for mf in sorted(self.cache_dir.glob("*/manifest.json")):
            m = self._manifest(mf.parent.name)
            if m is None:
                continue
            key = mf.parent.name
            rows.append({"name": m.get("name"), "key": key, "built": True, "current": key in current,
                         "size_bytes": m.get("size_bytes"), "packages": len(m.get("installed", {})),
                         "build_seconds": m.get("build_seconds"), "image_sha256": m.get("image_sha256"),
                         "in_use": self._in_use(mf.parent)})
        built = {r["key"] for r in rows}
        rows += [{"name": n, "key": key, "built": False, "current": True}
                 for key, n in current.items() if key not in built]
        return sorted(rows, key=lambda r: (r["name"] or "", not r["current"]))

    def remove(self, name: str) -> list[str]:
        """Remove every build of `name` (current and stale); returns the removed keys."""
        keys = [mf.parent.name for mf in self.cache_dir.glob("*/manifest.json")
                if (self._manifest(mf.parent.name) or {}).get("name") == name]
        busy = [k for k in keys if self._in_use(self.cache_dir / k)]
        if busy:
            raise TemplateError(f"template {name!r} is in use by running sandbox(es) (a namespace sandbox's "
                                f"mount or a microVM's disk image); destroy them first")
        for k in keys:
            with self._lock(k):
                shutil.rmtree(self.cache_dir / k)
            (self.cache_dir / f".lock-{k}").unlink(missing_ok=True)
        return keys

    @staticmethod
    def _in_use(template_dir: Path) -> bool:
        """A namespace sandbox's overlay on its rootfs, or a process (a microVM's qemu) holding
        a file of it open (its disk image). Cannot tell: in use (fail closed, do not delete)."""
        try:
            text = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return True
        if str(template_dir / "rootfs") in overlay_lowerdirs(text):
            return True
        targets = open_file_targets()
        return targets is None or held_open_under(targets, template_dir)
