"""One QEMU `-M microvm` process: its command line (pure), launch, QMP, stop.

The VM runs in its own session (it survives a daemon restart); the process that started
it reaps it when it kills it (after a restart, init does). It is started through the agent's
`--launch` mode, which joins the sandbox cgroups before exec'ing (nothing of the VM is
ever charged outside its limits), and through `nsenter --net` so that its tap device
lives in the sandbox's cubevs namespace.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_runtime.backend import SandboxError

QEMU = "qemu-system-x86_64"


@functools.lru_cache(maxsize=1)
def qemu_version() -> str:
    """Part of a template's key: a snapshot only loads into the QEMU that wrote it."""
    r = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=10)
    m = re.search(r"version (\S+)", r.stdout)
    if r.returncode != 0 or not m:
        raise SandboxError(f"{QEMU} --version failed")
    return m.group(1)


@dataclass(frozen=True)
class VmConfig:
    kernel: str
    initrd: str
    memory_mb: int
    cpus: int
    accel: str                  # "tcg" | "kvm"
    tsc_khz: int
    run_dir: str                # sockets, pidfile, console log
    mac: str = "02:00:00:00:00:01"
    tap: str | None = None      # None: a NIC without a backend (template boots)
    incoming: str | None = None  # migration file to start from (exec:cat; template tooling)
    incoming_fd: int | None = None  # ... or an fd qemu inherits (untrusted VMs: no spawning)
    runas: str | None = None     # "uid:gid": drop root after setup and enable qemu's seccomp
    disk: str | None = None      # read-only root disk image (a template, vmdisk.py); None: initramfs only
    cmdline_extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def agent_sock(self) -> str:
        return os.path.join(self.run_dir, "agent.sock")

    @property
    def qmp_sock(self) -> str:
        return os.path.join(self.run_dir, "qmp.sock")

    @property
    def pidfile(self) -> str:
        return os.path.join(self.run_dir, "qemu.pid")

    @property
    def console(self) -> str:
        return os.path.join(self.run_dir, "console.log")


def kernel_cmdline(cfg: VmConfig) -> str:
    # tsc: under TCG the guest cannot calibrate its clock quickly; tell it the host's rate.
    # The command line must be identical for a template and the VMs restored from it.
    # init_on_free: memory a process or file gave back is zeroed, so what a clone's killed
    # inherited processes held (their env: the parent's placeholders) is not left in free pages.
    return " ".join(("console=ttyS0", "quiet", "loglevel=3", "rdinit=/init", "panic=-1",
                     f"tsc_early_khz={cfg.tsc_khz}", "tsc=reliable", "no_timer_check",
                     "i8042.noaux", "i8042.nomux", "i8042.nopnp", "random.trust_cpu=on",
                     "ipv6.disable=1", "init_on_free=1", *(("cubegate.root=vda",) if cfg.disk else ()),
                     *cfg.cmdline_extra))


def qemu_argv(cfg: VmConfig) -> list[str]:
    """Everything but the launcher. Device set and order must match between a template and
    its restores (migration checks it)."""
    net = f"virtio-net-device,mac={cfg.mac}"
    argv = [QEMU, "-M", "microvm,pit=off,pic=off,rtc=off", "-accel", cfg.accel,
            *(["-cpu", "host"] if cfg.accel == "kvm" else []),
            "-m", str(cfg.memory_mb), "-smp", str(cfg.cpus),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-kernel", cfg.kernel, "-initrd", cfg.initrd, "-append", kernel_cmdline(cfg),
            # ring buffer, not a file: guest root writing to ttyS0 must not fill the host's disk
            "-chardev", "ringbuf,id=console,size=65536", "-serial", "chardev:console",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={cfg.agent_sock},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=cubegate.agent",
            "-device", "virtio-rng-device",
            *(["-drive", f"file={cfg.disk},if=none,id=root,format=raw,readonly=on,cache=writethrough",
               "-device", "virtio-blk-device,drive=root"] if cfg.disk else []),
            "-qmp", f"unix:{cfg.qmp_sock},server=on,wait=off",
            # no RARP "self-announce" after a restore: it would carry the template's MAC,
            # which the switch drops (and audits) as a spoof
            "-global", "migration.announce-rounds=0",
            "-pidfile", cfg.pidfile]
    if cfg.tap:
        argv += ["-netdev", f"tap,id=net0,ifname={cfg.tap},script=no,downscript=no,vhost=off",
                 "-device", f"{net},netdev=net0"]
    else:
        argv += ["-device", net]
    if cfg.incoming_fd is not None:
        argv += ["-incoming", f"fd:{cfg.incoming_fd}"]
    elif cfg.incoming:
        argv += ["-incoming", "exec:cat " + shlex.quote(cfg.incoming)]
    if cfg.runas:
        # A guest that escapes into qemu is then an unprivileged uid of its own, without
        # exec/fork/obsolete syscalls (the tap, sockets and files are opened before the drop).
        # elevateprivileges=deny would also block the setuid() that -runas itself does.
        argv += ["-runas", cfg.runas,
                 "-sandbox", "on,obsolete=deny,spawn=deny,resourcecontrol=deny"]
    return argv


