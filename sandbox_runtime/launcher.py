"""One launcher of a namespace sandbox: `cubegate-agent --parked` (agent.c).

Started as root with its cgroups given; it joins them, says 'R' on its socket (parked)
and waits for exactly one claim: the netns to enter, the host uid to drop to, the argv
to exec and the fds that argv names as 3, 4, ... (sent with SCM_RIGHTS). So a pooled
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
FIRST_FD = 3
# bwrap's pid 1 keeps the environment it was started with (readable inside as
# /proc/1/environ): minimal, the daemon's (vault key!) must never reach it.
LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class LauncherError(RuntimeError):
    pass


def claim_message(netns_path: str, uid: int, argv: list[str]) -> bytes:
    """The claim agent.c parses: NUL-terminated netns path, uid, argv."""
    if uid <= 0:
        raise LauncherError("a sandbox never runs as host root")
    fields = [netns_path, str(uid), *argv]
    if not argv or any("\0" in f for f in fields):
        raise LauncherError("malformed claim")
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

    def claim(self, netns_path: str, uid: int, argv: list[str], fds: list[int]) -> None:
        """Hand it the sandbox: it enters netns_path, becomes uid, execs argv with fds as 3, 4, ...
        Close the socket only once it has exec'd (close_socket): a close with its 'R' still
        unread would reset the connection before it read the claim."""
        if self.claimed:
            raise LauncherError("launcher already claimed")     # one sandbox per launcher, ever
        if len(fds) > CLAIM_FDS:
            raise LauncherError(f"{len(fds)} fds exceed {CLAIM_FDS}")
        msg = claim_message(netns_path, uid, argv)
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
