"""Accelerator probe and template snapshots.

Probe: /dev/kvm existing says nothing here (PVM hosts: a stock kernel under KVM crawls),
so boot the real guest with each accelerator and keep the faster one; KVM only gets as
long as TCG needed. Cached per assets hash in <assets>/accel.json.

Template (a boot snapshot; not to be confused with a rootfs template, which it may boot as
its read-only root disk): boot once per (assets hash, memory, cpus, accelerator, root disk
key), wait for the agent,
disconnect, stop, migrate the whole VM state to a file. Sandboxes start with -incoming
from it. Built under an exclusive lock; written to a temp name then renamed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime import filelock
from sandbox_runtime.backend import SandboxError

from . import vm
from .assets import Manifest
from .channel import AgentChannel

BOOT_TIMEOUT = 60.0


def host_tsc_khz() -> int:
    """The guest's TSC runs at the host's rate (TCG reads the host TSC; KVM passes it)."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    raise SandboxError("cannot read the host CPU frequency from /proc/cpuinfo")


@dataclass(frozen=True)
class Template:
    snapshot: str
    accel: str
    memory_mb: int
    cpus: int
    tsc_khz: int
    disk: str | None = None      # the read-only root disk it booted with (a template's image)


def vm_config(assets_dir: Path, run_dir: str, *, memory_mb: int, cpus: int, accel: str, tsc: int,
              disk: str | None = None) -> vm.VmConfig:
    return vm.VmConfig(kernel=str(assets_dir / "vmlinuz"), initrd=str(assets_dir / "initramfs.cpio.gz"),
                       memory_mb=memory_mb, cpus=cpus, accel=accel, tsc_khz=tsc, run_dir=run_dir, disk=disk)


def cold_boot(cfg: vm.VmConfig, agent: str, timeout: float) -> tuple[int, AgentChannel, float]:
    """Boot without a snapshot; (pid, channel, seconds until the agent answered)."""
    t0 = time.monotonic()
    pid = vm.start(cfg, agent=agent, cgroup_procs=[], netns=None).pid
    ch = AgentChannel(cfg.agent_sock)
    try:
        ch.ping_until(t0 + timeout)
    except BaseException:
        ch.close()
        vm.kill(pid, cfg.run_dir)
        raise
    return pid, ch, time.monotonic() - t0


def probe_accel(assets_dir: Path, man: Manifest, agent: str, *, memory_mb: int = 256) -> dict:
    cache = assets_dir / "accel.json"
    with suppress(OSError, ValueError, KeyError):
        d = json.loads(cache.read_text())
        if d["hash"] == man.hash:
            return d
    with filelock.exclusive(assets_dir / ".probe.lock"):
        with suppress(OSError, ValueError, KeyError):
            d = json.loads(cache.read_text())
            if d["hash"] == man.hash:
                return d
        tsc = host_tsc_khz()
        result: dict = {"hash": man.hash, "accel": "tcg"}
        limit = BOOT_TIMEOUT
        for accel in ("tcg", "kvm"):
            if accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
                result["kvm_s"] = None
                continue
            run = tempfile.mkdtemp(prefix="probe-", dir=assets_dir)
            try:
                pid, ch, secs = cold_boot(vm_config(assets_dir, run, memory_mb=memory_mb, cpus=1, accel=accel,
                                                  tsc=tsc), agent, limit)
                ch.close()
                vm.kill(pid, run)
            except SandboxError:
                secs = None
            finally:
                shutil.rmtree(run, ignore_errors=True)
            result[f"{accel}_s"] = None if secs is None else round(secs, 3)
            if accel == "tcg":
                if secs is None:
                    raise SandboxError("the microVM guest does not boot under TCG")
                limit = secs          # KVM must beat TCG to be chosen
            elif secs is not None and secs < result["tcg_s"]:
                result["accel"] = "kvm"
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, cache)
        return result


def _prefix(man: Manifest) -> str:
    return f"{man.hash}-q{re.sub(r'[^A-Za-z0-9.+~-]', '_', vm.qemu_version())}-"


