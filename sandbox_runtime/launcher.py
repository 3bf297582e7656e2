"""One launcher of a namespace sandbox: `cubegate-agent --parked` (agent.c).

Started as root with its cgroups given; it joins them, says 'R' on its socket (parked)
and waits for exactly one claim: the netns to enter, the host paths the command needs
(its view), the host uid to drop to, the argv to exec and the fds that argv names as
3, 4, ... (sent with SCM_RIGHTS). Before the exec it pivots into a mount namespace of
its own that holds only the view: bwrap re-reads its mountinfo for every mount it
makes, so that table stays short whatever the host has mounted (one netns per sandbox
and pooled slot, every template sandbox's root), and none of it is in its sight. So a pooled
launcher has paid the cgroup migration (an RCU grace period on cgroup v1) before any
start needs it, and the start itself is one sendmsg instead of fork + two execs.

A launcher carries nothing of a sandbox until its claim, and runs at most one: its
socket's other end is only ever in the daemon, so a daemon that dies (or discards it)
leaves it reading EOF, and it exits without running anything.
"""
from __future__ import annotations

import os
import socket
import subprocess
from contextlib import suppress
from pathlib import Path

CLAIM_MAX = 65536       # agent.c CLAIM_MAX (one SOCK_SEQPACKET message)
CLAIM_FDS = 16          # agent.c CLAIM_FDS
VIEW_MAX = 64           # agent.c VIEW_MAX
VIEW_ROOT = "/tmp"      # agent.c VIEW_ROOT: where the view is built, never a view path itself
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
    """What agent.c's small_view() accepts: 1..VIEW_MAX clean absolute paths, none nested."""
    if not 1 <= len(view) <= VIEW_MAX:
        raise LauncherError(f"a view of {len(view)} paths (1..{VIEW_MAX})")
    for p in view:
        if not p.startswith("/") or p == "/" or os.path.normpath(p) != p or p.startswith("//") or p == VIEW_ROOT:
            raise LauncherError(f"view path {p!r} is not a clean absolute path")
    if outermost(view) != sorted(view):
        raise LauncherError("view paths are nested or repeated")


def claim_message(netns_path: str, uid: int, view: list[str], argv: list[str]) -> bytes:
    """The claim agent.c parses, NUL-terminated fields: netns path, uid, number of view paths,
    the view paths (the only host paths the command will see), argv."""
    if uid <= 0:
        raise LauncherError("a sandbox never runs as host root")
    fields = [netns_path, str(uid), str(len(view)), *view, *argv]
    if not argv or any("\0" in f for f in fields):
        raise LauncherError("malformed claim")
    check_view(view)
    msg = b"".join(f.encode() + b"\0" for f in fields)
    if len(msg) >= CLAIM_MAX:
        raise LauncherError(f"claim of {len(msg)} bytes exceeds {CLAIM_MAX}")
    return msg


def fd_numbers(fds: list[int]) -> dict[int, int]:
    """Where each fd lands in the launched command (the argv must name these)."""
    return {fd: FIRST_FD + i for i, fd in enumerate(fds)}


class Launcher:
    """A parked launcher process (a child of the daemon) and the daemon's end of its socket."""

    def __init__(self, agent_binary: Path, procs_files: list[str]):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [str(agent_binary), "--parked", str(theirs.fileno())]
            for f in procs_files:
                argv += ["--cgroup", f]
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
        self.sock = mine
        self.claimed = False        # True once the claim went out: the process is the sandbox's
        os.set_blocking(self.proc.stderr.fileno(), False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_parked(self, timeout: float) -> None:
        """Until it is in its cgroups ('R'); LauncherError if it failed or took too long."""
        self.sock.settimeout(timeout)
        try:
            got = self.sock.recv(1)
        except OSError as e:
            raise LauncherError(f"launcher not parked: {e}") from None
        finally:
            self.sock.settimeout(None)
        if got != b"R":
            raise LauncherError(f"launcher exited before it was parked: {self.stderr_tail()}")

    def claim(self, netns_path: str, uid: int, view: list[str], argv: list[str], fds: list[int]) -> None:
        """Hand it the sandbox: it enters netns_path, pivots into a mount namespace holding only
        the host paths in view (claim_message), becomes uid, execs argv with fds as 3, 4, ...
        Close the socket only once it has exec'd (close_socket): a close with its 'R' still
        unread would reset the connection before it read the claim."""
        if self.claimed:
            raise LauncherError("launcher already claimed")     # one sandbox per launcher, ever
        if len(fds) > CLAIM_FDS:
            raise LauncherError(f"{len(fds)} fds exceed {CLAIM_FDS}")
        msg = claim_message(netns_path, uid, view, argv)
        try:
            socket.send_fds(self.sock, [msg], fds)
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
