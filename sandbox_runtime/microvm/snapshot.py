"""A microVM sandbox snapshot: the whole VM state (guest memory, which holds its writable
layer: the template overlay's upper tmpfs and /workspace) plus what it must be restored into.

    <snapshot>/layer/memory    QEMU migration stream (fd: migration; root's, 0600)
    <snapshot>/layer/vm.json   VmSnapshot below

The root disk is not copied: it is the template's read-only image, addressed by the template
key. A snapshot restores only into the same guest (assets hash, QEMU version, accelerator,
memory size, CPU count, root disk): `incompatibility()` says why not, before anything stops.
Pure apart from load/save.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

MEMORY = "memory"
META = "vm.json"
TOKEN_RE = re.compile(r"^[A-Za-z0-9_]{8,128}$")      # placeholders ("cgph_" + base32)


@dataclass(frozen=True)
class VmSnapshot:
    sandbox: str                 # the sandbox it was taken from: a restore into another id is a clone
    assets_hash: str
    qemu: str
    accel: str
    memory_mb: int
    cpus: int
    tsc_khz: int
    template: str | None         # rootfs template name / key / image; None: initramfs only
    template_key: str | None
    disk: str | None
    disk_id: str | None = None   # vmdisk.image_id of that image when the snapshot was taken

    def save(self, layer: Path) -> None:
        (Path(layer) / META).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, layer: Path) -> "VmSnapshot":
        return cls(**json.loads((Path(layer) / META).read_text()))


def vm_cpus(cpus: float) -> int:
    return max(1, int(-(-cpus // 1)))


def incompatibility(snap: VmSnapshot, *, assets_hash: str, qemu: str, memory_mb: int, cpus: float,
                    template_key: str | None, disk_id: str | None) -> str | None:
    """disk_id: vmdisk.image_id of the image at snap.disk now (None: missing)."""
    """Why `snap` cannot be restored as asked (None: it can)."""
    if (snap.assets_hash, snap.qemu) != (assets_hash, qemu):
        return ("the microVM guest assets or QEMU changed since the snapshot was taken "
                "(a memory snapshot only loads into the guest that wrote it)")
    if (snap.memory_mb, snap.cpus) != (memory_mb, vm_cpus(cpus)):
        return (f"a microVM snapshot restores with its own memory and CPUs ({snap.memory_mb} MB, "
                f"{snap.cpus} CPU), not {memory_mb} MB / {vm_cpus(cpus)} CPU")
    if snap.template_key != template_key:
        return (f"template {snap.template!r} was rebuilt since the snapshot was taken "
                "(its memory belongs to the old build)")
    if snap.disk and disk_id is None:
        return f"the root disk of template {snap.template!r} is gone (template removed?)"
    if snap.disk and disk_id != snap.disk_id:
        return f"the root disk of template {snap.template!r} was rebuilt since the snapshot was taken"
    return None


def token_pairs(tokens: dict[str, str]) -> list[str]:
    """cg-retoken's arguments; refuses what the in-guest sed could misread."""
    out = []
    for old, new in sorted(tokens.items()):
        if old == new:
            continue
        if not (TOKEN_RE.fullmatch(old) and TOKEN_RE.fullmatch(new)) or len(old) != len(new):
            raise ValueError("placeholders to replace must be [A-Za-z0-9_] and of equal length")
        out += [old, new]
    return out