def template_dir(assets_dir: Path, man: Manifest, memory_mb: int, cpus: int, accel: str,
                 disk_key: str | None = None) -> Path:
    """disk_key: the root disk's content address (a rootfs template's key), part of the name."""
    tail = f"-t{disk_key[:16]}" if disk_key else ""
    return assets_dir / "templates" / f"{_prefix(man)}{accel}-{memory_mb}m-{cpus}c{tail}"


def ensure_template(assets_dir: Path, man: Manifest, agent: str, *, memory_mb: int, cpus: int,
                    accel: str, disk: str | None = None, disk_key: str | None = None) -> Template:
    if (disk is None) != (disk_key is None):
        raise ValueError("disk and disk_key go together")
    d = template_dir(assets_dir, man, memory_mb, cpus, accel, disk_key)
    meta = d / "template.json"
    with suppress(OSError, ValueError, KeyError, TypeError):
        return Template(**json.loads(meta.read_text()))
    with filelock.exclusive(assets_dir / "templates" / f".{d.name}.lock"):
        with suppress(OSError, ValueError, KeyError, TypeError):
            return Template(**json.loads(meta.read_text()))
        d.mkdir(parents=True, exist_ok=True)
        tsc = host_tsc_khz()
        run = tempfile.mkdtemp(prefix="cgvmboot-")     # short: unix socket paths (< 108 bytes)
        snap = d / "state.tmp"
        try:
            cfg = vm_config(assets_dir, run, memory_mb=memory_mb, cpus=cpus, accel=accel, tsc=tsc, disk=disk)
            pid, ch, _ = cold_boot(cfg, agent, BOOT_TIMEOUT)
            try:
                ch.close()
                time.sleep(0.3)   # let the guest see the host side close: restores start disconnected
                with vm.Qmp(cfg.qmp_sock) as q:
                    vm.save_snapshot(q, str(snap))
                    with suppress(vm.QmpError):
                        q.execute("quit")
            finally:
                vm.kill(pid, run)
            os.replace(snap, d / "state")
            t = Template(snapshot=str(d / "state"), accel=accel, memory_mb=memory_mb, cpus=cpus, tsc_khz=tsc,
                         disk=disk)
            meta.write_text(json.dumps(t.__dict__))
            _prune(d, _prefix(man))
            return t
        finally:
            shutil.rmtree(run, ignore_errors=True)
            with suppress(FileNotFoundError):
                snap.unlink()


def _disk(d: Path) -> str | None:
    with suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads((d / "template.json").read_text()).get("disk")
    return None


def _prune(current: Path, prefix: str) -> None:
    """Templates of older assets or another QEMU can never be used again, nor those whose root
    disk is gone (template removed) or was rebuilt (an older one on the same disk path); each
    is the size of a guest's memory: remove them. Restored VMs do not need their file any more."""
    mine = _disk(current)
    for p in current.parent.iterdir():
        if not p.is_dir() or p == current:
            continue
        disk = _disk(p)
        same_vm = p.name.rsplit("-t", 1)[0] == current.name.rsplit("-t", 1)[0]    # accel, memory, cpus
        if not p.name.startswith(prefix) or (disk and (not Path(disk).exists() or (same_vm and disk == mine))):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.endswith(".lock") and not p.name.startswith("." + prefix):
            with suppress(OSError):
                p.unlink()


def restore_config(assets_dir: Path, t: Template, run_dir: str, *, tap: str, mac: str,
                   incoming_fd: int | None = None, runas: str | None = None) -> vm.VmConfig:
    """Same command line as the template's boot (migration needs the same devices), plus the
    tap backend and the incoming snapshot. The NIC's MAC is set by the guest after restore."""
    base = vm_config(assets_dir, run_dir, memory_mb=t.memory_mb, cpus=t.cpus, accel=t.accel, tsc=t.tsc_khz,
                     disk=t.disk)
    return vm.VmConfig(**{**base.__dict__, "tap": tap, "mac": mac, "incoming": t.snapshot,
                          "incoming_fd": incoming_fd, "runas": runas})
