"""Shared pieces for the fault tests: process figures, bounded waits, bad servers."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def eventually(fn, timeout: float = 5.0, interval: float = 0.05):
    """fn() until truthy (returned) or timeout (returns the last falsy value)."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def tree_pids(pid: int) -> list[int]:
    """pid and every process under it: the gateway is the daemon plus its worker processes."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def proc_fds(pid: int) -> int:
    """Open fds of the process and its children (the daemon and its workers)."""
    n = 0
    for p in tree_pids(pid):
        try:
            n += len(os.listdir(f"/proc/{p}/fd"))
        except FileNotFoundError:
            pass
    return n


def proc_rss_kib(pid: int) -> int:
    """RSS of the process and its children (the daemon and its workers)."""
    total = 0
    for p in tree_pids(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total


def proc_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 0


def report(name: str, **figures) -> None:
    """One line per figure set: the fault tests' results table is built from these (pytest -s)."""
    print(f"\nFAULT-FIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), file=sys.stderr)


@contextmanager
def bad_upstreams(lab, servers: dict[str, tuple[str, str]], ports=(80, 443)):
    """servers: name -> (ip, mode); each ip serves `mode` on every port. Names go into the lab DNS."""
    for name, (ip, _) in servers.items():
        lab.add_host(name, ip)
    argv = [sys.executable, "-m", "tests.faults.badupstream"]
    for ip, mode in servers.values():
        argv += [a for port in ports for a in ("--serve", f"{ip}:{port}:{mode}")]
    p = lab.spawn_net(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      cwd=REPO, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("READY"), line + p.stdout.read()
        yield
    finally:
        p.kill()
        p.wait(5)
        p.stdin.close()
        p.stdout.close()
        for name in servers:
            lab.set_zone(name, None)
            lab.hosts.pop(name, None)
