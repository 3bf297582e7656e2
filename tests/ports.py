"""Loopback ports for daemons a test starts in the root namespace (where other test runs share loopback).

bind(0)-then-close hands back a port from the kernel's ephemeral range, which the next outgoing
connection on the machine (a curl, a pip, another engineer's suite) may take before our daemon
binds it: EADDRINUSE under load. So the ports come from below the ephemeral range, and each is
claimed with a lock file this process holds (the last MAX_HELD claims; older daemons are long
gone), so two concurrent test runs never get the same one.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
from pathlib import Path

LOW, HIGH = 20000, 32000          # below ip_local_port_range (32768-60999 here): the kernel never hands these out
CLAIMS = Path("/tmp/cubegate-test-ports")
MAX_HELD = 64
_held: dict[int, int] = {}        # port -> fd of its lock file, oldest first


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim(port: int) -> bool:
    CLAIMS.mkdir(mode=0o1777, exist_ok=True)
    fd = os.open(CLAIMS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False          # another live test process has it
        raise
    with socket.socket() as s:    # free right now (nothing outside the claim scheme holds it)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            return False
    _held[port] = fd
    while len(_held) > MAX_HELD:
        os.close(_held.pop(next(iter(_held))))
    return True


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports no other test run on this machine will be handed."""
    high = min(HIGH, _ephemeral_low())
    out: list[int] = []
    for _ in range(200 * n):      # bounded: a few collisions at most in ~12000 ports
        port = random.randrange(LOW, high)
        if port not in _held and _claim(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no free test ports in {LOW}-{high} after {200 * n} tries")
