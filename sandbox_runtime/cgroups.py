"""Per-sandbox cgroups: limits, usage, freeze, kill, removal.

cgroup v1 (what these hosts run: one hierarchy per controller under
/sys/fs/cgroup/<ctl>) and cgroup v2 (unified, controllers enabled at the root).
Layout: <ctl>/cubegate/<group>/<sandbox id>, group = the runtime instance
(ids.instance_name of its state dir). Paths are plain strings so they can live
in Handle.data and be used again after a daemon restart.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_runtime import ids
from sandbox_runtime.backend import Limits, SandboxError

ROOT = Path("/sys/fs/cgroup")
PARENT = "cubegate"
CFS_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
V1_REQUIRED = ("memory", "pids", "cpu")


def detect(root: Path = ROOT) -> tuple[str | None, str]:
    """("v1" | "v2" | None, reason)."""
    if all((root / c / "cgroup.procs").exists() for c in V1_REQUIRED) and \
            (root / "memory" / "memory.limit_in_bytes").exists():
        return "v1", ""
    ctl = root / "cgroup.controllers"
    if ctl.exists():
        have = set(ctl.read_text().split())
        missing = {"memory", "pids", "cpu"} - have
        if not missing:
            return "v2", ""
        return None, f"cgroup v2 lacks controllers: {sorted(missing)}"
    return None, "no usable cgroup hierarchy (need memory, pids, cpu)"


def _write(path: Path, value: str) -> None:
    path.write_text(value)


@dataclass
class SandboxCgroups:
    version: str
    paths: dict[str, str] = field(default_factory=dict)   # controller ("unified" on v2) -> dir

    # -- persistence ----------------------------------------------------------
    def to_json(self) -> dict:
        return {"version": self.version, "paths": dict(self.paths)}

    @classmethod
    def from_json(cls, d: dict) -> "SandboxCgroups":
        return cls(version=d["version"], paths=dict(d["paths"]))

    # -- creation -------------------------------------------------------------
    @classmethod
    def create(cls, sandbox_id: str, limits: Limits | None, root: Path = ROOT, *,
               group: str = "") -> "SandboxCgroups":
        """limits None: no limits yet (a pooled launcher's cgroups: set_limits at claim)."""
        version, why = detect(root)
        if version is None:
            raise SandboxError(why)
        cg = cls(version=version)
        try:
            if version == "v1":
                for c in V1_CONTROLLERS:
                    base = root / c
                    if not (base / "cgroup.procs").exists():
                        continue
                    d = base / PARENT / group / sandbox_id if group else base / PARENT / sandbox_id
                    d.mkdir(parents=True, exist_ok=False)
                    cg.paths[c] = str(d)
            else:
                _write(root / "cgroup.subtree_control", "+memory +pids +cpu")
                parent = root / PARENT
                for level in (parent, parent / group) if group else (parent,):
                    level.mkdir(exist_ok=True)
                    _write(level / "cgroup.subtree_control", "+memory +pids +cpu")
                    parent = level
                d = parent / sandbox_id
                d.mkdir(exist_ok=False)
                cg.paths["unified"] = str(d)
            if limits is not None:
                cg.set_limits(limits)
        except FileExistsError:
            cg.remove()
            raise SandboxError(f"cgroup for {sandbox_id} already exists") from None
        except OSError as e:
            cg.remove()
            raise SandboxError(f"cgroup setup failed: {e}") from None
        return cg

    def set_limits(self, lim: Limits) -> None:
        if self.version == "v1":
            self._limits_v1(lim)
        else:
            self._limits_v2(lim)

    def renamed(self, name: str) -> "SandboxCgroups":
        """The same cgroups (and tasks) under another name in the same parent: cgroup v1 only
        (v2 has no rename). All or nothing: a failure renames back what was done and raises."""
        if self.version != "v1":
            raise SandboxError("cgroup rename needs cgroup v1")
        done: dict[str, str] = {}
        try:
            for c, p in self.paths.items():
                new = str(Path(p).with_name(name))
                os.rename(p, new)
                done[c] = new
        except OSError as e:
            for c, new in done.items():
                try:
                    os.rename(new, self.paths[c])
                except OSError:
                    pass
            raise SandboxError(f"cgroup rename to {name} failed: {e}") from None
        return SandboxCgroups(self.version, done)

    @classmethod
    def named(cls, prefix: str, root: Path = ROOT, *, group: str) -> list["SandboxCgroups"]:
        """The existing cgroups of this instance whose name starts with prefix (leftovers)."""
        version, _ = detect(root)
        found: dict[str, dict[str, str]] = {}
        bases = {c: root / c / PARENT / group for c in V1_CONTROLLERS} if version == "v1" else \
            {"unified": root / PARENT / group} if version == "v2" else {}
        for c, base in bases.items():
            try:
                names = [d.name for d in base.iterdir() if d.is_dir() and d.name.startswith(prefix)]
            except OSError:
                continue
            for n in names:
                found.setdefault(n, {})[c] = str(base / n)
        return [cls(version, paths) for paths in found.values()]

    @classmethod
    def by_sandbox(cls, root: Path = ROOT, *, group: str) -> dict[str, "SandboxCgroups"]:
        """This instance's cgroups named as a sandbox (a pooled launcher's are not), by name:
        what a restart checks against the sandboxes it keeps."""
        out = {}
        for cg in cls.named("", root, group=group):
            name = Path(next(iter(cg.paths.values()))).name
            if ids.is_sandbox_id(name):
                out[name] = cg
        return out

    def _limits_v1(self, lim: Limits) -> None:
        mem = Path(self.paths["memory"])
        nbytes = str(lim.memory_mb << 20)
        _write(mem / "memory.limit_in_bytes", nbytes)
        if (mem / "memory.memsw.limit_in_bytes").exists():   # no swapping around the limit
            _write(mem / "memory.memsw.limit_in_bytes", nbytes)
        _write(Path(self.paths["pids"]) / "pids.max", str(lim.pids))
        cpu = Path(self.paths["cpu"])
        _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(lim.cpus * CFS_PERIOD_US))))

    def _limits_v2(self, lim: Limits) -> None:
        d = Path(self.paths["unified"])
        _write(d / "memory.max", str(lim.memory_mb << 20))
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
        _write(d / "pids.max", str(lim.pids))
        _write(d / "cpu.max", f"{max(1000, int(lim.cpus * CFS_PERIOD_US))} {CFS_PERIOD_US}")

    def procs_files(self) -> list[str]:
        """cgroup.procs of every hierarchy the sandbox must be in (before it runs anything)."""
        return [str(Path(p) / "cgroup.procs") for p in self.paths.values()]

    # -- reading --------------------------------------------------------------
    def _read(self, ctl: str, name: str) -> str | None:
        p = self.paths.get(ctl)
        try:
            return (Path(p) / name).read_text() if p else None
        except OSError:
            return None

    def pids(self) -> list[int]:
        raw = self._read("pids" if self.version == "v1" else "unified", "cgroup.procs") or ""
        return [int(x) for x in raw.split()]

    def usage(self) -> dict:
        if self.version == "v1":
            mem = self._read("memory", "memory.usage_in_bytes")
            cpu_ns = self._read("cpuacct", "cpuacct.usage")
            npids = self._read("pids", "pids.current")
            return {"memory_bytes": int(mem or 0), "cpu_seconds": int(cpu_ns or 0) / 1e9, "pids": int(npids or 0)}
        mem = self._read("unified", "memory.current")
        stat = self._read("unified", "cpu.stat") or ""
        usec = next((int(line.split()[1]) for line in stat.splitlines() if line.startswith("usage_usec ")), 0)
        npids = self._read("unified", "pids.current")
        return {"memory_bytes": int(mem or 0), "cpu_seconds": usec / 1e6, "pids": int(npids or 0)}

    # -- control --------------------------------------------------------------
    def can_freeze(self) -> bool:
        return "freezer" in self.paths or self.version == "v2"

    def freeze(self, timeout: float = 5.0) -> None:
        self._set_frozen(True, timeout)

    def frozen(self) -> bool:
        """The kernel's view: freezer.state FROZEN (v1) / cgroup.events "frozen 1" (v2)."""
        if self.version == "v1":
            return (self._read("freezer", "freezer.state") or "").strip() == "FROZEN"
        return "frozen 1" in (self._read("unified", "cgroup.events") or "")

    def thaw(self, timeout: float = 5.0) -> None:
        self._set_frozen(False, timeout)

    def _set_frozen(self, frozen: bool, timeout: float) -> None:
        try:
            self._set_frozen_unchecked(frozen, timeout)
        except FileNotFoundError:       # the cgroup went away (the sandbox was removed meanwhile)
            raise SandboxError(f"cgroup gone: cannot {'freeze' if frozen else 'thaw'}") from None

    def _set_frozen_unchecked(self, frozen: bool, timeout: float) -> None:
        if self.version == "v1":
            if "freezer" not in self.paths:
                raise SandboxError("no freezer cgroup")
            d = Path(self.paths["freezer"])
            want = "FROZEN" if frozen else "THAWED"
            _write(d / "freezer.state", want)
            deadline = time.monotonic() + timeout
            while (d / "freezer.state").read_text().strip() != want:   # FREEZING until every task stopped
                if time.monotonic() > deadline:
                    raise SandboxError(f"freezer did not reach {want}")
                time.sleep(0.005)
                _write(d / "freezer.state", want)
        else:
            d = Path(self.paths["unified"])
            _write(d / "cgroup.freeze", "1" if frozen else "0")
            deadline = time.monotonic() + timeout
            while f"frozen {int(frozen)}" not in (d / "cgroup.events").read_text():
                if time.monotonic() > deadline:
                    raise SandboxError("cgroup.freeze timed out")
                time.sleep(0.005)

    def kill_all(self, timeout: float = 5.0) -> set[int]:
        """SIGKILL every task; freeze first so a fork bomb cannot outrun the loop.
        Returns the pids signalled (callers may wait for them to be reaped)."""
        killed: set[int] = set()
        if self.version == "v2" and "unified" in self.paths:
            try:
                _write(Path(self.paths["unified"]) / "cgroup.kill", "1")
            except OSError:
                pass
        frozen = False
        # v2 too (cgroup.freeze): without cgroup.kill (kernels < 5.14) a fork bomb would
        # otherwise outrun the signal loop.
        if (self.version == "v1" and "freezer" in self.paths) or (self.version == "v2" and "unified" in self.paths):
            try:
                self.freeze(timeout=min(timeout, 2.0))
                frozen = True
            except (OSError, SandboxError):
                pass
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                pids = self.pids()
                if not pids:
                    return killed
                killed.update(pids)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if frozen:   # killed tasks only die once thawed
                    frozen = False
                    try:
                        self.thaw(timeout=1.0)
                    except (OSError, SandboxError):
                        pass
                time.sleep(0.005)
            return killed
        finally:
            if frozen:
                try:
                    self.thaw(timeout=1.0)
                except (OSError, SandboxError):
                    pass

    def remove(self, timeout: float = 3.0) -> bool:
        """rmdir every sandbox cgroup (retrying while exiting tasks leave). True when all gone."""
        deadline = time.monotonic() + timeout
        left = []
        for p in self.paths.values():
            while True:
                try:
                    os.rmdir(p)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        left.append(p)
                        break
                    time.sleep(0.01)
        return not left

    def exists(self) -> bool:
        return any(Path(p).exists() for p in self.paths.values())
