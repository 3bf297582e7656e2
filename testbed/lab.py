"""The standard lab: a gateway namespace, an "internet" namespace, DNS, upstreams.

    <prefix>-gw   198.18.0.1/24 on veth <prefix>g, default route via 198.18.0.2
                  (the gateway and its test clients run here; lo up)
    <prefix>-net  198.18.0.2/24 on veth <prefix>n   DNS server on :53 (UDP+TCP)
                  198.18.0.10 .. 198.18.0.20/32     one upstream per test host
                                                     (HTTP :80, HTTPS :443)

Processes started in the gw namespace through ``run_gw``/``spawn_gw``/``curl``
see the lab's DNS server in /etc/resolv.conf (a private mount namespace bind-
mounts it). Nothing is added to the root namespace.

    with Lab() as lab:
        lab.curl("https://api.allowed.test/")

CLI for the demo: ``python -m testbed.lab up [--prefix cgXXXXXX]`` (runs until
Ctrl-C) and ``python -m testbed.lab down --prefix cgXXXXXX`` (removes leftovers).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from testbed import netns
from testbed.ca import TestCA

__all__ = ["Lab", "HOSTS", "SSRF_ZONE", "GW_ADDR", "NET_ADDR"]

T = TypeVar("T")

GW_ADDR = "198.18.0.1"
NET_ADDR = "198.18.0.2"
LAB_CIDR = "198.18.0.0/24"

# name -> address of the upstream server that answers for it
HOSTS: dict[str, str] = {
    "api.allowed.test": "198.18.0.10",
    "passthrough.allowed.test": "198.18.0.11",
    "denied.test": "198.18.0.12",
    "echo.allowed.test": "198.18.0.13",
    "redirect.allowed.test": "198.18.0.14",
    "x.github.test": "198.18.0.15",
    "a.b.github.test": "198.18.0.16",
    "github.test": "198.18.0.17",
    "evil-github.test": "198.18.0.18",
    "spare1.test": "198.18.0.19",
    "spare2.test": "198.18.0.20",
}

# Names whose answers a gateway must refuse (SSRF), plus a rebinding name.
SSRF_ZONE: dict[str, object] = {
    "loopback.evil.test": ["127.0.0.1"],
    "private.evil.test": ["10.0.0.1"],
    "metadata.evil.test": ["169.254.169.254"],
    "cgnat.evil.test": ["100.64.0.1"],
    "mapped.evil.test": ["::ffff:127.0.0.1"],
    "ula.evil.test": ["fd00::1"],
    "mixed.evil.test": ["198.18.0.10", "127.0.0.1"],
    "rebind.allowed.test": {"alternate": ["198.18.0.10", "127.0.0.1"]},
}

# Extra certificate names served by an upstream (rebind.allowed.test -> .10).
EXTRA_CERT_NAMES = {"api.allowed.test": ["rebind.allowed.test", "mixed.evil.test"]}

READY_TIMEOUT = 10.0
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
               "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


class _Managed:
    """A child process whose output a thread keeps draining (pipes never fill)."""

    def __init__(self, label: str, popen: subprocess.Popen, keep: int = 2000) -> None:
        self.label = label
        self.popen = popen
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._drain, name=f"lab-{label}", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if line.startswith("READY"):
                self.ready.set()
        self.ready.set()  # EOF: wake waiters; they check whether it died

    def output(self) -> str:
        return "\n".join(self.lines)


class Lab:
    """Build the lab on ``__enter__``; tear everything down on ``__exit__``.

    Attributes: ``prefix``, ``gw_ns``/``net_ns`` (namespace names),
    ``gw_addr`` 198.18.0.1, ``net_addr`` 198.18.0.2, ``lab_cidr``
    198.18.0.0/24 (give it to AddressGuard(allow_cidrs=...)), ``dns_addr``
    "198.18.0.2:53", ``hosts`` (name -> upstream ip), ``zone`` (current DNS
    zone), ``ca`` (TestCA; ``ca.bundle_path`` trusts every upstream),
    ``resolv_path``, ``workdir``, ``startup_seconds``.
    """

    def __init__(self, prefix: str | None = None, workdir: str | os.PathLike | None = None) -> None:
        self.prefix = prefix or netns.unique_prefix()
        self.gw_ns = f"{self.prefix}-gw"
        self.net_ns = f"{self.prefix}-net"
        self.gw_dev = f"{self.prefix}g"
        self.net_dev = f"{self.prefix}n"
        self.gw_addr = GW_ADDR
        self.net_addr = NET_ADDR
        self.lab_cidr = LAB_CIDR
        self.dns_addr = f"{NET_ADDR}:53"
        self.hosts: dict[str, str] = dict(HOSTS)
        self.zone: dict[str, object] = {**{n: [ip] for n, ip in HOSTS.items()}, **SSRF_ZONE}
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.zone_path = self.workdir / "zone.json"
        self.resolv_path = self.workdir / "resolv.conf"
        self.ca: TestCA | None = None
        self.procs: dict[str, _Managed] = {}
        self._spawned: list[subprocess.Popen] = []
        self._namespaces: list[netns.Netns] = []
        self.startup_seconds: float | None = None

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Lab":
        started = time.monotonic()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in (self.gw_ns, self.net_ns):
            ns = netns.Netns(name).create()  # fails if the name exists: never adopt one
            self._namespaces.append(ns)
        netns.veth_pair(self.gw_ns, self.net_ns, self.gw_dev, self.net_dev,
                        [f"{GW_ADDR}/24"], [f"{NET_ADDR}/24"])
        for ip in sorted(set(self.hosts.values())):
            netns.add_addr(self.net_ns, self.net_dev, f"{ip}/32")
        netns.add_route(self.gw_ns, "default", via=NET_ADDR)

        self.ca = TestCA.create(self.workdir / "ca")
        self._write_zone()
        self.resolv_path.write_text(f"nameserver {NET_ADDR}\noptions timeout:1 attempts:2\n")

        self._start("dns", self.net_ns, ["-m", "testbed.dnsserver", "--bind", NET_ADDR,
                                          "--port", "53", "--zone", str(self.zone_path)])
        # One process serves every host (a dozen interpreters would cost
        # seconds of CPU on a busy 2-core machine).
        sites = []
        for name, ip in self.hosts.items():
            cert, key = self.ca.issue([name, *EXTRA_CERT_NAMES.get(name, [])], [ip])
            sites += ["--site", f"{ip},{name},{cert},{key}"]
        self._start("upstream", self.net_ns, ["-m", "testbed.upstream", "--http-port", "80",
                                               "--https-port", "443", *sites])
        deadline = time.monotonic() + READY_TIMEOUT
        for proc in self.procs.values():
            proc.ready.wait(max(0.0, deadline - time.monotonic()))
            if proc.popen.poll() is not None or not proc.ready.is_set() or \
                    not any(l.startswith("READY") for l in proc.lines):
                raise RuntimeError(f"lab process {proc.label} did not become ready:\n{proc.output()}")

    def _start(self, label: str, ns: str, python_args: list[str]) -> None:
        env = self._env({"PYTHONPATH": _REPO_ROOT, "PYTHONUNBUFFERED": "1"})
        popen = netns.spawn(ns, [sys.executable, *python_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env)
        self.procs[label] = _Managed(label, popen)

    def close(self) -> None:
        """Stop every process we started, delete the namespaces and the workdir."""
        children = [m.popen for m in self.procs.values()] + self._spawned
        for p in children:
            if p.poll() is None:
                try:
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 2.0
        for p in children:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2)
        for ns in reversed(self._namespaces):
            ns.delete()
        self._namespaces.clear()
        for p in children:
            for stream in (p.stdout, p.stderr, p.stdin):
                if stream is not None:
                    stream.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---------------------------------------------------------------- zone
    def _write_zone(self) -> None:
        tmp = self.zone_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.zone, indent=1, sort_keys=True))
        os.replace(tmp, self.zone_path)

    def set_zone(self, name: str, addrs: Sequence[str] | dict | None) -> None:
        """Set ``name``'s answers (list, or {"alternate": [...]}); None removes it.

        The DNS server picks the change up on its next query.
        """
        key = name.lower().rstrip(".")
        if addrs is None:
            self.zone.pop(key, None)
        else:
            self.zone[key] = dict(addrs) if isinstance(addrs, dict) else list(addrs)
        self._write_zone()

    # ---------------------------------------------------------------- running things
    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
        env.update(extra or {})
        return env

    def _gw_argv(self, argv: Sequence[str], lab_dns: bool) -> list[str]:
        argv = [str(a) for a in argv]
        if not lab_dns:
            return argv
        # Private mount namespace so the bind-mounted resolv.conf is seen by
        # this process only.
        return ["unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"',
                str(self.resolv_path), *argv]

    def run_gw(self, argv: Sequence[str], *, lab_dns: bool = True, **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run in the gw namespace (text, captured output, 60 s timeout by default)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("timeout", 60)
        kw.setdefault("env", self._env())
        return netns.run(self.gw_ns, self._gw_argv(argv, lab_dns), **kw)

    def spawn_gw(self, argv: Sequence[str], *, lab_dns: bool = True, **kw: Any) -> subprocess.Popen:
        """subprocess.Popen in the gw namespace; the lab kills it on close."""
        kw.setdefault("env", self._env())
        popen = netns.spawn(self.gw_ns, self._gw_argv(argv, lab_dns), **kw)
        self._spawned.append(popen)
        return popen

    def add_host(self, name: str, ip: str) -> None:
        """One more address in the net namespace and a DNS name for it (test-owned servers).

        The address stays until the lab closes; pick one outside HOSTS.
        """
        if ip not in self.hosts.values():
            netns.add_addr(self.net_ns, self.net_dev, f"{ip}/32")
        self.hosts[name] = ip
        self.set_zone(name, [ip])

    def spawn_net(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """subprocess.Popen in the net ("internet") namespace; the lab kills it on close."""
        kw.setdefault("env", self._env({"PYTHONPATH": _REPO_ROOT, "PYTHONUNBUFFERED": "1"}))
        popen = netns.spawn(self.net_ns, [str(a) for a in argv], **kw)
        self._spawned.append(popen)
        return popen

    def call_gw(self, fn: Callable[..., T], *args: Any, timeout: float | None = 60, **kw: Any) -> T:
        """Run a Python callable in a thread inside the gw namespace."""
        return netns.call_in_netns(self.gw_ns, fn, *args, timeout=timeout, **kw)

    def curl(self, *args: str, cacert: bool = True, timeout: float = 10,
             lab_dns: bool = True) -> subprocess.CompletedProcess:
        """curl in the gw namespace, trusting the lab CA unless cacert=False."""
        argv = ["curl", "-sS", "--max-time", str(timeout)]
        if cacert:
            assert self.ca is not None
            argv += ["--cacert", str(self.ca.bundle_path)]
        return self.run_gw([*argv, *args], lab_dns=lab_dns, timeout=timeout + 5)

    def logs(self, label: str) -> str:
        """Captured stdout of a lab process: "dns" or "upstream" (one line per request).

        A thread drains the pipe: a line printed a moment ago may not be here yet. To check
        that something was logged, use ``wait_logs``.
        """
        return self.procs[label].output()

    def wait_logs(self, label: str, pred: Callable[[str], object], timeout: float = 5.0) -> str:
        """``logs(label)`` once ``pred`` accepts it (polled up to ``timeout`` s); AssertionError otherwise."""
        deadline = time.monotonic() + timeout
        while not pred(out := self.logs(label)):
            if time.monotonic() >= deadline:
                raise AssertionError(f"the {label} log never matched in {timeout} s; its tail:\n{out[-2000:]}")
            time.sleep(0.02)
        return out


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.lab")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build the lab and keep it until Ctrl-C")
    up.add_argument("--prefix")
    up.add_argument("--workdir")
    down = sub.add_parser("down", help="remove namespaces left by a lab")
    down.add_argument("--prefix", required=True)
    args = parser.parse_args(argv)

    if args.cmd == "down":
        for suffix in ("gw", "net"):
            netns.Netns(f"{args.prefix}-{suffix}").delete()
        return 0

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Lab(prefix=args.prefix, workdir=args.workdir) as lab:
        print(json.dumps({"prefix": lab.prefix, "gw_ns": lab.gw_ns, "net_ns": lab.net_ns,
                          "dns": lab.dns_addr, "ca": str(lab.ca.bundle_path), "hosts": lab.hosts,
                          "resolv_conf": str(lab.resolv_path),
                          "startup_seconds": round(lab.startup_seconds or 0, 3)}, indent=1), flush=True)
        print("READY", flush=True)
        while not stop.wait(0.2):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
