"""MicrovmBackend: each sandbox is a QEMU microVM restored from a snapshot.

create: tap+bridge in the cubevs namespace → cgroups → qemu -incoming <snapshot> (in the
namespace, in the cgroups, own session, as the sandbox's uid) → cont → agent ping →
per-sandbox setup through the agent (clock, RNG seed, IP/MAC/routes, resolv.conf, hostname,
writable layer size) → CA, env, files.

The snapshot is a boot snapshot (taken before the sandbox existed: nothing sandbox-specific
in it), or for a clone / rollback a snapshot of a running sandbox (snapshot.py). A rootfs
template (sandbox_runtime/templates) is the guest's read-only root disk (vmdisk.py), under an
overlay whose writable layer is guest memory: a memory snapshot holds the whole VM.

A clone restores another sandbox's memory. Its network identity is its own (the guest is
re-addressed; cubevs drops any frame with the parent's IP or MAC, and the gateway knows a
sandbox by its address), every inherited process is killed, the agent included (cg-fresh;
freed memory is zeroed, init_on_free=1), the parent's placeholders in its files are replaced
by its own, its env is its own. Whatever of the parent's is still in guest memory (kernel
buffers) is at most a placeholder: the gateway resolves only the clone's own.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from contextlib import suppress
from pathlib import Path

from sandbox_runtime import cgroups, ids, vmdisk
from sandbox_runtime.uids import sandbox_uid
from sandbox_runtime.backend import ExecResult, Handle, Limits, NotSupported, SandboxError, SandboxSpec
from sandbox_runtime.templates import trust as tpl_trust

from . import assets, netplumb, template, vm
from .channel import RECONNECT_GAP_S, AgentChannel
from .snapshot import MEMORY, VmSnapshot, incompatibility, token_pairs, vm_cpus

log = logging.getLogger("cubegate.microvm")
NAME = "microvm"
SANDBOX_CA_PATH = "/etc/ssl/certs/ca-certificates.crt"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
QEMU_OVERHEAD_MB = 192      # qemu's own memory on top of guest RAM, inside the cgroup limit
QEMU_PIDS = 128             # qemu threads; limits.pids cannot be enforced inside the guest
RESTORE_TIMEOUT = 30.0
SNAPSHOT_TIMEOUT = 120.0
TOOLS = assets.TOOLS
SH = "/run/cubegate/bin/sh"     # our busybox (either mode), never the template's


def base_env(sandbox_id: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/workspace",
            "USER": "root", "LANG": "C.UTF-8", "HOSTNAME": sandbox_id, "TMPDIR": "/tmp",
            "SSL_CERT_FILE": SANDBOX_CA_PATH, "CURL_CA_BUNDLE": SANDBOX_CA_PATH,
            "REQUESTS_CA_BUNDLE": SANDBOX_CA_PATH, "NODE_EXTRA_CA_CERTS": SANDBOX_CA_PATH}


def etc_files(sandbox_id: str) -> dict[str, bytes]:
    """Identity files of a template guest (resolv.conf: cg-net)."""
    return {"/etc/hostname": f"{sandbox_id}\n".encode(),
            "/etc/hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{sandbox_id}\n".encode()}


def _tpl(h: Handle) -> dict | None:
    """The rootfs template a VM runs on (handles of older versions kept a snapshot path here)."""
    t = h.data.get("template")
    return t if isinstance(t, dict) else None


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
                 accel: str | None = None, templates=None):
        self.state_dir = Path(state_dir)
        self.instance = ids.instance_name(self.state_dir)   # host-wide names are per runtime instance
        self.assets_dir = Path(assets_dir)
        self.ca_bundle = Path(ca_bundle) if ca_bundle else None
        self.agent_binary = Path(agent_binary)     # host side: `--launch` (setsid + cgroups + exec)
        self._accel = accel                         # None: timed probe (cached)
        self.templates = templates                  # TemplateStore; None: initramfs-only guests
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

    def template_for(self, limits: Limits, rootfs=None) -> template.Template:
        """The boot snapshot for these limits (and rootfs template: its image is the root disk)."""
        ok, why = self.available()
        if not ok:
            raise SandboxError(why)
        man = assets.Manifest.load(self.assets_dir)
        disk = str(self._image(rootfs)) if rootfs is not None else None
        # the boot snapshot holds the guest's cache of the disk: keyed by the image build too
        disk_key = rootfs.key[:8] + (vmdisk.image_id(disk) or "")[:8] if disk else None
        return template.ensure_template(self.assets_dir, man, str(self.agent_binary),
                                        memory_mb=limits.memory_mb, cpus=vm_cpus(limits.cpus),
                                        accel=self.accel()["accel"], disk=disk, disk_key=disk_key)

    def _rootfs(self, name: str):
        if self.templates is None:
            raise SandboxError("templates are not configured for the microvm backend")
        from sandbox_runtime.templates import TemplateError
        try:
            return self.templates.resolve(name)
        except TemplateError as e:
            raise SandboxError(str(e)) from None

    @staticmethod
    def _image(rootfs) -> Path:
        try:
            return vmdisk.ensure_image(rootfs.rootfs.parent, rootfs.rootfs)
        except vmdisk.DiskError as e:
            raise SandboxError(str(e)) from None

    def _seed(self, spec: SandboxSpec, rootfs) -> tuple[template.Template, VmSnapshot]:
        """The snapshot a clone / rollback restores, checked against what it must run as."""
        try:
            snap = VmSnapshot.load(Path(spec.seed_layer))
        except (OSError, ValueError, TypeError) as e:
            raise SandboxError(f"not a microVM snapshot ({type(e).__name__})") from None
        ok, why = self.available()
        if not ok:
            raise SandboxError(why)
        why = incompatibility(snap, assets_hash=assets.Manifest.load(self.assets_dir).hash, qemu=vm.qemu_version(),
                              memory_mb=spec.limits.memory_mb, cpus=spec.limits.cpus,
                              template_key=rootfs.key if rootfs is not None else None,
                              disk_id=vmdisk.image_id(Path(snap.disk)) if snap.disk else None)
        if why:
            raise NotSupported(why)      # a property a restore cannot have: refused, nothing started
        return template.Template(snapshot=str(Path(spec.seed_layer) / MEMORY), accel=snap.accel,
                                 memory_mb=snap.memory_mb, cpus=snap.cpus, tsc_khz=snap.tsc_khz,
                                 disk=snap.disk), snap

    # ------------------------------------------------------------------ lifecycle
    def create(self, spec: SandboxSpec, netns: str, *, ip: str, gateway_ip: str) -> Handle:
        sid = spec.sandbox_id
        if not ids.is_sandbox_id(sid):
            raise SandboxError(f"invalid sandbox id {sid!r}")
        t_start = time.monotonic()
        rootfs = self._rootfs(spec.template) if spec.template else None
        if spec.seed_layer:
            tpl, seed = self._seed(spec, rootfs)
        else:
            tpl, seed = self.template_for(spec.limits, rootfs), None
        run_dir = self.state_dir / sid
        if len(str(run_dir / "agent.sock")) > 100:
            raise SandboxError(f"state dir path too long for a unix socket: {run_dir}")
        h = Handle(sandbox_id=sid, backend=NAME, netns=netns,
                   data={"run_dir": str(run_dir), "ip": ip, "gateway_ip": gateway_ip, "env": dict(spec.env)})
        if rootfs is not None:
            h.data["template"] = {"name": rootfs.name, "key": rootfs.key, "env": rootfs.env, "tools": rootfs.tools,
                                  "rootfs": str(rootfs.rootfs)}
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
                          template_snapshot=tpl.snapshot, memory_mb=tpl.memory_mb, cpus=tpl.cpus,
                          tsc_khz=tpl.tsc_khz, disk=tpl.disk,
                          disk_id=vmdisk.image_id(Path(tpl.disk)) if tpl.disk else None)
            deadline = time.monotonic() + RESTORE_TIMEOUT
            with vm.Qmp(cfg.qmp_sock) as q:
                st = vm.wait_status(q, {"paused", "running", "postmigrate"}, RESTORE_TIMEOUT)
                if st != "running":
                    q.execute("cont")
            ch = self._channel(h)
            ch.ping_until(deadline)
            t_restored = time.monotonic()
            clone = seed is not None and seed.sandbox != sid
            if clone:
                self._fresh_processes(h, deadline)
            t_fresh = time.monotonic()
            self._setup_guest(h, spec, mac=mac, ip=ip, gateway_ip=gateway_ip)
            log.info("sandbox %s: %s in %.0f ms (restore %.0f, fresh processes %.0f, setup %.0f)", sid,
                     "cloned" if clone else "restored", (time.monotonic() - t_start) * 1000,
                     (t_restored - t_start) * 1000, (t_fresh - t_restored) * 1000, (time.monotonic() - t_fresh) * 1000)
            return h
        except BaseException as e:
            err = vm.tail(str(run_dir / "qemu.err"))
            self.destroy(h)
            if isinstance(e, SandboxError):
                raise SandboxError(f"{e}{' (qemu: ' + err + ')' if err else ''}") from None
            raise SandboxError(f"microvm create failed: {e}") from e

    def _run(self, h: Handle, argv: list[str], *, stdin: bytes = b"", timeout: float = 15.0) -> bytes:
        r = self._channel(h).exec(lambda c: c.exec(argv, timeout=timeout, stdin=stdin, cwd="/",
                                                   env={"PATH": "/run/cubegate/bin:/run/cubegate/sbin"}))
        if r.exit_code != 0:
            what = next((a.rsplit("/", 1)[-1] for a in argv[1:] if a.startswith(TOOLS)), "command")
            raise SandboxError(f"guest {what} failed ({r.exit_code}): "
                               f"{r.stderr.decode(errors='replace')[-300:]}")
        return r.stdout

    def _fresh_processes(self, h: Handle, deadline: float) -> None:
        """Kill every process the snapshot brought along, the agent included, and make sure
        the one answering now is a new agent (init starts it). cg-fresh says on the console
        when it is done: talking to the agent before would race its kill."""
        token = os.urandom(8).hex()
        old = self._run(h, [SH, f"{TOOLS}/cg-fresh", token]).strip()
        self._channel(h).close()
        self._wait_console(h, f"cubegate-fresh {token}", deadline)
        last = ""
        while time.monotonic() < deadline:
            try:
                now = self._run(h, [SH, "-c", "echo $PPID"], timeout=5.0).strip()
                if now and now != old:
                    return
                last = f"agent {now.decode()} still the snapshot's"
            except SandboxError as e:
                last = str(e)
            time.sleep(0.1)
        raise SandboxError(f"the clone's inherited processes could not be replaced: {last}")

    @staticmethod
    def _wait_console(h: Handle, marker: str, deadline: float) -> None:
        seen = ""
        with vm.Qmp(h.data["qmp_sock"], timeout=5.0) as q:
            while time.monotonic() < deadline:
                seen = (seen + q.execute("ringbuf-read", device="console", size=65536, format="utf8"))[-4096:]
                if marker in seen:
                    return
                time.sleep(0.05)
        raise SandboxError("the clone's inherited processes were not killed in time")

    def _setup_guest(self, h: Handle, spec: SandboxSpec, *, mac: str, ip: str, gateway_ip: str) -> None:
        ch = self._channel(h)
        sid = h.sandbox_id
        self._run(h, [SH, f"{TOOLS}/cg-setup", str(int(time.time())), ip, gateway_ip, mac, str(spec.limits.disk_mb),
                      sid], stdin=os.urandom(256))
        tpl = _tpl(h)
        if tpl:
            files = etc_files(sid)
            try:
                bundle = (Path(tpl["rootfs"]) / "etc/ssl/certs/ca-certificates.crt").read_bytes()
            except OSError:
                bundle = b""
            files.update(tpl_trust.trust_files(bundle, self._extra_ca_pem()))
            for path, data in files.items():
                ch.call(lambda c: c.write_file(path, data, 0o644))
        else:
            ca = self._ca_pem()
            if ca:
                ch.call(lambda c: c.write_file(SANDBOX_CA_PATH, ca, 0o644))
        try:
            pairs = token_pairs(spec.seed_tokens)
        except ValueError as e:
            raise SandboxError(str(e)) from None
        if pairs:
            self._run(h, [SH, f"{TOOLS}/cg-retoken", *pairs], timeout=30.0)
        ch.call(lambda c: c.set_env(self._env(h, spec.env)))
        if tpl:
            script = tpl_trust.trust_script(tpl["tools"], len(tpl_trust.split_pem(self._extra_ca_pem())))
            if script:
                r = ch.exec(lambda c: c.exec(["sh", "-c", script], timeout=20.0))
                if r.exit_code != 0:
                    raise SandboxError(f"trusting the gateway CA failed (exit {r.exit_code}): "
                                       f"{r.stderr.decode(errors='replace')[-300:]}")
        for rel, content in spec.files.items():
            path = workspace_path(rel)
            ch.call(lambda c: c.write_file(path, content, 0o644))

    def _env(self, h: Handle, env: dict[str, str]) -> dict[str, str]:
        return tpl_trust.sandbox_env(base_env(h.sandbox_id), _tpl(h), env)

    def _extra_ca_pem(self) -> bytes:
        return tpl_trust.read_extra_ca(self.ca_bundle)

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
        self._channel(h).call(lambda c: c.set_env(self._env(h, env)))
        h.data["env"] = dict(env)       # placeholders and plain values only (a rollback restores it)

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
    def snapshot_layer(self, h: Handle, dest) -> dict:
        """The whole VM (memory: processes, the writable layer, /workspace) to dest/memory, via
        QMP migration to a file; the VM is stopped while it is written, then runs on."""
        if not self._vm_alive(h):
            raise SandboxError(f"sandbox {h.sandbox_id}: VM is not running")
        dest = Path(dest)
        dest.mkdir(mode=0o700)
        tpl = _tpl(h) or {}
        meta = VmSnapshot(sandbox=h.sandbox_id, assets_hash=assets.Manifest.load(self.assets_dir).hash,
                          qemu=vm.qemu_version(), accel=h.data["accel"], memory_mb=h.data["memory_mb"],
                          cpus=h.data["cpus"], tsc_khz=h.data["tsc_khz"], template=tpl.get("name"),
                          template_key=tpl.get("key"), disk=h.data.get("disk"), disk_id=h.data.get("disk_id"))
        paused = bool(h.data.get("paused"))
        # a restore starts with the host side of the agent port disconnected, as a boot snapshot does
        with self._lock:
            ch = self._channels.pop(h.sandbox_id, None)
        if ch is not None:
            ch.close()
            if not paused:
                time.sleep(RECONNECT_GAP_S)
        t0 = time.monotonic()
        fd = os.open(dest / MEMORY, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with vm.Qmp(h.data["qmp_sock"], timeout=10.0) as q:
                try:
                    vm.save_snapshot_fd(q, fd, SNAPSHOT_TIMEOUT)
                finally:
                    if not paused:
                        q.execute("cont")
        finally:
            os.close(fd)
        meta.save(dest)
        log.info("sandbox %s: snapshot of %.1f MB in %.0f ms", h.sandbox_id, (dest / MEMORY).stat().st_size / 1e6,
                 (time.monotonic() - t0) * 1000)
        return {"template": meta.template, "template_key": meta.template_key, "layer_uid": None}

    def rollback(self, h: Handle, *, seed_layer: str, seed_uid: int | None, seed_template_key: str | None,
                 seed_tokens: dict[str, str], limits) -> Handle:
        """Restore the VM from a snapshot: same id, network and env; the snapshot's memory, so
        its processes run on when it is this sandbox's own snapshot (another's: as a clone)."""
        tpl = _tpl(h)
        spec = SandboxSpec(h.sandbox_id, "", NAME, limits, dict(h.data.get("env", {})), {},
                           template=tpl["name"] if tpl else None, seed_layer=seed_layer, seed_uid=seed_uid,
                           seed_template_key=seed_template_key, seed_tokens=seed_tokens)
        self._seed(spec, self._rootfs(tpl["name"]) if tpl else None)   # refuse before anything stops
        self.destroy(h)                   # the VM goes; the network stays attached
        return self.create(spec, h.netns, ip=h.data["ip"], gateway_ip=h.data["gateway_ip"])

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

    def list(self) -> list[Handle]:
        """A handle for each sandbox with a run dir or cgroups of this instance (e.g. after a
        restart). The handle itself is stored only by the manager, once create returned: these
        carry the run dir and the cgroups found by name, which is what destroy() needs to end
        an interrupted create's QEMU (in them)."""
        cgs = cgroups.SandboxCgroups.by_sandbox(group=self.instance)
        try:
            dirs = {d.name for d in self.state_dir.iterdir() if d.is_dir() and ids.is_sandbox_id(d.name)}
        except OSError:
            dirs = set()
        out = []
        for sid in sorted(dirs | set(cgs)):
            data = {"run_dir": str(self.state_dir / sid)}
            if sid in cgs:
                data["cgroups"] = cgs[sid].to_json()
            out.append(Handle(sandbox_id=sid, backend=NAME, netns="", data=data))
        return out

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

