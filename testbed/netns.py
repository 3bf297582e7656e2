"""Small helpers for network namespaces used by the lab and by tests.

Everything happens inside namespaces we create; the root namespace's links,
routes and firewall are never touched. Commands run inside a namespace through
``nsenter --net=/run/netns/NAME`` (``ip netns exec`` would remount /sys and
hide bpffs pins). ``call_in_netns`` runs a Python callable in a thread that
has joined the namespace, for tests that want real sockets from inside it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = [
    "Netns", "unique_prefix", "veth_pair", "add_addr", "link_up", "add_route",
    "run", "spawn", "call_in_netns", "netns_path", "exists",
]

NETNS_DIR = "/run/netns"
T = TypeVar("T")


def unique_prefix() -> str:
    """``cg`` + 6 random hex digits: short enough for interface names."""
    return "cg" + secrets.token_hex(3)


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def exists(name: str) -> bool:
    return os.path.exists(netns_path(name))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _nsenter(ns: str, argv: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net={netns_path(ns)}", "--", *map(str, argv)]


def _name(ns: "str | Netns") -> str:
    return ns.name if isinstance(ns, Netns) else ns


def run(ns: "str | Netns", argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
    """subprocess.run ``argv`` inside ``ns`` (kw passed through; text=True by default)."""
    kw.setdefault("text", True)
    return subprocess.run(_nsenter(_name(ns), argv), **kw)


def spawn(ns: "str | Netns", argv: Sequence[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen ``argv`` inside ``ns`` (kw passed through)."""
    return subprocess.Popen(_nsenter(_name(ns), argv), **kw)


def link_up(ns: "str | Netns", dev: str = "lo") -> None:
    _ip("-n", _name(ns), "link", "set", dev, "up")


def add_addr(ns: "str | Netns", dev: str, cidr: str) -> None:
    """Add ``cidr`` (e.g. ``198.18.0.1/24``) to ``dev``; IPv6 gets nodad."""
    extra = ["nodad"] if ":" in cidr else []
    _ip("-n", _name(ns), "addr", "add", cidr, "dev", dev, *extra)


def add_route(ns: "str | Netns", dst: str, via: str | None = None, dev: str | None = None) -> None:
    args = ["-n", _name(ns), "route", "add", dst]
    if via:
        args += ["via", via]
    if dev:
        args += ["dev", dev]
    _ip(*args)


def veth_pair(ns_a: "str | Netns", ns_b: "str | Netns", name_a: str, name_b: str,
              addrs_a: Iterable[str] = (), addrs_b: Iterable[str] = ()) -> None:
    """Create a veth with one end in each namespace (never in the root ns), add addresses, bring up."""
    a, b = _name(ns_a), _name(ns_b)
    _ip("link", "add", name_a, "netns", a, "type", "veth", "peer", "name", name_b, "netns", b)
    for ns, dev, addrs in ((a, name_a, addrs_a), (b, name_b, addrs_b)):
        for cidr in addrs:
            add_addr(ns, dev, cidr)
        link_up(ns, dev)


def pids_in(name: str) -> list[int]:
    result = _ip("netns", "pids", name, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


class Netns:
    """A named network namespace; context manager; ``delete()`` is idempotent.

    ``delete()`` also kills processes still inside it (they were started in a
    namespace that only we use) so the namespace really disappears, and
    removes a stale ``/run/netns/NAME`` left by a crashed run.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or unique_prefix()
        self.path = netns_path(self.name)

    def create(self) -> "Netns":
        _ip("netns", "add", self.name)
        link_up(self.name, "lo")
        return self

    def delete(self) -> None:
        if not os.path.exists(self.path):
            return
        for pid in pids_in(self.name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if _ip("netns", "del", self.name, check=False).returncode != 0 and os.path.exists(self.path):
            subprocess.run(["umount", "-l", self.path], capture_output=True)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        return run(self.name, argv, **kw)

    def spawn(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        return spawn(self.name, argv, **kw)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = 60, **kw: Any) -> T:
        return call_in_netns(self.name, fn, *args, timeout=timeout, **kw)

    def __enter__(self) -> "Netns":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"Netns({self.name!r})"


def call_in_netns(ns: "str | Netns", fn: Callable[..., T], *args: Any,
                  timeout: float | None = 60, **kw: Any) -> T:
    """Run ``fn(*args, **kw)`` in a fresh thread that joined ``ns``; return its result.

    setns() changes only the calling thread, so the caller stays where it is.
    Sockets ``fn`` creates (also in an asyncio loop it runs) live in ``ns``.
    Exceptions are re-raised here; TimeoutError if it runs past ``timeout``.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(netns_path(_name(ns)), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.setns(fd, os.CLONE_NEWNET)
            finally:
                os.close(fd)
            outcome["result"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome["error"] = e

    thread = threading.Thread(target=target, name=f"netns-{_name(ns)}", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"call in netns {_name(ns)} still running after {time.monotonic() - started:.1f}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
