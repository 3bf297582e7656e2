"""MicrovmBackend: each sandbox is a QEMU microVM restored from a template snapshot.

create: tap+bridge in the cubevs namespace → cgroups → qemu -incoming <template> (in the
namespace, in the cgroups, own session) → cont → agent ping → per-sandbox setup through the
agent (clock, RNG seed, IP/MAC/routes, resolv.conf, /workspace size) → CA, env, files.
The template was taken before the sandbox existed, so nothing sandbox-specific is in it.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from contextlib import suppress
from pathlib import Path

from sandbox_runtime import cgroups, ids
from sandbox_runtime.uids import sandbox_uid
from sandbox_runtime.backend import ExecResult, Handle, Limits, NotSupported, SandboxError, SandboxSpec

from . import assets, netplumb, template, vm
from .channel import AgentChannel

NAME = "microvm"
SANDBOX_CA_PATH = "/etc/ssl/certs/ca-certificates.crt"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
QEMU_OVERHEAD_MB = 192      # qemu's own memory on top of guest RAM, inside the cgroup limit
QEMU_PIDS = 128             # qemu threads; limits.pids cannot be enforced inside the guest
RESTORE_TIMEOUT = 30.0


def base_env(sandbox_id: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/workspace",
            "USER": "root", "LANG": "C.UTF-8", "HOSTNAME": sandbox_id, "TMPDIR": "/tmp",
            "SSL_CERT_FILE": SANDBOX_CA_PATH, "CURL_CA_BUNDLE": SANDBOX_CA_PATH,
            "REQUESTS_CA_BUNDLE": SANDBOX_CA_PATH, "NODE_EXTRA_CA_CERTS": SANDBOX_CA_PATH}


def workspace_path(rel: str) -> str:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise SandboxError(f"invalid file path {rel!r} (relative to /workspace, no '..')")
    return "/workspace/" + "/".join(parts)


class MicrovmBackend:
    name = NAME
    memory_overhead_mb = QEMU_OVERHEAD_MB   # admission counts it (manager._footprint)

    def __init__(self, state_dir: Path, assets_dir: Path = assets.DEFAULT_ASSETS_DIR,
                 ca_bundle: Path | None = None, *, agent_binary: Path = assets.DEFAULT_AGENT,
                 accel: str | None = None):
        self.state_dir = Path(state_dir)
        self.instance = ids.instance_name(self.state_dir)   # host-wide names are per runtime instance
        self.assets_dir = Path(assets_dir)
        self.ca_bundle = Path(ca_bundle) if ca_bundle else None
        self.agent_binary = Path(agent_binary)     # host side: `--launch` (setsid + cgroups + exec)
        self._accel = accel                         # None: timed probe (cached)
        self._channels: dict[str, AgentChannel] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ availability
    def available(self) -> tuple[bool, str]:
        if shutil.which(vm.QEMU) is None:
            return False, f"{vm.QEMU} not installed (apt: qemu-system-x86)"
        for tool in ("ip", "tc", "nsenter"):
            if shutil.which(tool) is None:
                return False, f"{tool} not installed (apt: iproute2 / util-linux)"
        if not self.agent_binary.is_file():
            return False, f"agent {self.agent_binary} missing (python -m sandbox_runtime.build_agent)"
        # not checked against the host's agent build: the guest runs the agent embedded in the
        # assets (and templates); `microvm build` refreshes it when the host's one changed
        ok, why = assets.assets_ready(self.assets_dir)
        if not ok:
            return False, why
        version, why = cgroups.detect()
        if version is None:
            return False, why
        return True, ""

    def accel(self) -> dict:
        """{"accel": "tcg"|"kvm", "tcg_s": boot seconds, "kvm_s": ...} (probed once, cached)."""
        if self._accel:
            return {"accel": self._accel}
        man = assets.Manifest.load(self.assets_dir)
        return template.probe_accel(self.assets_dir, man, str(self.agent_binary))

    def cold_boot_ms(self, memory_mb: int = 256) -> float:
        """A boot without a snapshot, to the agent's first answer (the bench's reference)."""
        import tempfile
        run = tempfile.mkdtemp(prefix="cold-", dir=self.assets_dir)
        try:
            cfg = template.vm_config(self.assets_dir, run, memory_mb=memory_mb, cpus=1, accel=self.accel()["accel"],
                                   tsc=template.host_tsc_khz())
            pid, ch, secs = template.cold_boot(cfg, str(self.agent_binary), template.BOOT_TIMEOUT)
            ch.close()
            vm.kill(pid, run)
            return secs * 1000
        finally:
            shutil.rmtree(run, ignore_errors=True)

    def template_for(self, limits: Limits) -> template.Template:
        ok, why = self.available()
        if not ok:
            raise SandboxError(why)
        man = assets.Manifest.load(self.assets_dir)
        return template.ensure_template(self.assets_dir, man, str(self.agent_binary),
                                        memory_mb=limits.memory_mb, cpus=max(1, int(-(-limits.cpus // 1))),
                                        accel=self.accel()["accel"])

    # ------------------------------------------------------------------ lifecycle
    def create(self, spec: SandboxSpec, netns: str, *, ip: str, gateway_ip: str) -> Handle:
        sid = spec.sandbox_id
        if not ids.is_sandbox_id(sid):
            raise SandboxError(f"invalid sandbox id {sid!r}")
        if spec.template or spec.seed_layer:
            # the guest boots its busybox initramfs; a template as its root disk is not wired yet
            raise NotSupported("the microvm backend does not boot rootfs templates yet (use backend namespace)")
        tpl = self.template_for(spec.limits)
        run_dir = self.state_dir / sid
        if len(str(run_dir / "agent.sock")) > 100:
            raise SandboxError(f"state dir path too long for a unix socket: {run_dir}")
        h = Handle(sandbox_id=sid, backend=NAME, netns=netns,
                   data={"run_dir": str(run_dir), "ip": ip, "gateway_ip": gateway_ip})
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise SandboxError(f"sandbox {sid} state dir already exists") from None
        try:
            uid = sandbox_uid(ip)
            mac = netplumb.setup(netns, uid)
            h.data["mac"] = mac
            lim = spec.limits
            cg = cgroups.SandboxCgroups.create(sid, Limits(memory_mb=lim.memory_mb + QEMU_OVERHEAD_MB,
                                                          cpus=lim.cpus, pids=QEMU_PIDS, disk_mb=lim.disk_mb),
                                                    group=self.instance)
            h.data["cgroups"] = cg.to_json()
            snap_fd = os.open(tpl.snapshot, os.O_RDONLY)
            try:
                cfg = template.restore_config(self.assets_dir, tpl, str(run_dir), tap=netplumb.TAP, mac=mac,
                                              incoming_fd=snap_fd, runas=f"{uid}:{uid}")
                pid = vm.start(cfg, agent=str(self.agent_binary), cgroup_procs=cg.procs_files(), netns=netns,
                               pass_fds=(snap_fd,)).pid
            finally:
                os.close(snap_fd)
            h.data.update(pid=pid, agent_sock=cfg.agent_sock, qmp_sock=cfg.qmp_sock, accel=tpl.accel,
                          template=tpl.snapshot)
            deadline = time.monotonic() + RESTORE_TIMEOUT
            with vm.Qmp(cfg.qmp_sock) as q:
                st = vm.wait_status(q, {"paused", "running", "postmigrate"}, RESTORE_TIMEOUT)
                if st != "running":
                    q.execute("cont")
            ch = self._channel(h)
            ch.ping_until(deadline)
            self._setup_guest(h, ch, spec, mac=mac, ip=ip, gateway_ip=gateway_ip)
            return h
        except BaseException as e:
            err = vm.tail(str(run_dir / "qemu.err"))
            self.destroy(h)
            if isinstance(e, SandboxError):
                raise SandboxError(f"{e}{' (qemu: ' + err + ')' if err else ''}") from None
            raise SandboxError(f"microvm create failed: {e}") from e

    def _setup_guest(self, h: Handle, ch: AgentChannel, spec: SandboxSpec, *, mac: str, ip: str,
                     gateway_ip: str) -> None:
        argv = ["/sbin/cg-setup", str(int(time.time())), ip, gateway_ip, mac, str(spec.limits.disk_mb)]
        r = ch.exec(lambda c: c.exec(argv, timeout=15, stdin=os.urandom(256), cwd="/"))
        if r.exit_code != 0:
            raise SandboxError(f"guest setup failed ({r.exit_code}): {r.stderr.decode(errors='replace')[-300:]}")
        ca = self._ca_pem()
        if ca:
            ch.call(lambda c: c.write_file(SANDBOX_CA_PATH, ca, 0o644))
        env = {**base_env(h.sandbox_id), **spec.env}
        ch.call(lambda c: c.set_env(env))
        for rel, content in spec.files.items():
            path = workspace_path(rel)
            ch.call(lambda c: c.write_file(path, content, 0o644))

    def _ca_pem(self) -> bytes:
        pem = HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.exists() else b""
        if self.ca_bundle:
            try:
                pem += b"\n" + self.ca_bundle.read_bytes()
            except OSError as e:
                raise SandboxError(f"CA bundle unreadable: {e.strerror}") from None
        return pem

    def _channel(self, h: Handle) -> AgentChannel:
        # a request sent to a stopped VM would wait in the port and desync the stream later
        if h.data.get("paused"):
            raise SandboxError(f"sandbox {h.sandbox_id} is paused")
        with self._lock:
            ch = self._channels.get(h.sandbox_id)
            if ch is None or ch.path != h.data.get("agent_sock"):
                if not h.data.get("agent_sock"):
                    raise SandboxError(f"sandbox {h.sandbox_id} has no agent socket")
                ch = self._channels[h.sandbox_id] = AgentChannel(h.data["agent_sock"])
            return ch

    def close(self) -> None:
        """Drop every agent connection (daemon shutdown). qemu serves one client per port, so
        only one process at a time can talk to a VM."""
        with self._lock:
            chans, self._channels = list(self._channels.values()), {}
        for ch in chans:
            ch.close()

    # ------------------------------------------------------------------ agent calls
    def exec(self, h: Handle, argv: list[str], *, timeout: float = 30.0, env: dict[str, str] | None = None,
             stdin: bytes = b"", cwd: str = "/workspace", on_output=None) -> ExecResult:
        return self._channel(h).exec(lambda c: c.exec(argv, timeout=timeout, env=env, stdin=stdin, cwd=cwd,
                                                      on_output=on_output))

    def write_file(self, h: Handle, path: str, data: bytes, mode: int = 0o644) -> None:
        self._channel(h).call(lambda c: c.write_file(path, data, mode))

    def read_file(self, h: Handle, path: str, max_bytes: int = 16 << 20) -> bytes:
        return self._channel(h).call(lambda c: c.read_file(path, max_bytes))

    def agent_call(self, h: Handle, fn):
        """fn(AgentClient) on the VM's serial agent (no streamed execs there)."""
        return self._channel(h).call(fn)

    def set_env(self, h: Handle, env: dict[str, str]) -> None:
        full = {**base_env(h.sandbox_id), **env}
        self._channel(h).call(lambda c: c.set_env(full))

    # ------------------------------------------------------------------ VM control
    def _qmp(self, h: Handle, cmd: str) -> None:
        if not self._vm_alive(h):
            raise SandboxError(f"sandbox {h.sandbox_id}: VM is not running")
        with vm.Qmp(h.data["qmp_sock"], timeout=5.0) as q:
            q.execute(cmd)

    def pause(self, h: Handle) -> None:
        h.data["paused"] = True
        try:
            self._qmp(h, "stop")
        except SandboxError:
            h.data.pop("paused", None)
            raise

    def resume(self, h: Handle) -> None:
        self._qmp(h, "cont")
        h.data.pop("paused", None)

    # ------------------------------------------------------------------ snapshots
    SNAPSHOT_MISSING = ("microVM snapshots (guest memory and disk through QMP) are not implemented yet; "
                        "snapshot, clone and rollback work for namespace sandboxes on a template")

    def snapshot_layer(self, h: Handle, dest) -> dict:
        raise NotSupported(self.SNAPSHOT_MISSING)

    def rollback(self, h: Handle, **_) -> Handle:
        raise NotSupported(self.SNAPSHOT_MISSING)

    def _vm_alive(self, h: Handle) -> bool:
        pid = h.data.get("pid")
        return bool(pid) and vm.pid_alive(pid) and vm.is_qemu(pid, h.data.get("run_dir", ""))

    def alive(self, h: Handle) -> bool:
        if not self._vm_alive(h):
            return False
        try:
            self._channel(h).call(lambda c: c.ping(timeout=3.0))
            return True
        except SandboxError:
            return False

    def usage(self, h: Handle) -> dict:
        """memory_bytes = qemu RSS (what the VM really holds); the cgroup figure also counts
        page cache such as the template file it read, so it is reported beside it."""
        pid = h.data.get("pid") if self._vm_alive(h) else None
        rss = vm.rss_bytes(pid) if pid else 0
        cg = cgroups.SandboxCgroups.from_json(h.data["cgroups"]).usage() if h.data.get("cgroups") else {}
        return {"memory_bytes": rss, "rss_bytes": rss, "cgroup_memory_bytes": cg.get("memory_bytes", 0),
                "cpu_seconds": cg.get("cpu_seconds") or (vm.cpu_seconds(pid) if pid else 0.0),
                "pids": cg.get("pids", 0)}

    def destroy(self, h: Handle) -> None:
        with self._lock:
            ch = self._channels.pop(h.sandbox_id, None)
        if ch:
            ch.close()
        d = h.data
        pid, run_dir = d.get("pid"), d.get("run_dir", "")
        if pid and d.get("qmp_sock") and self._vm_alive(h):
            with suppress(SandboxError, OSError):
                with vm.Qmp(d["qmp_sock"], timeout=1.0) as q:
                    q.execute("quit")
            deadline = time.monotonic() + 2.0
            while vm.pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        if pid:
            vm.kill(pid, run_dir)
        if d.get("cgroups"):
            cg = cgroups.SandboxCgroups.from_json(d["cgroups"])
            cg.kill_all(timeout=3.0)       # e.g. the `cat` feeding an interrupted restore
            cg.remove()
        netplumb.teardown(h.netns, d.get("ip"), d.get("gateway_ip"))
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)

