"""The `namespace` backend: bubblewrap inside the sandbox's cubevs network namespace.

Process chain of one sandbox (one pid until bwrap forks):

  cubegate-agent --parked FD --cgroup <procs>...   (root: setsid, join the cgroups, wait for
      the claim on FD, in a mount namespace holding only the host paths bwrap needs (its view:
      launcher_view); then enter the netns, add this sandbox's paths to the view, drop host
      root to the sandbox uid — launcher.py)
    → bwrap (unprivileged, new user/pid/ipc/uts/cgroup/mount namespaces, seccomp, no caps)
      → pid 1: bwrap's reaper → pid 2: cubegate-agent --listen-fd 3

Choices:
- The launcher joins the cgroups *before* it runs anything of the sandbox, so nothing of
  it ever runs outside its limits (moving the pid after spawn leaves a window where
  bwrap forks). With `launchers` > 0 the launcher is taken parked from a pool
  (launchpool.py), its cgroups renamed to the sandbox's and given its limits before the
  claim: the join (an RCU grace period on cgroup v1) and two execs leave the start path.
- bwrap runs as an unprivileged host uid of its own (uids.sandbox_uid: from the
  sandbox's address, unique among live sandboxes): uid 1000 inside maps to it, so even
  a mount-namespace escape is not host root, and sandboxes share no per-user limits.
- The agent's listening socket is created here on the host and inherited by the agent
  (fd 3): no host directory is visible inside the sandbox, and the sandbox cannot swap
  the socket path for another sandbox's.
- /etc is generated plus a few harmless host files: all but hosts/hostname is one
  shared read-only directory (etcdir.py: one bind instead of 16), those two are memfds
  copied in by bwrap; the root is a read-only tmpfs; /workspace and /tmp are
  size-limited tmpfs.
- No --die-with-parent, own session: sandboxes survive a daemon restart. Handle.data
  keeps the bwrap pid (+ its start time, against pid reuse), cgroup paths and socket.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from contextlib import suppress
from pathlib import Path

from sandbox_runtime import etcdir, ids, phases, ptys, roots, seccomp
from sandbox_runtime.agent.client import AgentClient, AgentError, unix_connector
from sandbox_runtime.backend import ExecResult, Handle, NotSupported, SandboxError, SandboxSpec
from sandbox_runtime.build_agent import BINARY as AGENT_BINARY
from sandbox_runtime.cgroups import SandboxCgroups, detect
from sandbox_runtime.launcher import Launcher, LauncherError, clone_tree, fd_numbers, outermost
from sandbox_runtime.launchpool import LauncherPool
from sandbox_runtime.templates import rootfs as tpl_rootfs
from sandbox_runtime.templates import trust as tpl_trust
from sandbox_runtime.templates.store import TemplateError, TemplateStore
from sandbox_runtime.uids import sandbox_uid

log = logging.getLogger("cubegate.runtime.namespace")

BWRAP = "/usr/bin/bwrap"
NETNS_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
INNER_UID = 1000
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
SANDBOX_CA_PATH = "/etc/ssl/certs/ca-certificates.crt"
AGENT_PATH = "/.cubegate/agent"
START_TIMEOUT_S = 5.0
# Host /etc entries that programs need and that say nothing about the host.
HOST_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "protocols",
            "services", "ssl/openssl.cnf", "mime.types")
USR_MERGED = ("bin", "lib", "lib64", "sbin", "lib32", "libx32")
HOST_ETC_BOUND = ("alternatives",)     # hundreds of symlinks: one bind is cheaper than copying them
SANDBOX_ETC = ("hosts", "hostname")     # the /etc files that name the sandbox: per sandbox
ETC_DIR = "_etc"                        # under roots_dir ('_' is never in a sandbox id)
PTS_DIR = "_pts"                        # under roots_dir: <sandbox id>, a devpts instance while it starts


# ---------------------------------------------------------------- pure parts

def etc_files(sandbox_id: str, gateway_ip: str, ca_pem: bytes) -> dict[str, bytes]:
    """Content of the generated /etc (path under /etc -> bytes)."""
    return {
        "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{INNER_UID}:{INNER_UID}:sandbox:/workspace:/bin/sh\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n".encode(),
        "group": f"root:x:0:\nsandbox:x:{INNER_UID}:\nnogroup:x:65534:\n".encode(),
        "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{sandbox_id}\n".encode(),
        "hostname": f"{sandbox_id}\n".encode(),
        "resolv.conf": f"nameserver {gateway_ip}\noptions timeout:2 attempts:2\n".encode(),
        "nsswitch.conf": b"passwd: files\ngroup: files\nhosts: files dns\n",
        "ssl/certs/ca-certificates.crt": ca_pem,
    }


def base_env(sandbox_id: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": "/workspace", "USER": "sandbox", "LANG": "C.UTF-8", "HOSTNAME": sandbox_id,
        "TMPDIR": "/tmp",
        # the cubegate MITM CA is in this bundle: injected HTTPS must verify
        "SSL_CERT_FILE": SANDBOX_CA_PATH, "CURL_CA_BUNDLE": SANDBOX_CA_PATH,
        "REQUESTS_CA_BUNDLE": SANDBOX_CA_PATH, "NODE_EXTRA_CA_CERTS": SANDBOX_CA_PATH,
    }


def shared_etc(gateway_ip: str, ca_pem: bytes, host: etcdir.Content) -> etcdir.Content:
    """/etc as every sandbox of one gateway sees it: the host entries, the generated files
    but hosts/hostname, and empty placeholders for those (mount points: /etc is read-only)."""
    out: etcdir.Content = dict(host)
    for rel in HOST_ETC_BOUND:          # mount points for what bwrap binds from the host
        out[rel + "/.mountpoint"] = b""
    out.update({rel: data for rel, data in etc_files("-", gateway_ip, ca_pem).items() if rel not in SANDBOX_ETC})
    out.update({rel: b"" for rel in SANDBOX_ETC})
    return out


def bwrap_argv(*, sandbox_id: str, disk_mb: int, seccomp_fd: int, agent_fd: int, listen_fd: int,
               etc_dir_fd: int, etc_fds: dict[str, int], usr_links: dict[str, str],
               env: dict[str, str], pts_dir: str | None = None) -> list[str]:
    """etc_dir_fd: O_PATH fd of the shared /etc (shared_etc); etc_fds: memfds of SANDBOX_ETC;
    pts_dir: the sandbox's own devpts instance (ptys.py), bound over /dev/pts."""
    a = [BWRAP, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
         "--disable-userns", "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", sandbox_id,
         "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for k, v in env.items():
        a += ["--setenv", k, v]
    a += ["--ro-bind", "/usr", "/usr"]
    for name, target in usr_links.items():      # /bin -> usr/bin etc. on usr-merged hosts
        a += ["--symlink", target, f"/{name}"]
    for name in USR_MERGED:
        if name not in usr_links and Path(f"/{name}").is_dir():
            a += ["--ro-bind", f"/{name}", f"/{name}"]
    a += ["--proc", "/proc", "--dev", "/dev", *_own_pts(pts_dir),
          "--size", str(disk_mb << 20), "--tmpfs", "/workspace",
          "--size", str(disk_mb << 20), "--tmpfs", "/tmp",
          "--ro-bind-fd", str(etc_dir_fd), "/etc", "--dir", "/run",
          "--symlink", "/workspace", "/home/user"]   # a writable home for E2B's default user
    for rel in HOST_ETC_BOUND:
        if os.path.isdir(f"/etc/{rel}"):
            a += ["--ro-bind", f"/etc/{rel}", f"/etc/{rel}"]
    for rel, fd in etc_fds.items():
        a += ["--perms", "0644", "--ro-bind-data", str(fd), f"/etc/{rel}"]
    a += ["--dir", "/.cubegate", "--ro-bind-fd", str(agent_fd), AGENT_PATH,
          "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--chdir", "/workspace",
          AGENT_PATH, "--listen-fd", str(listen_fd)]
    return a


def _own_pts(pts_dir: str | None) -> list[str]:
    return ["--dev-bind", pts_dir, "/dev/pts"] if pts_dir else []


def bwrap_template_argv(*, sandbox_id: str, root_fds: dict[str, int], disk_mb: int, seccomp_fd: int,
                        agent_fd: int, listen_fd: int, env: dict[str, str], pts_dir: str | None = None) -> list[str]:
    """Like bwrap_argv, but / is the template overlay (rootfs.py): /etc and the trust files
    are already in its upper layer; / is read-only, /workspace and /tmp (the sandbox's part
    of the writable layer) are separate read-write binds. The overlay is passed as O_PATH
    fds ({"/": fd, "/workspace": fd, "/tmp": fd}): the sandbox's uid need not reach the
    (0700) state directory."""
    a = [BWRAP, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
         "--disable-userns", "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", sandbox_id,
         "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for k, v in env.items():
        a += ["--setenv", k, v]
    for dest in ("/", "/workspace", "/tmp"):
        a += ["--bind-fd", str(root_fds[dest]), dest]
    a += ["--proc", "/proc", "--dev", "/dev", *_own_pts(pts_dir), "--size", str(disk_mb << 20), "--tmpfs", "/dev/shm",
          "--ro-bind-fd", str(agent_fd), AGENT_PATH,
          "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--chdir", "/workspace",
          AGENT_PATH, "--listen-fd", str(listen_fd)]
    return a


# The bwrap options bwrap_argv and bwrap_template_argv use, and how many arguments each takes
# (launcher_view reads the host paths out of an argv: an option missing here is an error).
BWRAP_ARITY = {
    **dict.fromkeys(("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                     "--disable-userns", "--new-session", "--clearenv"), 0),
    **dict.fromkeys(("--uid", "--gid", "--hostname", "--cap-drop", "--chdir", "--seccomp", "--size", "--tmpfs",
                     "--proc", "--dev", "--dir", "--remount-ro", "--perms"), 1),
    **dict.fromkeys(("--setenv", "--symlink", "--ro-bind", "--bind", "--dev-bind", "--ro-bind-try", "--bind-try",
                     "--dev-bind-try", "--ro-bind-fd", "--bind-fd", "--ro-bind-data"), 2),
}
BWRAP_HOST_SOURCES = ("--ro-bind", "--bind", "--dev-bind", "--ro-bind-try", "--bind-try", "--dev-bind-try")
# What bwrap reads of the host besides its binds: its binary and libraries (the loader is
# /lib64/... on usr-merged hosts: the links come along), /proc, /dev (--dev binds its nodes).
BWRAP_OWN = ("/usr", *(f"/{n}" for n in USR_MERGED), "/etc/ld.so.cache", "/proc", "/dev")


def launcher_view(argv: list[str], fd_paths: list[str]) -> list[str]:
    """The host paths a sandbox's bwrap needs, the only ones its launcher keeps in sight
    (launcher.py): BWRAP_OWN, the sources of argv's binds, and the paths of the fds it gets
    (its --*-fd sources). A path that is a link brings its target."""
    sources = []
    i = 1
    while i < len(argv) and argv[i].startswith("--"):
        n = BWRAP_ARITY.get(argv[i])
        if n is None or i + n >= len(argv):
            raise SandboxError(f"launcher_view: unknown bwrap option {argv[i]!r}")
        if argv[i] in BWRAP_HOST_SOURCES:
            sources.append((os.path.normpath(argv[i + 1]), argv[i].endswith("-try")))
        i += n + 1
    return list(_view(argv[0], tuple(sources), tuple(fd_paths)))


def static_view() -> list[str]:
    """The part of every sandbox's view a launcher can hold before its claim: all but the
    fds' paths (the sandbox's root, its /etc, the agent binary: cloned per start)."""
    return list(_view(BWRAP, tuple((f"/etc/{rel}", True) for rel in HOST_ETC_BOUND), ()))


def view_additions(view: list[str], static: list[str]) -> list[str]:
    """The paths of `view` that a launcher parked with `static` must be handed (clone_tree)."""
    inside = lambda p, d: p == d or p.startswith(d + "/")      # noqa: E731
    for d in static:
        for p in view:
            if inside(d, p) and d != p:
                raise SandboxError(f"view path {p} contains the static {d}")
    return [p for p in view if not any(inside(p, d) for d in static)]


@functools.lru_cache(maxsize=64)
def _view(bwrap: str, sources: tuple[tuple[str, bool], ...], fd_paths: tuple[str, ...]) -> tuple[str, ...]:
    """launcher_view's file system part: the same for every start of a template-less sandbox
    (remembered: ~0.25 ms of lstat per start otherwise). A path that moves later fails
    that start (bwrap: no such source), it never widens the view."""
    paths = [p for p in BWRAP_OWN if os.path.lexists(p)] + [bwrap] + [os.path.realpath(p) for p in fd_paths]
    paths += [p for p, optional in sources if not optional or os.path.lexists(p)]
    out = []
    for p in paths:
        out.append(p)
        real = os.path.realpath(p)
        if real != p:
            out.append(real)
    return tuple(outermost(out))


def _usr_links() -> dict[str, str]:
    out = {}
    for name in USR_MERGED:
        p = Path(f"/{name}")
        if p.is_symlink():
            out[name] = os.readlink(p)
    return out


# ---------------------------------------------------------------- process helpers

def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: identifies the process across pid reuse."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw.rsplit(")", 1)[1].split()[19])


def _same_process(pid: int | None, start: int | None) -> bool:
    return bool(pid) and start is not None and _start_time(pid) == start


def _children_of(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _wait_gone(pids: set[int], timeout: float) -> None:
    """Wait (bounded) until killed tasks are reaped: orphans go to the host's init."""
    deadline = time.monotonic() + timeout
    left = set(pids)
    while left and time.monotonic() < deadline:
        left = {p for p in left if Path(f"/proc/{p}").exists()}
        if left:
            time.sleep(0.005)


def _save_handle(sdir: Path, h: Handle) -> None:
    tmp = sdir / "handle.json.tmp"
    tmp.write_text(json.dumps({"sandbox_id": h.sandbox_id, "netns": h.netns, "data": h.data}))
    tmp.replace(sdir / "handle.json")


def _record_pid(h: Handle, launcher: Launcher) -> None:
    """The launcher's pid is bwrap's once claimed (it execs bwrap): destroy kills by it."""
    h.data["bwrap_pid"] = launcher.pid
    h.data["bwrap_start"] = _start_time(launcher.pid)


def _drain_tail(pipe, buf: bytearray, keep: int = 2000) -> bool:
    """Read what the (non-blocking) pipe has, keep only the last `keep` bytes. True at EOF."""
    while True:
        try:
            chunk = os.read(pipe.fileno(), 65536)
        except (BlockingIOError, InterruptedError):
            return False
        if not chunk:
            return True
        buf += chunk
        del buf[:-keep]


def _text(buf: bytearray) -> str:
    return bytes(buf).decode(errors="replace").strip()


class NamespaceBackend:
    name = "namespace"

    def __init__(self, state_dir: Path, ca_bundle: Path | None = None, *, host_uid: int | None = None,
                 agent_binary: Path = AGENT_BINARY, start_timeout: float = START_TIMEOUT_S,
                 templates: TemplateStore | None = None, roots_dir: Path | None = None, launchers: int = 0):
        """launchers: parked launchers kept ready (launchpool.py; 0: each start spawns its own)."""
        self.state_dir = Path(state_dir)
        self.instance = ids.instance_name(self.state_dir)   # host-wide names are per runtime instance
        # template overlays: <roots_dir>/<sandbox id>/{rw,root}
        self.roots_dir = Path(roots_dir) if roots_dir else tpl_rootfs.ROOTS_DIR / self.instance
        self._roots_lock = self._claim_roots(prune=roots_dir is None)
        self.templates = templates      # None: only template-less sandboxes (the host's /usr)
        self.ca_bundle = Path(ca_bundle) if ca_bundle else None
        self.host_uid = host_uid    # None: one uid per sandbox (uids.sandbox_uid)
        self.agent_binary = Path(agent_binary)
        self.start_timeout = start_timeout
        self._children: dict[str, subprocess.Popen] = {}   # reaped on destroy (zombies otherwise)
        self._seccomp = seccomp.build_filter()
        self._etc_dirs: dict[str, tuple[tuple, Path]] = {}    # gateway ip -> (source signature, dir)
        self._etc_lock = threading.Lock()
        self._usr_links = _usr_links()
        self._view = static_view()     # what every launcher holds while parked (launcher.py)
        self.launchers = LauncherPool(self.agent_binary, self.instance, launchers, self._view) if launchers > 0 else None
        self._launchers_started = False

    def _claim_roots(self, *, prune: bool):
        """Mark our roots dir live and remove those of dead instances (only under the host-wide
        default: a caller's own roots_dir has no siblings of ours)."""
        if os.geteuid() != 0:
            return None                 # not usable without root anyway (available() says why)
        try:
            lock = roots.claim(self.roots_dir, self.state_dir)
            if prune:
                roots.prune_orphans(self.roots_dir.parent, keep=self.roots_dir)
            return lock
        except OSError as e:
            log.warning("namespace: roots dir %s: %s", self.roots_dir, e)
            return None

    def close(self) -> None:
        """Daemon shutdown: sandboxes keep running (the next daemon adopts them); with none
        left, this instance's roots dir is removed."""
        if self.launchers is not None:
            self.launchers.stop()       # unclaimed launchers end, their cgroups go
        lock, self._roots_lock = self._roots_lock, None
        if lock is not None:
            # a stored handle is a sandbox that may use it; what a killed create left without
            # one is not mounted there (release checks) and the next daemon's recover reaps it
            left = any(self.state_dir.glob("*/handle.json"))
            roots.release(self.roots_dir, lock, sandboxes_left=left)

    # ------------------------------------------------------------ probing
    def available(self) -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "the namespace backend needs root (cgroups, netns)"
        if not os.access(BWRAP, os.X_OK):
            return False, f"{BWRAP} not found (apt: bubblewrap)"
        if not self.agent_binary.exists():
            return False, "agent binary missing: run python -m sandbox_runtime.build_agent"
        ok, why = seccomp.supported()
        if not ok:
            return False, why
        version, why = detect()
        if version is None:
            return False, why
        return True, ""

    # ------------------------------------------------------------ lifecycle
    def create(self, spec: SandboxSpec, netns: str, *, ip: str, gateway_ip: str) -> Handle:
        sid = spec.sandbox_id
        if not ids.is_sandbox_id(sid):
            raise SandboxError(f"invalid sandbox id {sid!r}")
        if not NETNS_RE.match(netns) or not Path(f"/run/netns/{netns}").exists():
            raise SandboxError(f"network namespace {netns!r} does not exist")
        ok, why = self.available()
        if not ok:
            raise SandboxError(why)
        files = {self._workspace_path(rel): content for rel, content in spec.files.items()}   # refuse early
        tpl = self._template(spec.template) if spec.template else None
        sdir = self.state_dir / sid
        if len(str(sdir / "agent.sock").encode()) > 107:
            raise SandboxError(f"state dir path too long for a unix socket: {self.state_dir}")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            sdir.mkdir(mode=0o700)
        except FileExistsError:
            raise SandboxError(f"sandbox {sid} already exists") from None
        h = Handle(sandbox_id=sid, backend=self.name, netns=netns,
                   data={"state_dir": str(sdir), "socket": str(sdir / "agent.sock"),
                         "host_uid": self.host_uid if self.host_uid is not None else sandbox_uid(ip),
                         "ip": ip, "gateway_ip": gateway_ip, "env": dict(spec.env)})   # for rollback
        if tpl is not None and spec.seed_template_key is not None and spec.seed_template_key != tpl.key:
            shutil.rmtree(sdir, ignore_errors=True)
            raise SandboxError(f"template {tpl.name!r} was rebuilt since the snapshot was taken "
                               "(its layer belongs to the old build)")
        if tpl is not None:
            h.data["template"] = {"name": tpl.name, "key": tpl.key, "env": tpl.env, "tools": tpl.tools,
                                  "lower": str(tpl.rootfs)}
        cg = launcher = None
        pooled = self.launchers.take() if self.launchers is not None else None
        try:
            with phases.phase("cgroups"):
                cg, launcher = self._confine(sid, spec, pooled)
            h.data["cgroups"] = cg.to_json()
            if launcher is not None:    # pooled: its pid is known now, one handle write suffices
                _record_pid(h, launcher)
            # Written before anything runs (and again with the pid when the launcher is spawned
            # only in _spawn): if the daemon dies mid-create, list() still finds what to reap
            # (Manager.recover destroys handles without a record).
            with phases.phase("handle"), self._etc_lock:
                if tpl is None:     # the shared /etc it will use is on disk before it is used (_prune_etc)
                    h.data["etc_dir"] = str(self._shared_etc_dir(gateway_ip))
                _save_handle(sdir, h)
            self._spawn(h, spec, cg, gateway_ip, launcher)
            launcher = None     # the sandbox's now: destroy ends it
            client = self._client(h)      # the agent has its environment already (_wait_ready)
            self._run_trust_script(h, client)
            for path, content in files.items():
                client.write_file(path, content)
            return h
        except SandboxError:
            self._undo_create(h, launcher)
            raise
        except Exception as e:      # OSError and friends: still clean up, report as SandboxError
            self._undo_create(h, launcher)
            raise SandboxError(f"sandbox start failed: {type(e).__name__}: {e}") from e
        except BaseException:
            self._undo_create(h, launcher)
            raise
        finally:
            if self.launchers is not None:
                self.launchers.start_done()

    def _confine(self, sid: str, spec: SandboxSpec, pooled) -> tuple[SandboxCgroups, Launcher | None]:
        """The sandbox's cgroups, with its limits: a pooled launcher's, renamed to the sandbox
        (the launcher is in them already), or new ones (the launcher is spawned into them)."""
        if pooled is not None:
            try:
                cg = pooled.cgroups.renamed(sid)
            except SandboxError as e:
                log.warning("namespace: pooled launcher unusable (%s); spawning one", e)
                pooled.discard()
            else:
                try:
                    cg.set_limits(spec.limits)
                except OSError as e:
                    pooled.launcher.discard()
                    cg.kill_all()
                    cg.remove()
                    raise SandboxError(f"cgroup setup failed: {e}") from None
                return cg, pooled.launcher
        return SandboxCgroups.create(sid, spec.limits, group=self.instance), None

    def _undo_create(self, h: Handle, launcher: Launcher | None) -> None:
        if launcher is not None and not launcher.claimed:
            launcher.discard()      # claimed by nobody: it ran nothing
        self.destroy(h)

    @staticmethod
    def _workspace_path(rel: str) -> str:
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if not parts or ".." in parts:
            raise SandboxError(f"invalid file path {rel!r} (relative to /workspace, no '..')")
        return "/workspace/" + "/".join(parts)

    def _template(self, name: str):
        if self.templates is None:
            raise SandboxError("templates are not configured for this backend")
        try:
            return self.templates.resolve(name)
        except TemplateError as e:
            raise SandboxError(str(e)) from None

    def _base_env(self, h: Handle, env: dict[str, str]) -> dict[str, str]:
        return tpl_trust.sandbox_env(base_env(h.sandbox_id), h.data.get("template"), env)

    def _extra_ca_pem(self) -> bytes:
        return tpl_trust.read_extra_ca(self.ca_bundle)

    def _run_trust_script(self, h: Handle, client: AgentClient) -> None:
        """NSS / Java stores live in the sandbox's $HOME: made by the sandbox user, after start."""
        tpl = h.data.get("template")
        if not tpl:
            return
        script = tpl_trust.trust_script(tpl["tools"], len(tpl_trust.split_pem(self._extra_ca_pem())))
        if script is None:
            return
        r = client.exec(["sh", "-c", script], timeout=20.0)
        if r.exit_code != 0:
            raise SandboxError(f"trusting the gateway CA failed (exit {r.exit_code}): "
                               f"{r.stderr.decode(errors='replace')[-300:]}")

    def _template_root(self, h: Handle, spec: SandboxSpec, gateway_ip: str) -> str:
        """Mount the template overlay with /etc and the trust files in its writable layer."""
        tpl, sdir = h.data["template"], Path(h.data["state_dir"])
        mdir = self.roots_dir / h.sandbox_id
        lower = Path(tpl["lower"])
        try:
            tpl_bundle = (lower / "etc/ssl/certs/ca-certificates.crt").read_bytes()
        except OSError:
            tpl_bundle = b""
        files = {"/etc/" + rel: data for rel, data in etc_files(h.sandbox_id, gateway_ip, b"").items()}
        files.update(tpl_trust.trust_files(tpl_bundle, self._extra_ca_pem()))
        h.data["rootfs"] = str(mdir)
        _save_handle(sdir, h)     # a crash from here on still finds the mounts to release
        try:
            return str(tpl_rootfs.prepare(mdir, lower, disk_mb=spec.limits.disk_mb, uid=h.data["host_uid"],
                                          files=files, seed_upper=Path(spec.seed_layer) if spec.seed_layer else None,
                                          seed_uid=spec.seed_uid, seed_tokens=spec.seed_tokens))
        except tpl_rootfs.RootfsError as e:
            raise SandboxError(str(e)) from None

    def layer_dir(self, h: Handle) -> Path | None:
        """The sandbox's writable layer (template sandboxes only): what a snapshot copies."""
        return tpl_rootfs.upper_dir(Path(h.data["rootfs"])) if h.data.get("rootfs") else None

    def _ca_pem(self) -> bytes:
        pem = HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.exists() else b""
        if self.ca_bundle:
            try:
                extra = self.ca_bundle.read_bytes()
            except OSError as e:
                raise SandboxError(f"cannot read CA bundle: {e.strerror}") from None
            pem = pem + (b"" if pem.endswith(b"\n") or not pem else b"\n") + extra
        return pem

    def prepare(self, gateway_ip: str) -> None:
        """Build the shared /etc ahead of the first start; start filling the launcher pool."""
        with self._etc_lock:
            self._shared_etc_dir(gateway_ip)
            if self.launchers is not None and not self._launchers_started:
                self._launchers_started = True
                self.launchers.start()

    def _shared_etc_dir(self, gateway_ip: str) -> Path:
        """The shared /etc for this gateway, rebuilt only when a source changed (etcdir.signature)."""
        copied = tuple(rel for rel in HOST_ETC if rel not in HOST_ETC_BOUND)
        sources = [Path("/etc") / rel for rel in copied] + [HOST_CA_BUNDLE] + \
            ([self.ca_bundle] if self.ca_bundle else [])
        sig = (gateway_ip, etcdir.signature(sources))
        cached = self._etc_dirs.get(gateway_ip)
        if cached is not None and cached[0] == sig and cached[1].is_dir():
            return cached[1]
        content = shared_etc(gateway_ip, self._ca_pem(), etcdir.read_host_entries(copied))
        # under roots_dir (0711): bwrap, already the sandbox's uid, resolves the fd's path and
        # must be able to traverse to it; the state dir is not reachable for it
        self.roots_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.roots_dir, 0o711)
        d = etcdir.ensure(self.roots_dir / ETC_DIR, content, mode=0o711)
        self._etc_dirs[gateway_ip] = (sig, d)
        self._prune_etc()
        return d

    def _prune_etc(self) -> None:
        """Shared /etc builds that no sandbox of this instance uses and that are not current
        (a CA bundle or host file changed since): removed. Under _etc_lock, like the step that
        records a build in a new sandbox's handle."""
        root = self.roots_dir / ETC_DIR
        if not root.is_dir():
            return
        keep = {str(d) for _sig, d in self._etc_dirs.values()}
        keep |= {h.data.get("etc_dir") for h in self.list()}
        for d in root.iterdir():
            if str(d) not in keep and not d.name.startswith("."):
                shutil.rmtree(d, ignore_errors=True)

    def _spawn(self, h: Handle, spec: SandboxSpec, cg: SandboxCgroups, gateway_ip: str,
               launcher: Launcher | None) -> None:
        """Claim the launcher (spawned now into cg when none was pooled) with bwrap's argv."""
        sid = h.sandbox_id
        fds: list[int] = []        # in the order the command gets them: 3, 4, ...
        pts_dir = self.roots_dir / PTS_DIR / sid
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(h.data["socket"])
            listener.listen(128)
            fds.append(listener.fileno())

            def memfd(name: str, data: bytes) -> int:
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                fds.append(fd)
                _write_all(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
                return fd

            fd_paths: list[str] = []        # what the fds name on the host: bwrap resolves them

            def opened(path: str, flags: int) -> int:
                fds.append(os.open(path, flags | os.O_CLOEXEC))
                fd_paths.append(path)
                return fds[-1]

            seccomp_fd = memfd("seccomp", self._seccomp)
            agent_fd = opened(str(self.agent_binary), os.O_PATH)
            try:
                ptys.mount_instance(pts_dir)
            except OSError as e:
                raise SandboxError(f"sandbox start failed: {e}") from None
            if h.data.get("template"):
                root = self._template_root(h, spec, gateway_ip)
                root_fds = {dest: opened(root + dest, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
                            for dest in ("/", "/workspace", "/tmp")}
                n = fd_numbers(fds)
                argv = bwrap_template_argv(sandbox_id=sid, root_fds={d: n[fd] for d, fd in root_fds.items()},
                                           disk_mb=spec.limits.disk_mb, seccomp_fd=n[seccomp_fd],
                                           agent_fd=n[agent_fd], listen_fd=n[listener.fileno()],
                                           env=self._base_env(h, {}), pts_dir=str(pts_dir))
            else:
                etc_dir_fd = opened(h.data["etc_dir"], os.O_PATH | os.O_DIRECTORY)
                mine = etc_files(sid, gateway_ip, b"")
                etc_fds = {rel: memfd(rel, mine[rel]) for rel in SANDBOX_ETC}
                n = fd_numbers(fds)
                argv = bwrap_argv(sandbox_id=sid, disk_mb=spec.limits.disk_mb, seccomp_fd=n[seccomp_fd],
                                  agent_fd=n[agent_fd], listen_fd=n[listener.fileno()], etc_dir_fd=n[etc_dir_fd],
                                  etc_fds={rel: n[fd] for rel, fd in etc_fds.items()},
                                  usr_links=self._usr_links, env=base_env(sid), pts_dir=str(pts_dir))
            added = view_additions(launcher_view(argv, fd_paths), self._view)
            t0 = time.monotonic()
            with phases.phase("spawn"):
                if launcher is None:
                    launcher = Launcher(self.agent_binary, cg.procs_files(), self._view)
                    _record_pid(h, launcher)
                    with phases.phase("handle"):
                        _save_handle(Path(h.data["state_dir"]), h)
                self._children[sid] = launcher.proc
                held: list[int] = []    # the netns and the trees: the launcher has its own copies
                try:
                    held.append(os.open(f"/run/netns/{h.netns}", os.O_RDONLY | os.O_CLOEXEC))
                    trees = {}
                    for p in added:
                        trees[p] = clone_tree(p)
                        held.append(trees[p])
                    launcher.claim(held[0], h.data["host_uid"], trees, argv, fds)
                except (LauncherError, OSError) as e:
                    launcher.discard()      # it ran nothing
                    raise SandboxError(f"sandbox start failed: {e}") from None
                finally:
                    for fd in held:
                        os.close(fd)
        finally:
            listener.close()    # the agent holds the only listening copy now
            ptys.release(pts_dir)   # the launcher got its clone with the claim
            for fd in fds[1:]:
                with suppress(OSError):
                    os.close(fd)
        proc = launcher.proc
        try:
            with phases.phase("agent_ready"):
                self._wait_ready(h, proc, self._base_env(h, spec.env))
        finally:
            launcher.close_socket()     # it has exec'd (or failed): nothing more goes to it
            proc.stderr.close()
        h.data["start_latency_s"] = round(time.monotonic() - t0, 4)

    def _wait_ready(self, h: Handle, proc: subprocess.Popen, env: dict[str, str]) -> None:
        """Until the agent has taken the sandbox's environment (its first request); fail fast
        (with bwrap's stderr) if bwrap exits."""
        err = bytearray()

        def starting() -> bool:
            if _drain_tail(proc.stderr, err):       # EOF: what held the pipe has exited or is exiting
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.25)
            return proc.poll() is None
        try:
            self._client(h).set_env_when_up(env, self.start_timeout, starting, proc.stderr.fileno())
        except AgentError as e:
            with suppress(subprocess.TimeoutExpired):   # a reset connection: the listener's holder died
                proc.wait(timeout=0.5)
            _drain_tail(proc.stderr, err)
            if proc.poll() is not None:
                raise SandboxError(f"sandbox exited during start (code {proc.returncode}): "
                                   f"{_text(err) or 'no output'}") from None
            raise SandboxError(f"agent did not answer within {self.start_timeout:.0f}s ({e}); "
                               f"bwrap: {_text(err) or 'no output'}") from None

    def _client(self, h: Handle) -> AgentClient:
        return AgentClient(unix_connector(h.data["socket"]))

    def _cg(self, h: Handle) -> SandboxCgroups | None:
        d = h.data.get("cgroups")
        return SandboxCgroups.from_json(d) if d else None

    # ------------------------------------------------------------ operations
    def exec(self, h: Handle, argv: list[str], *, timeout: float = 30.0, env: dict[str, str] | None = None,
             stdin: bytes = b"", cwd: str = "/workspace", on_output=None) -> ExecResult:
        return self._client(h).exec(argv, timeout=timeout, env=env, stdin=stdin, cwd=cwd, on_output=on_output)

    def write_file(self, h: Handle, path: str, data: bytes, mode: int = 0o644) -> None:
        self._client(h).write_file(path, data, mode)

    def read_file(self, h: Handle, path: str, max_bytes: int = 16 << 20) -> bytes:
        return self._client(h).read_file(path, max_bytes)

    def agent_call(self, h: Handle, fn):
        """fn(AgentClient) for requests beyond exec/files (agent 2: streams, signals, fs)."""
        return fn(self._client(h))

    def set_env(self, h: Handle, env: dict[str, str]) -> None:
        self._client(h).set_env(self._base_env(h, env))
        h.data["env"] = dict(env)       # placeholders and plain values only (the manager checked them)
        _save_handle(Path(h.data["state_dir"]), h)

    # ------------------------------------------------------------ snapshots
    def snapshot_layer(self, h: Handle, dest: Path) -> dict:
        layer = self.layer_dir(h)
        if layer is None:
            raise NotSupported("snapshots of namespace sandboxes copy their template's writable layer; this "
                               "sandbox runs on the host's /usr (create it with a template)")
        cg = self._cg(h)
        if cg is None or not cg.can_freeze():
            raise NotSupported("no freezer cgroup on this host: a consistent copy is not possible")
        was_frozen = cg.frozen()
        cg.freeze()                       # a point-in-time copy: nothing writes while it is taken
        try:
            tpl_rootfs.copy_layer(layer, dest, from_uid=None, to_uid=h.data["host_uid"])
        except tpl_rootfs.RootfsError as e:
            raise SandboxError(str(e)) from None
        finally:
            if not was_frozen:
                cg.thaw()
        tpl = h.data["template"]
        return {"template": tpl["name"], "template_key": tpl["key"], "layer_uid": h.data["host_uid"]}

    def rollback(self, h: Handle, *, seed_layer: str, seed_uid: int | None, seed_template_key: str | None,
                 seed_tokens: dict[str, str], limits) -> Handle:
        tpl = h.data.get("template")
        if not tpl or "ip" not in h.data:
            raise NotSupported("rollback needs a template sandbox (its writable layer is what is restored)")
        if seed_template_key is not None and self._template(tpl["name"]).key != seed_template_key:
            raise SandboxError(f"template {tpl['name']!r} was rebuilt since the snapshot was taken "
                               "(its layer belongs to the old build)")
        spec = SandboxSpec(h.sandbox_id, "", self.name, limits, dict(h.data.get("env", {})), {},
                           template=tpl["name"], seed_layer=seed_layer, seed_uid=seed_uid,
                           seed_template_key=seed_template_key, seed_tokens=seed_tokens)
        self.destroy(h)                   # processes and the old layer go; the network stays attached
        return self.create(spec, h.netns, ip=h.data["ip"], gateway_ip=h.data["gateway_ip"])

    def pause(self, h: Handle) -> None:
        cg = self._cg(h)
        if cg is None or not cg.can_freeze():
            raise NotSupported("no freezer cgroup on this host")
        cg.freeze()

    def resume(self, h: Handle) -> None:
        cg = self._cg(h)
        if cg is None or not cg.can_freeze():
            raise NotSupported("no freezer cgroup on this host")
        cg.thaw()

    def alive(self, h: Handle) -> bool:
        if not _same_process(h.data.get("bwrap_pid"), h.data.get("bwrap_start")):
            return False
        try:
            self._client(h).ping(timeout=2.0)
            return True
        except AgentError:
            return False

    def usage(self, h: Handle) -> dict:
        cg = self._cg(h)
        if cg is None:
            return {"memory_bytes": 0, "cpu_seconds": 0.0, "pids": 0}
        return cg.usage()

    def destroy(self, h: Handle) -> None:
        cg = self._cg(h)
        pid, start = h.data.get("bwrap_pid"), h.data.get("bwrap_start")
        proc = self._children.pop(h.sandbox_id, None)
        if _same_process(pid, start):
            # SIGKILL to the sandbox's pid 1 makes the kernel kill its whole pid namespace
            # (no fork race), and bwrap, still alive, reaps it and exits: no orphan zombies.
            for child in _children_of(pid):
                with suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            if cg is not None and cg.can_freeze() and cg.frozen():
                with suppress(OSError, SandboxError):
                    cg.thaw()       # a paused sandbox: the killed tasks die only once thawed
            self._wait_exit(pid, start, proc, timeout=2.0)
        # whatever is left in the cgroups (bwrap itself if it hung, anything that escaped)
        killed = cg.kill_all() if cg is not None else set()
        if _same_process(pid, start):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._wait_exit(pid, start, proc, timeout=5.0)
        _wait_gone(killed, timeout=1.0)
        if cg is not None and not cg.remove():
            cg.kill_all()        # last resort: something appeared between kill and rmdir
            cg.remove()
        sdir = h.data.get("state_dir")
        if h.data.get("rootfs"):
            try:
                tpl_rootfs.release(Path(h.data["rootfs"]))
            except tpl_rootfs.RootfsError as e:   # never delete files under a live mount
                raise SandboxError(f"sandbox {h.sandbox_id}: {e}") from None
        if sdir and Path(sdir).parent == self.state_dir:
            shutil.rmtree(sdir, ignore_errors=True)

    @staticmethod
    def _wait_exit(pid: int | None, start: int | None, proc: subprocess.Popen | None, timeout: float) -> None:
        if proc is not None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
            return
        deadline = time.monotonic() + timeout
        while pid and _same_process(pid, start) and time.monotonic() < deadline:
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)    # ours when this instance's process created it
            if _state(pid) == "Z":
                return                          # dead; reaping is its parent's job
            time.sleep(0.005)

    def list(self) -> list[Handle]:
        """Handles of the sandboxes that have anything of this instance on the host (e.g.
        after a restart): a state dir, cgroups or a roots dir. Without a readable handle.json
        (a create killed before its first handle write) a partial handle names what is there,
        so destroy() still removes what that create had made."""
        cgs = SandboxCgroups.by_sandbox(group=self.instance)
        found = set(cgs) | _sandbox_dirs(self.state_dir) | _sandbox_dirs(self.roots_dir)
        out = []
        for sid in sorted(found):
            try:
                d = json.loads((self.state_dir / sid / "handle.json").read_text())
                out.append(Handle(sandbox_id=d["sandbox_id"], backend=self.name, netns=d["netns"], data=d["data"]))
            except (OSError, ValueError, KeyError, TypeError):
                out.append(self._partial_handle(sid, cgs.get(sid)))
        return out

    def _partial_handle(self, sid: str, cg: SandboxCgroups | None) -> Handle:
        data: dict = {"state_dir": str(self.state_dir / sid)}
        if cg is not None:
            data["cgroups"] = cg.to_json()
        if (self.roots_dir / sid).exists():
            data["rootfs"] = str(self.roots_dir / sid)    # released (unmounted) before removal
        return Handle(sandbox_id=sid, backend=self.name, netns="", data=data)


def _sandbox_dirs(parent: Path) -> set[str]:
    try:
        return {d.name for d in parent.iterdir() if d.is_dir() and ids.is_sandbox_id(d.name)}
    except OSError:
        return set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
