"""The proxies the gateway bench drives, each started in the lab's gw namespace
with a temporary config and stopped (with every child) at the end.

  squid      (apt)  explicit proxy, no cache, denies denied.bench.test
  tinyproxy  (apt)  explicit proxy, a domain filter denies denied.bench.test
  mitmdump   (venv) stock mitmproxy with its default addons: intercepts every
                    TLS flow (no policy, no injection), -q (no flow printing)
  cubegate          the real daemon (tests.gateway.harness.Gateway) with a
                    policy, one identity, one credential binding

Each knows which scenarios apply to it (``scenarios``), the proxy URL for hey
and curl, the CA a client must trust when it intercepts (``mitm_ca``), and
the pid whose process tree is charged with the CPU (``pid``).
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.gateway.harness import Gateway

__all__ = ["Proxy", "Squid", "Tinyproxy", "Mitmdump", "Cubegate", "gateway_knows_workers",
           "PASS_HOST", "MITM_HOST", "PLAIN_HOST", "DENIED_HOST", "SECRET", "INJECTED_AUTH"]

PASS_HOST = "pass.bench.test"
MITM_HOST = "mitm.bench.test"
PLAIN_HOST = "plain.bench.test"
DENIED_HOST = "denied.bench.test"
SECRET = "bench-only-secret-4f1c"        # a throw-away value for this bench's vault
INJECTED_AUTH = f"Bearer {SECRET}"       # what the binding puts in Authorization (vault's default format)
START_TIMEOUT = 15.0

CUBEGATE_POLICY = f"""\
name: bench
tenant: bench
default: deny
rules:
  - name: passthrough
    action: allow
    match: {{hosts: [{PASS_HOST}], ports: [443]}}
  - name: intercepted
    action: allow
    match: {{hosts: [{MITM_HOST}], ports: [443]}}
  - name: plain
    action: allow
    match: {{hosts: [{PLAIN_HOST}], ports: [80]}}
  - name: denied
    action: deny
    match: {{hosts: [{DENIED_HOST}]}}
"""

SQUID_CONF = """\
http_port 127.0.0.1:{port}
acl SSL_ports port 443
acl Safe_ports port 80 443
acl CONNECT method CONNECT
acl denied dstdomain {denied}
http_access deny denied
http_access deny !Safe_ports
http_access deny CONNECT !SSL_ports
http_access allow localhost
http_access deny all
cache deny all
cache_mem 8 MB
dns_nameservers {dns}
pid_filename {dir}/squid.pid
cache_log {dir}/cache.log
access_log stdio:{dir}/access.log
coredump_dir {dir}
netdb_filename none
pinger_enable off
shutdown_lifetime 0 seconds
"""

TINYPROXY_CONF = """\
Port {port}
Listen 127.0.0.1
User nobody
Group nogroup
Timeout 30
MaxClients 200
LogLevel Connect
LogFile "{dir}/tinyproxy.log"
Filter "{dir}/filter"
FilterType ere
FilterDefaultDeny No
"""


def gateway_knows_workers() -> bool:
    """True once cubegate's settings have proxy.workers (issue #11 item 3)."""
    from cubegate.settings import ProxySettings
    return "workers" in ProxySettings.model_fields   # pydantic settings (#12)


