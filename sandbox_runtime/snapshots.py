"""Sandbox snapshots on disk: a copy of a sandbox's writable layer and what it was taken from.

    <dir>/<snapshot id>/meta.json   id, sandbox, tenant, backend, template (+ build key),
                                    limits, host uid of the layer's files, size, created,
                                    network options (clones inherit them)
    <dir>/<snapshot id>/layer/      the overlay upper layer (namespace backend), copied as root

Files only, never processes: a clone or a rollback starts fresh processes on a
copy of the files. The directory is root's (0700): a snapshot may hold whatever
the sandbox wrote. A snapshot is written under a temporary name and renamed,
so a crash never leaves a half-copied one that looks complete.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from .backend import Limits, SandboxError

SNAPSHOT_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class SnapshotNotFound(SandboxError):
    pass


@dataclass(frozen=True)
class Snapshot:
    id: str
    sandbox: str                # the sandbox it was taken from (may be gone since)
    tenant: str
    backend: str
    template: str | None
    template_key: str | None    # the template build the layer sits on
    limits: Limits
    layer_uid: int | None       # host uid owning the sandbox's files in the layer
    size_bytes: int
    created: float
    network: dict | None = None  # the sandbox's network options when it was taken: what clones inherit
                                 # (None: it had none, or the snapshot predates this field)

    def public(self) -> dict:
        d = asdict(self)
        d.pop("layer_uid")      # a host detail
        return d


def new_id(sandbox_id: str) -> str:
    return f"{sandbox_id}-{uuid.uuid4().hex[:8]}"


class SnapshotStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _dir(self, snapshot_id: str) -> Path:
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise SnapshotNotFound(f"snapshot id must match {SNAPSHOT_ID_RE.pattern}")
        return self.root / snapshot_id

    def layer(self, snapshot_id: str) -> Path:
        return self._dir(snapshot_id) / "layer"

    def begin(self, snapshot_id: str) -> Path:
        """A fresh temporary directory for the layer copy (commit() or abort() it)."""
        if self._dir(snapshot_id).exists():
            raise SandboxError(f"snapshot {snapshot_id!r} already exists")
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        tmp = self.root / f".tmp-{snapshot_id}-{uuid.uuid4().hex[:6]}"
        tmp.mkdir(mode=0o700)
        return tmp

    def commit(self, tmp: Path, snap: Snapshot) -> Snapshot:
        (tmp / "meta.json").write_text(json.dumps({**asdict(snap), "limits": asdict(snap.limits)}))
        try:
            os.rename(tmp, self._dir(snap.id))     # fails if the id was taken meanwhile (non-empty dir)
        except OSError:
            self.abort(tmp)
            raise SandboxError(f"snapshot {snap.id!r} already exists") from None
        return snap

    @staticmethod
    def abort(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def get(self, snapshot_id: str) -> Snapshot:
        try:
            d = json.loads((self._dir(snapshot_id) / "meta.json").read_text())
        except (OSError, ValueError):
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r}") from None
        return Snapshot(**{**d, "limits": Limits(**d["limits"])})

    def list(self) -> list[Snapshot]:
        out = []
        if self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                if not d.name.startswith(".") and SNAPSHOT_ID_RE.fullmatch(d.name):
                    try:
                        out.append(self.get(d.name))
                    except SnapshotNotFound:
                        continue
        return sorted(out, key=lambda s: s.created)

    def remove(self, snapshot_id: str) -> None:
        self.get(snapshot_id)
        d = self._dir(snapshot_id)
        gone = self.root / f".del-{snapshot_id}-{uuid.uuid4().hex[:6]}"
        os.rename(d, gone)        # the id is free at once; the copy goes after
        shutil.rmtree(gone, ignore_errors=True)

    def clean_temporaries(self) -> None:
        """Left by a crash mid-copy."""
        if self.root.is_dir():
            for d in self.root.glob(".*"):
                shutil.rmtree(d, ignore_errors=True)


def tree_size(path: Path) -> int:
    """Bytes the tree takes on disk: allocated blocks, each inode once (a sandbox's sparse
    file or thousand hard links must not make a small snapshot look huge, nor hide a big one)."""
    total, seen = 0, set()
    for base, dirs, files in os.walk(path):
        for f in (*dirs, *files):
            try:
                st = os.lstat(os.path.join(base, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
