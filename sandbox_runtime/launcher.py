"""One launcher of a namespace sandbox: `cubegate-agent --parked` (agent.c).

Started as root with its cgroups and its view given (the host paths any sandbox's bwrap
needs: /usr, /proc, /dev, ...). It joins the cgroups, pivots into a mount namespace of its
own that holds only the view, says 'R' on its socket (parked) and waits for exactly one
claim: the netns to enter (an fd), the mount trees this start adds to the view (detached
clones the daemon made of the sandbox's own paths: its root, its /etc, the agent binary),
the host uid to drop to, the argv to exec and the fds that argv names as 3, 4, ... (sent
with SCM_RIGHTS). So a pooled launcher has paid the cgroup migration (an RCU grace period
on cgroup v1) and the copy of the host's mount table before any start needs it, and the
start itself is one sendmsg instead of fork + two execs.

The view is why bwrap's starts do not grow with the host: bwrap re-reads its
/proc/self/mountinfo for every mount it makes, and the host's has one netns per sandbox
and pooled slot and two mounts per template sandbox; in the view it has a dozen lines,
and nothing of any other sandbox is in its sight.

A launcher carries nothing of a sandbox until its claim, and runs at most one: its
socket's other end is only ever in the daemon, so a daemon that dies (or discards it)
leaves it reading EOF, and it exits without running anything.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
from contextlib import suppress
from pathlib import Path

from sandbox_runtime import rlimits

CLAIM_MAX = 65536       # agent.c CLAIM_MAX (one SOCK_SEQPACKET message)
CLAIM_FDS = 16          # agent.c CLAIM_FDS
VIEW_MAX = 64           # agent.c VIEW_MAX
VIEW_ROOT = "/tmp"      # agent.c VIEW_ROOT: where the view is built, never a view path itself
SYS_OPEN_TREE = 428     # the same on every architecture (new syscalls share numbers since 5.1)
OPEN_TREE_CLONE, AT_RECURSIVE, AT_FDCWD = 1, 0x8000, -100
FIRST_FD = 3
# bwrap's pid 1 keeps the environment it was started with (readable inside as
# /proc/1/environ): minimal, the daemon's (vault key!) must never reach it.
LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class LauncherError(RuntimeError):
    pass


def outermost(paths) -> list[str]:
    """The paths none of the others contains (sorted, without duplicates): what a view binds."""
    out: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return sorted(out)


def check_view(view: list[str]) -> None:
    """What agent.c accepts as a view (the static paths and a claim's trees together):
    1..VIEW_MAX clean absolute paths, none under another."""
    if not 1 <= len(view) <= VIEW_MAX:
        raise LauncherError(f"a view of {len(view)} paths (1..{VIEW_MAX})")
    for p in view:
        if not p.startswith("/") or p == "/" or os.path.normpath(p) != p or p.startswith("//") or p == VIEW_ROOT:
            raise LauncherError(f"view path {p!r} is not a clean absolute path")
    if outermost(view) != sorted(view):
        raise LauncherError("view paths are nested or repeated")


def claim_message(uid: int, tree_paths: list[str], argv: list[str]) -> bytes:
    """The claim agent.c parses, NUL-terminated fields: uid, number of trees, where each tree
    goes in the view, argv. (The fds: netns, the trees in that order, the command's.)"""
    if uid <= 0:
        raise LauncherError("a sandbox never runs as host root")
    fields = [str(uid), str(len(tree_paths)), *tree_paths, *argv]
    if not argv or any("\0" in f for f in fields):
        raise LauncherError("malformed claim")
    msg = b"".join(f.encode() + b"\0" for f in fields)
    if len(msg) >= CLAIM_MAX:
        raise LauncherError(f"claim of {len(msg)} bytes exceeds {CLAIM_MAX}")
    return msg


_libc = ctypes.CDLL(None, use_errno=True)


def clone_tree(path: str) -> int:
    """A detached recursive clone of the mount tree at `path` (open_tree(2), no fork): what a
    claim hands a launcher to attach in its view. Closing the fd unattached frees it."""
    fd = _libc.syscall(ctypes.c_long(SYS_OPEN_TREE), ctypes.c_int(AT_FDCWD), os.fsencode(path),
                       ctypes.c_uint(OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise LauncherError(f"cannot clone {path}: {os.strerror(err)}")
    return fd


def fd_numbers(fds: list[int]) -> dict[int, int]:
    """Where each fd lands in the launched command (the argv must name these)."""
    return {fd: FIRST_FD + i for i, fd in enumerate(fds)}


class Launcher:
    """A parked launcher process (a child of the daemon) and the daemon's end of its socket."""

    def __init__(self, agent_binary: Path, procs_files: list[str], view: list[str]):
        """view: the host paths every claim's command sees (check_view; a claim adds trees)."""
        check_view(view)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [str(agent_binary), "--parked", str(theirs.fileno())]
            for f in procs_files:
                argv += ["--cgroup", f]
            for p in view:
                argv += ["--view", p]
            # stderr: a pipe the start reads until the agent answers, then closes (a host file
            # could be filled by the sandbox through /proc/1/fd/2: bwrap's pid 1 keeps it).
            self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         env=dict(LAUNCH_ENV), start_new_session=True, close_fds=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        try:        # before the claim, so nothing of a sandbox ever runs with the daemon's limits
            rlimits.confine(self.proc.pid)
        except OSError as e:
            mine.close()
            self.proc.kill()
            self.proc.wait()
            self.proc.stderr.close()
            raise LauncherError(f"cannot set the sandbox's resource limits: {e}") from None
        self.sock = mine
        self.view = list(view)
        self.claimed = False        # True once the claim went out: the process is the sandbox's
        os.set_blocking(self.proc.stderr.fileno(), False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_parked(self, timeout: float) -> None:
        """Until it is in its cgroups and its view ('R'); LauncherError if it failed or took too long."""
        self.sock.settimeout(timeout)
        try:
            got = self.sock.recv(1)
        except OSError as e:
            raise LauncherError(f"launcher not parked: {e}") from None
        finally:
            self.sock.settimeout(None)
        if got != b"R":
            raise LauncherError(f"launcher exited before it was parked: {self.stderr_tail()}")

    def claim(self, netns_fd: int, uid: int, trees: dict[str, int], argv: list[str], fds: list[int]) -> None:
        """Hand it the sandbox: it enters the netns netns_fd is open on, attaches each tree
        (clone_tree fds) at its path in its view, becomes uid, execs argv with fds as 3, 4, ...
        Close the socket only once it has exec'd (close_socket): a close with its 'R' still
        unread would reset the connection before it read the claim."""
        if self.claimed:
            raise LauncherError("launcher already claimed")     # one sandbox per launcher, ever
        sent = [netns_fd, *trees.values(), *fds]
        if len(sent) > CLAIM_FDS:
            raise LauncherError(f"{len(sent)} fds exceed {CLAIM_FDS}")
        check_view(self.view + list(trees))
        msg = claim_message(uid, list(trees), argv)
        try:
            socket.send_fds(self.sock, [msg], sent)
            self.claimed = True
        except OSError as e:
            raise LauncherError(f"launcher gone: {e}") from None

    def close_socket(self) -> None:
        self.sock.close()

    def stderr_tail(self, keep: int = 2000) -> str:
        buf = b""
        with suppress(OSError, ValueError):
            while chunk := os.read(self.proc.stderr.fileno(), 65536):
                buf = (buf + chunk)[-keep:]
        return buf.decode(errors="replace").strip() or "no output"

    def discard(self) -> None:
        """Never claimed: end it (it has run nothing) and reap it."""
        self.sock.close()
        with suppress(ProcessLookupError):
            self.proc.kill()
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        with suppress(OSError):
            self.proc.stderr.close()