def _wait_listening(lab, port: int, proc: subprocess.Popen, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {_tails(logs)}")
        try:
            lab.call_gw(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close(), timeout=5)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen within {START_TIMEOUT:.0f} s: {_tails(logs)}")


def _tails(paths: list[Path]) -> str:
    return "\n".join(p.read_text(errors="replace")[-1500:] for p in paths if p.exists())


def _stop(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Proxy:
    name = "?"
    scenarios: frozenset[str] = frozenset()
    workers: int | None = None
    mitm_ca: Path | None = None

    def __init__(self, lab, workdir: Path) -> None:
        self.lab = lab
        self.dir = Path(workdir)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self) -> "Proxy":
        raise NotImplementedError

    def stop(self) -> None:
        _stop(self.proc)

    def client_connections(self) -> int | None:
        """Client connections the proxy has finished so far (its own log), None when it cannot tell."""
        return None


REFERENCE_SCENARIOS = frozenset({"passthrough-new", "passthrough-ka", "deny", "plain-ka"})


class Squid(Proxy):
    name = "squid"
    scenarios = REFERENCE_SCENARIOS
    port = 13128

    def client_connections(self) -> int | None:
        """CONNECT lines of access.log (one per tunnel, written when it closes, aborted ones too)."""
        try:
            return sum(1 for line in open(self.dir / "access.log", errors="replace") if " CONNECT " in line)
        except FileNotFoundError:
            return 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Squid":
        self.dir.mkdir(parents=True, exist_ok=True)
        user = pwd.getpwnam("proxy")  # squid drops to cache_effective_user (Debian: proxy)
        os.chown(self.dir, user.pw_uid, user.pw_gid)
        conf = self.dir / "squid.conf"
        conf.write_text(SQUID_CONF.format(port=self.port, dir=self.dir, denied=DENIED_HOST,
                                          dns=self.lab.net_addr))
        log = open(self.dir / "stdout.log", "ab")
        # --foreground: the master stays our child (it forks the worker kid); -N would hide the kid model
        self.proc = self.lab.spawn_gw(["squid", "--foreground", "-f", str(conf)], lab_dns=False,
                                      stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        _wait_listening(self.lab, self.port, self.proc, "squid", [self.dir / "cache.log", self.dir / "stdout.log"])
        return self


class Tinyproxy(Proxy):
    name = "tinyproxy"
    scenarios = REFERENCE_SCENARIOS
    port = 18888

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Tinyproxy":
        self.dir.mkdir(parents=True, exist_ok=True)
        user = pwd.getpwnam("nobody")
        os.chown(self.dir, user.pw_uid, user.pw_gid)
        (self.dir / "filter").write_text("^" + DENIED_HOST.replace(".", r"\.") + "$\n")
        conf = self.dir / "tinyproxy.conf"
        conf.write_text(TINYPROXY_CONF.format(port=self.port, dir=self.dir))
        log = open(self.dir / "stdout.log", "ab")
        self.proc = self.lab.spawn_gw([shutil.which("tinyproxy") or "tinyproxy", "-d", "-c", str(conf)],
                                      stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        _wait_listening(self.lab, self.port, self.proc, "tinyproxy",
                        [self.dir / "tinyproxy.log", self.dir / "stdout.log"])
        return self


class Mitmdump(Proxy):
    name = "mitmdump"
    scenarios = frozenset({"plain-ka", "mitm-ka", "mitm-new"})
    port = 19080

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Mitmdump":
        self.dir.mkdir(parents=True, exist_ok=True)
        exe = Path(sys.executable).parent / "mitmdump"
        log = open(self.dir / "stdout.log", "ab")
        self.proc = self.lab.spawn_gw([str(exe), "-q", "--listen-host", "127.0.0.1", "-p", str(self.port),
                                       "--set", f"confdir={self.dir}",
                                       "--set", f"ssl_verify_upstream_trusted_ca={self.lab.ca.bundle_path}"],
                                      stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        _wait_listening(self.lab, self.port, self.proc, "mitmdump", [self.dir / "stdout.log"])
        self.mitm_ca = self.dir / "mitmproxy-ca-cert.pem"
        return self


class Cubegate(Proxy):
    """The real daemon with ``workers`` processes; ``set_workers`` False leaves the
    setting out (a gateway that does not know it runs one process)."""
    name = "cubegate"
    scenarios = REFERENCE_SCENARIOS | {"mitm-ka", "mitm-new"}

    def __init__(self, lab, workdir: Path, workers: int, set_workers: bool, event_loop: str | None = None) -> None:
        super().__init__(lab, workdir)
        self.workers = workers
        self.set_workers = set_workers
        self.event_loop = event_loop     # proxy.event_loop; None: the gateway's default
        self.gw: Gateway | None = None

    @property
    def pid(self) -> int:
        assert self.gw and self.gw.proc
        return self.gw.proc.pid

    @property
    def url(self) -> str:
        assert self.gw
        return self.gw.proxy_url("sb-1")

    def start(self) -> "Cubegate":
        proxy = {"workers": self.workers} if self.set_workers else {}
        if self.event_loop:
            proxy["event_loop"] = self.event_loop
        # production poll interval (the test harness polls every 0.2 s)
        self.gw = Gateway(self.lab, self.dir, {"bench.yaml": CUBEGATE_POLICY}, sandboxes={"sb-1": {}},
                          settings_extra={"policy_poll_seconds": 1.0, "proxy": proxy})
        self.gw.cli("vault", "init")
        self.gw.cli("vault", "secret", "put", "bench", "key", input=SECRET + "\n")
        self.gw.cli("vault", "binding", "add", "--id", "bench", "--tenant", "bench", "--secret", "key",
                    "--host", MITM_HOST, "--header", "Authorization")
        self.gw.start()
        self.mitm_ca = self.gw.ca_cert
        return self

    def client_connections(self) -> int | None:
        """Client connections that sent something (a CONNECT at least), from the audit log's
        connection_closed records and the decision records that closed their connection
        (extra.closed: a refusal at the first decision; one of the two per client connection);
        `last_counts` also has all of them and the tunnels relayed (kind passthrough)."""
        counts = {"all": 0, "sent": 0, "tunnels": 0}
        for f in sorted(self.gw.audit_dir.glob("*.jsonl")):
            with open(f, "rb") as fh:
                for line in fh:
                    if b'"event":"connection_closed"' not in line and not (
                            b'"event":"decision"' in line and b'"closed":true' in line):
                        continue
                    counts["all"] += 1
                    counts["sent"] += b'"bytes_out":0,' not in line
                    counts["tunnels"] += b'"kind":"passthrough"' in line
        self.last_counts = counts
        return counts["sent"]

    def stop(self) -> None:
        if self.gw:
            if self.gw.proc and self.gw.proc.poll() not in (None, 0):
                print(f"cubegate workers={self.workers} log tail:\n{self.gw.log()}", file=sys.stderr)
            self.gw.stop()
