"""Template definitions (defs/<name>.yaml) and their content address.

A definition is data: a package list (plus the lists of the templates it
extends) and a base environment. Its key is the SHA-256 of everything that
decides the built root filesystem — suite, mirror, architecture, variant, the
full sorted package list, dpkg path filters, the epoch and the recipe version —
so the same inputs give the same key, and the cache answers without building.
Pure: reading the YAML files is the only I/O.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEFS_DIR = Path(__file__).with_name("defs")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,99}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Bump when the recipe (build.py's argv, hooks, extraction) changes what a build produces.
RECIPE_VERSION = 1
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
ARCH = "amd64"
VARIANT = "essential"          # Essential: yes + the listed packages; no apt inside the sandbox
SOURCE_DATE_EPOCH = 1704067200  # 2024-01-01: fixed, so file times do not change the tarball
DPKG_FILTERS = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*",
                "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/locale/*",
                "path-include=/usr/share/locale/locale.alias")


class DefinitionError(ValueError):
    pass


@dataclass(frozen=True)
class Definition:
    name: str
    description: str
    packages: tuple[str, ...]                 # full, sorted, with those of `extends`
    env: dict = field(default_factory=dict)   # base env of the sandbox (no secrets: it is in the manifest)
    suite: str = SUITE
    mirror: str = MIRROR
    arch: str = ARCH
    variant: str = VARIANT

    def inputs(self) -> dict:
        """Everything that decides the root filesystem (and so the key)."""
        return {"recipe": RECIPE_VERSION, "suite": self.suite, "mirror": self.mirror, "arch": self.arch,
                "variant": self.variant, "packages": list(self.packages), "dpkg": list(DPKG_FILTERS),
                "epoch": SOURCE_DATE_EPOCH}

    @property
    def key(self) -> str:
        blob = json.dumps(self.inputs(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _raw(name: str, defs_dir: Path) -> dict:
    if not NAME_RE.fullmatch(name or ""):
        raise DefinitionError(f"template name {name!r} must match {NAME_RE.pattern}")
    path = defs_dir / f"{name}.yaml"
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise DefinitionError(f"no template definition {name!r} (known: {', '.join(names(defs_dir))})") from None
    except yaml.YAMLError as e:
        raise DefinitionError(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise DefinitionError(f"{path}: must be a mapping")
    unknown = set(doc) - {"description", "extends", "packages", "env"}
    if unknown:
        raise DefinitionError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    return doc


def load(name: str, defs_dir: Path = DEFS_DIR, _seen: tuple[str, ...] = ()) -> Definition:
    if name in _seen:
        raise DefinitionError(f"template {name!r}: extends loop {' -> '.join((*_seen, name))}")
    doc = _raw(name, defs_dir)
    pkgs = doc.get("packages") or []
    if not isinstance(pkgs, list) or not all(isinstance(p, str) and PACKAGE_RE.fullmatch(p) for p in pkgs):
        raise DefinitionError(f"template {name!r}: packages must be a list of Debian package names")
    env = doc.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and ENV_NAME_RE.fullmatch(k) and isinstance(v, str)
                                            for k, v in env.items()):
        raise DefinitionError(f"template {name!r}: env must map variable names to strings")
    packages, full_env = set(pkgs), {}
    if doc.get("extends"):
        parent = load(str(doc["extends"]), defs_dir, (*_seen, name))
        packages |= set(parent.packages)
        full_env = dict(parent.env)
    full_env.update(env)
    return Definition(name=name, description=str(doc.get("description", "")), packages=tuple(sorted(packages)),
                      env=full_env)


def names(defs_dir: Path = DEFS_DIR) -> list[str]:
    return sorted(p.stem for p in defs_dir.glob("*.yaml"))