def launch_argv(cfg: VmConfig, *, agent: str, cgroup_procs: list[str], netns: str | None) -> list[str]:
    argv = [agent, "--launch"]
    for p in cgroup_procs:
        argv += ["--cgroup", p]
    argv.append("--")
    if netns:
        argv += ["nsenter", f"--net=/run/netns/{netns}", "--"]
    return argv + qemu_argv(cfg)


def start(cfg: VmConfig, *, agent: str, cgroup_procs: list[str], netns: str | None,
          timeout: float = 30.0, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start qemu and return once its QMP socket accepts. The Popen's pid is qemu's own (the
    launcher and nsenter exec, they do not fork); the caller reaps it when it kills the VM.
    No -daemonize: its fork is exactly what qemu's seccomp `spawn=deny` forbids."""
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    for f in (cfg.agent_sock, cfg.qmp_sock, cfg.pidfile):
        with suppress(FileNotFoundError):
            os.unlink(f)
    errlog = os.path.join(cfg.run_dir, "qemu.err")
    with open(errlog, "wb") as err:
        proc = subprocess.Popen(launch_argv(cfg, agent=agent, cgroup_procs=cgroup_procs, netns=netns),
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err, pass_fds=pass_fds,
                                # never the daemon's environment (it may hold the vault key)
                                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SandboxError(f"qemu failed to start (exit {proc.returncode}): {tail(errlog)}")
        if os.path.exists(cfg.qmp_sock):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(cfg.qmp_sock)
                return proc
            except OSError:
                pass
            finally:
                s.close()
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=5)
            raise SandboxError("qemu did not start in time")
        time.sleep(0.005)


def tail(path: str, n: int = 400) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def is_qemu(pid: int, run_dir: str) -> bool:
    """Guard against pid reuse after a restart: the process must be our qemu for this run dir."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return QEMU.encode() in cmd and run_dir.encode() in cmd


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def kill(pid: int, run_dir: str, timeout: float = 5.0) -> None:
    if pid_alive(pid) and is_qemu(pid, run_dir):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    reap(pid)


def reap(pid: int) -> None:
    """Collect the exit status if qemu is our child (started by this process); after a
    daemon restart it is init's child and init reaps it."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return
    if ppid == os.getpid():
        with suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


class QmpError(SandboxError):
    pass


class Qmp:
    """Minimal QMP client (one connection, synchronous, bounded by a socket timeout)."""

    def __init__(self, path: str, timeout: float = 10.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.buf = b""
        try:
            self.sock.connect(path)
            self._read()                                   # greeting
            self.execute("qmp_capabilities")
        except (OSError, ValueError) as e:
            self.sock.close()
            raise QmpError(f"QMP connect failed: {e}") from None

    def _read(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise QmpError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def execute(self, cmd: str, _fd: int | None = None, **args) -> dict:
        """_fd: passed along (SCM_RIGHTS) with the command, for `getfd`."""
        msg = {"execute": cmd, **({"arguments": args} if args else {})}
        try:
            data = json.dumps(msg).encode() + b"\n"
            if _fd is None:
                self.sock.sendall(data)
            else:
                socket.send_fds(self.sock, [data], [_fd])
            while True:
                r = self._read()
                if "return" in r:
                    return r["return"]
                if "error" in r:
                    raise QmpError(f"{cmd}: {r['error'].get('desc', r['error'])}")
                # else an async event: skip
        except (OSError, ValueError) as e:
            raise QmpError(f"{cmd}: {e}") from None

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()

    def __enter__(self) -> "Qmp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_status(qmp: Qmp, want: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        st = qmp.execute("query-status")["status"]
        if st in want:
            return st
        if time.monotonic() > deadline:
            raise QmpError(f"VM status {st!r}, wanted {sorted(want)}")
        time.sleep(0.01)


def save_snapshot(qmp: Qmp, path: str, timeout: float = 60.0) -> None:
    """Stop the VM and write its full state to `path` (migration to a file)."""
    qmp.execute("stop")
    qmp.execute("migrate", uri="exec:cat > " + shlex.quote(path))
    deadline = time.monotonic() + timeout
    while True:
        st = qmp.execute("query-migrate").get("status")
        if st == "completed":
            return
        if st in ("failed", "cancelled") or time.monotonic() > deadline:
            raise QmpError(f"snapshot migration {st}")
        time.sleep(0.02)


def save_snapshot_fd(qmp: Qmp, fd: int, timeout: float = 120.0) -> None:
    """Stop the VM and write its full state to the open file `fd` (qemu under `-sandbox
    spawn=deny` cannot run `cat`, and as its own uid cannot open our files). The VM stays
    stopped ("postmigrate"): the caller `cont`s it."""
    qmp.execute("getfd", _fd=fd, fdname="snapshot")
    try:
        qmp.execute("stop")
        qmp.execute("migrate", uri="fd:snapshot")
        deadline = time.monotonic() + timeout
        while True:
            st = qmp.execute("query-migrate").get("status")
            if st == "completed":
                return
            if st in ("failed", "cancelled") or time.monotonic() > deadline:
                with suppress(QmpError):
                    qmp.execute("migrate_cancel")
                raise QmpError(f"snapshot migration {st}")
            time.sleep(0.02)
    finally:
        with suppress(QmpError):
            qmp.execute("closefd", fdname="snapshot")
