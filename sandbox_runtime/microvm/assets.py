"""Guest assets for the microvm backend: a kernel from Debian's cloud kernel package and an
initramfs (newc cpio, gzip) holding busybox-static, the virtio modules that kernel ships as
modules, our /init, a post-restore setup script and the exec agent.

Layout of an assets dir:
  vmlinuz, initramfs.cpio.gz, manifest.json ({"hash": ..., "kernel": ...}),
  templates/<hash>-<mem>m/ (snapshots, see template.py), accel.json (probe cache).

The pure parts (cpio writer, module dependency order, init text) are separate from the
I/O (apt, dpkg-deb) so they can be tested without a network.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ASSETS_DIR = Path(os.environ.get("CUBEGATE_MICROVM_ASSETS", REPO / ".cache" / "microvm"))
DEFAULT_AGENT = REPO / "sandbox_runtime" / "agent" / "cubegate-agent"
KERNEL_META = "linux-image-cloud-amd64"
BUSYBOX = Path("/bin/busybox")
# Loaded in this order by /init (dependencies are checked against the .ko's modinfo at build).
MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console", "failover", "net_failover",
           "virtio_net", "virtio-rng", "virtio_blk", "overlay")   # ext4 is built into the cloud kernel
AGENT_PORT = "cubegate.agent"


def default_assets_dir() -> Path:
    return DEFAULT_ASSETS_DIR
FORMAT = 4   # bump when the guest layout changes: it is part of the assets hash


# ------------------------------------------------------------------ pure: cpio (newc)
class Cpio:
    """Minimal writer of the SVR4 'newc' format the kernel unpacks for an initramfs."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", nlink: int = 1) -> None:
        nameb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(nameb), 0))
        self.ino += 1
        self.buf.write(hdr.encode() + nameb)
        self.buf.write(b"\0" * (-(110 + len(nameb)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, 0o040000 | perm, nlink=2)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, 0o100000 | perm, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


# ------------------------------------------------------------------ pure: modules
def modinfo_depends(ko: bytes) -> list[str]:
    m = re.search(rb"(?:^|\0)depends=([^\0]*)\0", ko)
    return [d for d in m.group(1).decode().split(",") if d] if m else []


def check_module_order(order: Iterable[str], depends: dict[str, list[str]]) -> None:
    """Every module's dependencies must come before it (busybox insmod does not resolve them)."""
    seen: set[str] = set()
    for name in order:
        missing = [d for d in depends.get(name, []) if d.replace("-", "_") not in seen]
        if missing:
            raise RuntimeError(f"module {name} needs {missing} loaded before it")
        seen.add(name.replace("-", "_"))


# ------------------------------------------------------------------ pure: guest scripts
INIT = r"""#!/bin/sh
# cubegate microVM init: mount, load virtio modules; with a root disk (a template), switch
# into an overlay of it (read-only disk + tmpfs); then serve the agent (cg-serve).
export PATH=/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm /dev/virtio-ports
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755 tmpfs /run
for m in @MODULES@; do insmod /lib/modules/$m.ko 2>/dev/null; done
for a in $(cat /proc/cmdline); do
  case "$a" in cubegate.root=*) root=${a#*=};; esac
done
mkdir -p /run/cubegate
if [ "$root" = vda ]; then
  i=0
  while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do i=$((i+1)); sleep 0.02; done
  mkdir -p /mnt/lower /mnt/rw /mnt/root
  mount -t ext4 -o ro,noload /dev/vda /mnt/lower || { echo "cubegate: no root disk" > /dev/ttyS0; exit 1; }
  # the writable layer: guest memory, so a memory snapshot holds it (its size: cg-setup)
  mount -t tmpfs -o mode=0755 tmpfs /mnt/rw
  mkdir -p /mnt/rw/upper /mnt/rw/work
  mount -t overlay overlay -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work /mnt/root
  R=/mnt/root
  mkdir -p $R/run $R/proc $R/sys $R/dev $R/tmp $R/workspace
  mount -t tmpfs -o mode=0755 tmpfs $R/run
  mkdir -p $R/run/cubegate/bin $R/run/cubegate/sbin $R/run/cubegate/rw
  # our tools, not the template's: the template only provides /usr, /etc, ...
  cp /bin/busybox $R/run/cubegate/bin/busybox
  for a in $(busybox --list); do [ "$a" = busybox ] || ln -s busybox $R/run/cubegate/bin/$a; done
  cp /sbin/cg-* /sbin/cubegate-agent $R/run/cubegate/sbin/
  mount --move /mnt/rw $R/run/cubegate/rw
  mount --move /dev $R/dev
  mount --move /proc $R/proc
  mount --move /sys $R/sys
  exec switch_root $R /run/cubegate/bin/sh /run/cubegate/sbin/cg-serve
fi
mount -t tmpfs tmpfs /tmp
ln -s /bin /run/cubegate/bin
ln -s /sbin /run/cubegate/sbin
exec /bin/sh /sbin/cg-serve
"""

# PID 1 from here on (both modes): name the agent port, cold-boot network, serve the agent.
SERVE = r"""#!/bin/sh
export PATH=/run/cubegate/bin:/run/cubegate/sbin:/sbin:/bin
ip link set lo up
# udev normally names virtio ports; do it by hand (bounded wait for the device to appear)
i=0
while [ $i -lt 200 ]; do
  for p in /sys/class/virtio-ports/*; do
    [ -r "$p/name" ] && ln -sf "../${p##*/}" "/dev/virtio-ports/$(cat "$p/name")"
  done
  [ -e /dev/virtio-ports/@PORT@ ] && break
  i=$((i+1)); sleep 0.05
done
# cold-boot network config from the kernel command line (templates use cg-setup instead)
for a in $(cat /proc/cmdline); do
  case "$a" in cubegate.ip=*) ip=${a#*=};; cubegate.gw=*) gw=${a#*=};; esac
done
[ -n "$ip" ] && [ -n "$gw" ] && /run/cubegate/bin/sh /run/cubegate/sbin/cg-net "$ip" "$gw"
mkdir -p /workspace
echo cubegate-init-ready > /dev/ttyS0 2>/dev/null
# The agent exits when the host side of the port is not connected (read returns EOF at once):
# respawn it, with a pause so an idle VM does not spin. (Also after cg-fresh killed it.)
while true; do
  cubegate-agent --serve-fd /dev/virtio-ports/@PORT@ </dev/null >/dev/null 2>&1
  sleep 0.2
done
"""

# Network: the guest owns the sandbox address and MAC (cubevs checks both on every frame).
NET = r"""#!/bin/sh
# usage: cg-net IP GATEWAY [MAC]
export PATH=/run/cubegate/bin:/run/cubegate/sbin:/sbin:/bin
set -e
ip link set eth0 down
[ -n "$3" ] && ip link set eth0 address "$3"
ip addr flush dev eth0
ip route flush dev eth0 2>/dev/null || true
ip addr add "$1/32" dev eth0
ip link set eth0 up
ip route add "$2/32" dev eth0 scope link
ip route add default via "$2" dev eth0 onlink
echo "nameserver $2" > /etc/resolv.conf
"""

# Run after every restore (a template's, or a sandbox snapshot's for a clone or rollback).
SETUP = r"""#!/bin/sh
# usage: cg-setup EPOCH IP GATEWAY MAC DISK_MB HOSTNAME  (seed bytes on stdin for the RNG)
export PATH=/run/cubegate/bin:/run/cubegate/sbin:/sbin:/bin
set -e
date -s "@$1" >/dev/null
cat > /dev/urandom
/run/cubegate/bin/sh /run/cubegate/sbin/cg-net "$2" "$3" "$4"
if [ -d /run/cubegate/rw/upper ]; then
  mount -o remount,size="$5m" /run/cubegate/rw
else
  grep -q " /workspace " /proc/mounts || mount -t tmpfs -o "size=$5m,mode=0755" tmpfs /workspace
fi
hostname "$6"
"""

# A clone must not run on with its parent's processes (their memory and env hold the parent's
# placeholders and identity): kill every process but init, the agent included (init starts a
# fresh one). kill(-1) signals them all in one sweep under the kernel's task list lock, and a
# fork with a fatal signal pending fails, so nothing escapes by forking. In the background
# after a pause, so the agent can answer this exec first.
FRESH = r"""#!/bin/sh
# usage: cg-fresh TOKEN   (prints the pid of the agent that ran it; says "cubegate-fresh TOKEN"
# on the console, which the host reads through QMP, when it is done)
export PATH=/run/cubegate/bin:/run/cubegate/sbin:/sbin:/bin
if [ "$1" != now ]; then
  echo "$PPID"
  /run/cubegate/bin/sh /run/cubegate/sbin/cg-fresh now "$1" </dev/null >/dev/null 2>&1 &
  exit 0
fi
sleep 0.2
kill -9 -1
echo 3 > /proc/sys/vm/drop_caches
echo "cubegate-fresh $2" > /dev/ttyS0
"""

# Files of the writable layer that hold the snapshotted sandbox's placeholders get the new
# sandbox's (same length, [A-Za-z0-9_] only: checked by the host).
RETOKEN = r"""#!/bin/sh
# usage: cg-retoken OLD NEW [OLD NEW ...]
export PATH=/run/cubegate/bin:/run/cubegate/sbin:/sbin:/bin
if [ -d /run/cubegate/rw/upper ]; then dirs=/run/cubegate/rw/upper; else dirs="/workspace /tmp /etc /root"; fi
while [ $# -ge 2 ]; do
  grep -rlF -- "$1" $dirs 2>/dev/null | while IFS= read -r f; do sed -i "s/$1/$2/g" "$f"; done
  shift 2
done
"""

SCRIPTS = {"cg-serve": SERVE, "cg-net": NET, "cg-setup": SETUP, "cg-fresh": FRESH, "cg-retoken": RETOKEN}
TOOLS = "/run/cubegate/sbin"     # where the host finds the scripts in either mode


def layout_hash() -> str:
    """The guest's scripts and modules: assets built from other ones are rebuilt (a changed
    script must never be run from a stale initramfs)."""
    h = hashlib.sha256(f"{FORMAT}\0{' '.join(MODULES)}\0{INIT}".encode())
    for name in sorted(SCRIPTS):
        h.update(f"\0{name}\0{SCRIPTS[name]}".encode())
    return h.hexdigest()[:16]


def init_script() -> str:
    return INIT.replace("@MODULES@", " ".join(MODULES))


def script(name: str) -> str:
    return SCRIPTS[name].replace("@PORT@", AGENT_PORT)


def build_initramfs(busybox: bytes, applets: list[str], modules: dict[str, bytes], agent: bytes) -> bytes:
    c = Cpio()
    for d in ("bin", "sbin", "dev", "proc", "sys", "tmp", "run", "etc", "etc/ssl", "etc/ssl/certs",
              "lib", "lib/modules", "root", "workspace", "usr", "usr/bin", "usr/sbin", "var", "var/tmp", "mnt"):
        c.dir(d, 0o1777 if d in ("tmp", "var/tmp") else 0o755)
    c.file("bin/busybox", busybox, 0o755)
    for a in applets:
        if a != "busybox":
            c.symlink(f"bin/{a}", "busybox")
    c.file("init", init_script().encode(), 0o755)
    for name in SCRIPTS:
        c.file(f"sbin/{name}", script(name).encode(), 0o755)
    c.file("sbin/cubegate-agent", agent, 0o755)
    for name, data in modules.items():
        c.file(f"lib/modules/{name}.ko", data)
    c.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    c.file("etc/group", b"root:x:0:\n")
    c.file("etc/hostname", b"sandbox\n")
    c.file("etc/resolv.conf", b"")
    # mtime 0 keeps the gzip (and the assets hash) reproducible
    return gzip.compress(c.finish(), compresslevel=6, mtime=0)


# ------------------------------------------------------------------ I/O: build
Progress = Callable[..., None]


def _noprogress(*_a, **_k) -> None:
    pass


@dataclass
class Manifest:
    hash: str
    kernel: str
    kernel_version: str
    agent_sha256: str
    format: int = FORMAT
    layout: str = ""            # layout_hash() of the build

    @classmethod
    def load(cls, assets_dir: Path) -> "Manifest":
        return cls(**json.loads((Path(assets_dir) / "manifest.json").read_text()))


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def assets_ready(assets_dir: Path, agent: Path | None = None) -> tuple[bool, str]:
    """Built, and (given the host's agent binary) embedding that same agent."""
    d = Path(assets_dir)
    for f in ("vmlinuz", "initramfs.cpio.gz", "manifest.json"):
        if not (d / f).is_file():
            return False, f"microvm guest assets missing ({d / f}); run: python -m sandbox_runtime.microvm build"
    try:
        man = Manifest.load(d)
    except (OSError, ValueError, TypeError):
        return False, f"{d / 'manifest.json'} unreadable; run: python -m sandbox_runtime.microvm build"
    if man.format != FORMAT or man.layout != layout_hash():
        return False, "microvm guest assets are from an older layout; run: python -m sandbox_runtime.microvm build"
    if agent is not None and Path(agent).is_file() and _sha256(agent) != man.agent_sha256:
        return False, "microvm guest assets embed another agent build; run: python -m sandbox_runtime.microvm build"
    return True, ""


def resolve_kernel_package(meta: str = KERNEL_META) -> tuple[str, str, int, str]:
    """(package, uri, size, sha256) of the kernel the meta package depends on, from apt's
    own (signature-checked) indexes."""
    out = subprocess.run(["apt-cache", "depends", meta], capture_output=True, text=True, timeout=60, check=True)
    pkgs = re.findall(r"Depends:\s*(linux-image-[0-9][^\s]*-cloud-amd64)\s*$", out.stdout, re.M)
    if not pkgs:
        raise RuntimeError(f"{meta}: no kernel dependency found (apt-get update?)")
    pkg = pkgs[0]
    with tempfile.TemporaryDirectory() as empty:   # --print-uris skips packages present in cwd
        out = subprocess.run(["apt-get", "download", "--print-uris", pkg], capture_output=True, text=True,
                             timeout=60, check=True, cwd=empty)
    m = re.search(r"'([^']+)'\s+\S+\s+(\d+)\s+SHA256:([0-9a-f]{64})", out.stdout)
    if not m:
        raise RuntimeError(f"apt-get download --print-uris {pkg}: unexpected output {out.stdout[:200]!r}")
    return pkg, m.group(1), int(m.group(2)), m.group(3)


def download(uri: str, size: int, sha256: str, dest: Path, progress: Progress = _noprogress) -> None:
    h = hashlib.sha256()
    got = 0
    with urllib.request.urlopen(uri, timeout=60) as r, open(dest, "wb") as f:
        while chunk := r.read(1 << 16):
            f.write(chunk)
            h.update(chunk)
            got += len(chunk)
            progress("bytes", done=got, total=size)
    if got != size or h.hexdigest() != sha256:
        raise RuntimeError(f"{uri}: size/sha256 mismatch (apt index says {size} bytes)")


def extract_kernel(deb: Path, progress: Progress = _noprogress) -> tuple[bytes, dict[str, bytes], str]:
    """(vmlinuz, {module: bytes}, version) streamed from the .deb's data tar."""
    want = {m.replace("-", "_") for m in MODULES}
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    vmlinuz, mods, version, n = b"", {}, "", 0
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
            for m in tf:
                n += 1
                progress("members", done=n, total=None)
                name = m.name.lstrip("./")
                if re.fullmatch(r"boot/vmlinuz-.+", name) and m.isfile():
                    vmlinuz = tf.extractfile(m).read()
                    version = name.split("vmlinuz-", 1)[1]
                elif name.endswith(".ko") and m.isfile():
                    base = name.rsplit("/", 1)[1][:-3]
                    if base.replace("-", "_") in want:
                        mods[base] = tf.extractfile(m).read()
    finally:
        proc.stdout.close()
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"dpkg-deb --fsys-tarfile {deb} failed")
    return vmlinuz, mods, version


def build(dest: Path = DEFAULT_ASSETS_DIR, *, agent: Path = DEFAULT_AGENT, busybox: Path = BUSYBOX,
          progress: Progress = _noprogress, force: bool = False) -> Manifest:
    dest = Path(dest)
    if not Path(agent).is_file():
        raise RuntimeError(f"exec agent {agent} missing; run: python -m sandbox_runtime.build_agent")
    if not busybox.is_file():
        raise RuntimeError(f"{busybox} missing; apt-get install busybox-static")
    progress("step", name="resolve kernel package")
    pkg, uri, size, sha = resolve_kernel_package()
    progress("info", text=f"{pkg} ({size / 1e6:.1f} MB)")
    if not force and assets_ready(dest, agent)[0] and Manifest.load(dest).kernel == pkg:
        man = Manifest.load(dest)
        progress("done", text=f"assets {man.hash} in {dest} are up to date (--force rebuilds)")
        return man
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        deb = Path(tmp) / "kernel.deb"
        progress("step", name="download kernel")
        download(uri, size, sha, deb, progress)
        progress("step", name="extract kernel and modules")
        vmlinuz, mods, version = extract_kernel(deb, progress)
        have = {k.replace("-", "_") for k in mods}
        missing = [m for m in MODULES if m.replace("-", "_") not in have]
        if not vmlinuz or missing:
            raise RuntimeError(f"{pkg}: no vmlinuz or missing modules {missing}")
        mods = {m: mods[next(k for k in mods if k.replace('-', '_') == m.replace('-', '_'))] for m in MODULES}
        check_module_order(MODULES, {m: modinfo_depends(b) for m, b in mods.items()})
        progress("step", name="build initramfs")
        applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout.split()
        agent_bytes = Path(agent).read_bytes()
        initrd = build_initramfs(busybox.read_bytes(), applets, mods, agent_bytes)
        progress("step", name="install")
        h = hashlib.sha256(vmlinuz)
        h.update(initrd)
        h.update(str(FORMAT).encode())
        man = Manifest(hash=h.hexdigest()[:16], kernel=pkg, kernel_version=version,
                       agent_sha256=hashlib.sha256(agent_bytes).hexdigest(), layout=layout_hash())
        for name, data in (("vmlinuz", vmlinuz), ("initramfs.cpio.gz", initrd)):
            (Path(tmp) / name).write_bytes(data)
            os.replace(Path(tmp) / name, dest / name)
        (Path(tmp) / "manifest.json").write_text(json.dumps(man.__dict__, indent=1))
        os.replace(Path(tmp) / "manifest.json", dest / "manifest.json")
    progress("done", text=f"assets {man.hash} in {dest}")
    return man
