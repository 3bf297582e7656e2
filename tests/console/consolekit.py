"""A real `cubegate run` with the console on (no root: explicit proxy, ops, vault, console on loopback),
and a logged-in HTTP client for it."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.cubegate.daemon_util import free_ports
from tests.gateway.harness import audit_records_in, wait_record_in

REPO = Path(__file__).resolve().parents[2]
POLICY = "name: t\ntenant: acme\ndefault: deny\nrules:\n  - name: a\n    action: allow\n    match: {hosts: [a.test]}\n"


def make_vault(state: Path) -> dict[str, str]:
    """A vault with a key file and three tokens: {"admin": ..., "other": ..., "read": ...}."""
    import vault
    from vault import crypto
    state.mkdir(parents=True, exist_ok=True)
    v = vault.Vault.init(state / "vault.db", crypto.create_key_file(state / "vault.key"))
    tokens = {}
    for name, scope in (("admin", "admin"), ("other", "admin"), ("read", "read")):
        info, tokens[name] = v.tokens.create(scope, description=f"console test {name}")
        tokens[name + "_id"] = info.id
    v.close()
    return tokens


class ConsoleDaemon:
    def __init__(self, workdir: Path, *, console: dict | None = None, extra: dict | None = None):
        self.dir = Path(workdir)
        (self.dir / "policies").mkdir(parents=True, exist_ok=True)
        (self.dir / "policies" / "p.yaml").write_text(POLICY)
        self.state = self.dir / "state"
        self.tokens = make_vault(self.state)
        proxy, ops, api, policy_api, port = free_ports(5)
        self.port, self.ops_port = port, ops
        settings = {"state_dir": str(self.state), "policy_dir": str(self.dir / "policies"),
                    "proxy": {"explicit_port": proxy}, "ops": {"port": ops}, "vault": {"api_port": api},
                    "policy_api": {"port": policy_api},
                    "audit": {"fsync": "never"},
                    "console": {"enabled": True, "port": port, "sample_seconds": 1.0, **(console or {})},
                    **(extra or {})}
        self.settings_path = self.dir / "settings.yaml"
        self.settings_path.write_text(yaml.safe_dump(settings))
        self.tls = bool((console or {}).get("tls_cert"))
        self.base = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        self.log_path = self.dir / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "ConsoleDaemon":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cubegate.cli", "-c", str(self.settings_path), "run"],
                                         cwd=REPO, stdout=log, stderr=log)
        try:
            return self._wait_console(timeout)
        except BaseException:
            self.stop()              # in the root namespace nothing else would ever stop it
            raise

    def _wait_console(self, timeout: float) -> "ConsoleDaemon":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.base + "/login", verify=False, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"console not up after {timeout}s: {self.log()}")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the daemon's /readyz says ready (its workers started: under load they take a while)."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{self.ops_port}/readyz", timeout=2, trust_env=False)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.1)
        raise AssertionError(f"not ready after {timeout}s: {last}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def audit_records(self) -> list[dict]:
        return audit_records_in(self.state / "audit")

    def audit_text(self) -> str:
        return "".join(f.read_text() for f in sorted((self.state / "audit").glob("*.jsonl")))

    def wait_record(self, pred, timeout: float = 5.0) -> dict:
        return wait_record_in(self.state / "audit", pred, timeout)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, verify=False, timeout=30, follow_redirects=False)

    def login(self, token: str | None = None) -> "Browserish":
        return Browserish(self).login(self.tokens["admin"] if token is None else token)


CSRF = re.compile(r'name="_csrf" value="([^"]+)"')


class Browserish:
    """An httpx client that keeps cookies, reads the CSRF token from pages, posts forms."""

    def __init__(self, daemon: ConsoleDaemon):
        self.d = daemon
        self.c = daemon.client()
        self.csrf: str | None = None
        self.seen: list[httpx.Response] = []

    def get(self, path: str, **kw) -> httpx.Response:
        r = self.c.get(path, **kw)
        self.seen.append(r)
        m = CSRF.search(r.text) if "text/html" in r.headers.get("content-type", "") else None
        if m:   # the login page's token before login, the session's after
            self.csrf = m.group(1)
        return r

    def post(self, path: str, data: dict | None = None, *, csrf: bool = True, **kw) -> httpx.Response:
        data = dict(data or {})
        if csrf:
            data["_csrf"] = self.csrf
        r = self.c.post(path, data=data, headers={"Origin": self.d.base, **kw.pop("headers", {})}, **kw)
        self.seen.append(r)
        return r

    def login(self, token: str) -> "Browserish":
        page = self.get("/login")
        assert page.status_code == 200, page.text
        r = self.post("/login", {"token": token})
        assert r.status_code == 303 and r.headers["location"] == "/", (r.status_code, r.text[:500])
        self.csrf = None
        assert self.get("/").status_code == 200
        assert self.csrf, "no CSRF token on the overview"
        return self


def first_line(s: socket.socket, wait: float = 5.0) -> bytes:
    """The status line of what the server sent on `s` (b"" for nothing within `wait`, or a reset)."""
    s.settimeout(wait)
    try:
        return s.recv(4096).split(b"\r\n")[0]
    except (TimeoutError, OSError):
        return b""
