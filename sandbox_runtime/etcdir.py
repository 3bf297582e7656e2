"""The shared part of a template-less sandbox's /etc, as one read-only directory on the host.

bwrap pays ~0.6 ms for every file it binds read-only (bind + remount + a parse of
/proc/self/mountinfo), and the old /etc took 16 of them per start (9 host files +
7 generated, one the 220 KB CA bundle). Everything in it that does not name the
sandbox is the same for every sandbox of a backend: it is built once into
`<root>/<key>/` and bound as a whole (one mount); only `hosts` and `hostname` (the
sandbox id) stay per sandbox (namespace.SANDBOX_ETC), bound over the empty
placeholders this directory holds for them.

- Content-addressed: the key is a digest of the content itself, so a changed host
  file or CA bundle gives a new directory and a running sandbox keeps the one it
  was started with. Built in a temporary directory and renamed into place:
  concurrent starts either find it complete or build their own copy (the loser's
  rename fails and it is removed).
- Nothing sandbox-specific and nothing secret is in it (public CA certificates, the
  gateway address, generic passwd/group); it is root-owned, 0755/0644, and bound
  read-only.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Symlink:
    target: str


Content = dict[str, "bytes | Symlink"]     # path relative to /etc -> file bytes or a symlink


def read_host_entries(names: tuple[str, ...], etc: Path = Path("/etc")) -> Content:
    """The given host /etc entries (files, symlinks, directories of them), as content."""
    out: Content = {}
    for name in names:
        p = etc / name
        if p.is_symlink():
            out[name] = Symlink(os.readlink(p))
        elif p.is_dir():
            for dirpath, _dirs, files in os.walk(p):
                for f in files:
                    full = Path(dirpath) / f
                    rel = str(full.relative_to(etc))
                    out[rel] = Symlink(os.readlink(full)) if full.is_symlink() else full.read_bytes()
        elif p.is_file():
            out[name] = p.read_bytes()
    return out


def signature(paths: list[Path]) -> tuple:
    """A cheap fingerprint of the sources (lstat of each, and of the files in a directory;
    a symlink in a directory is replaced by rename, which changes the directory's mtime):
    when it is unchanged, the content is too and need not be read and hashed again."""
    sig = []
    for p in paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            sig.append((str(p), None))
            continue
        sig.append((str(p), st.st_ino, st.st_size, st.st_mtime_ns))
        if os.path.isdir(p) and not os.path.islink(p):
            with os.scandir(p) as it:
                for e in it:
                    if not e.is_symlink():
                        est = e.stat(follow_symlinks=False)
                        sig.append((e.path, est.st_ino, est.st_size, est.st_mtime_ns))
    return tuple(sig)


def key(content: Content) -> str:
    h = hashlib.sha256()
    for rel in sorted(content):
        v = content[rel]
        kind, data = (b"L", v.target.encode()) if isinstance(v, Symlink) else (b"F", v)
        h.update(b"%s%d:%s\0%d:" % (kind, len(rel.encode()), rel.encode(), len(data)))
        h.update(data)
    return h.hexdigest()[:32]


def ensure(root: Path, content: Content, *, mode: int = 0o755) -> Path:
    """<root>/<key>: a directory holding exactly `content`, built if it is not there yet
    (root gets `mode`: 0711 lets a sandbox's uid traverse it without listing it)."""
    root = Path(root)
    dest = root / key(content)
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, mode)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        os.chmod(tmp, 0o755)
        for rel, v in content.items():
            p = tmp / rel
            _mkdirs(tmp, p.parent)
            if isinstance(v, Symlink):
                os.symlink(v.target, p)
            else:
                p.write_bytes(v)
                os.chmod(p, 0o644)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():       # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _mkdirs(top: Path, d: Path) -> None:
    missing = []
    while d != top and not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir(mode=0o755)
        os.chmod(m, 0o755)      # not subject to the umask
