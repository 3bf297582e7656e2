"""A real cubegate gateway process inside a lab namespace, driven by curl."""
from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CUBEGATE = [sys.executable, "-m", "cubegate.cli"]
# 10 ports a gateway from 19000 up: clear of the fixed ports the daemon tests use in the lab namespace
# (18067-18385, test_init's 18700 + 10 n) and of the ephemeral range (32768-): a leftover never collides.
_ports = itertools.count(19000, 10)


def audit_records_in(audit_dir: Path) -> list[dict]:
    """Every record of a daemon's audit log (rotated segments first), as written."""
    out = []
    for f in sorted(audit_dir.glob("*.jsonl")):
        lines = f.read_text().split("\n")[:-1]      # complete lines: one being appended right now waits
        out += [json.loads(line) for line in lines if line.strip()]
    return out


def wait_record_in(audit_dir: Path, pred, timeout: float = 5.0) -> dict:
    """The first record `pred` accepts, polled for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in audit_records_in(audit_dir):
            if pred(rec):
                return rec
        time.sleep(0.05)
    raise AssertionError("no matching audit record; last: " + json.dumps(audit_records_in(audit_dir)[-5:], indent=1))


class Gateway:
    def __init__(self, lab, workdir: Path, policies: dict[str, str], *, sandboxes=None, settings_extra=None):
        self.lab = lab
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.policy_dir = self.dir / "policies"
        self.policy_dir.mkdir(exist_ok=True)
        for name, text in policies.items():
            (self.policy_dir / name).write_text(text)
        base = next(_ports)
        self.proxy_port, self.ops_port = base, base + 1
        self.state_dir = self.dir / "state"
        settings = {
            "state_dir": str(self.state_dir),
            "policy_dir": str(self.policy_dir),
            "policy_poll_seconds": 0.2,
            "proxy": {"listen_host": "127.0.0.1", "explicit_port": self.proxy_port},
            "ops": {"listen_host": "127.0.0.1", "port": self.ops_port},
            "upstream": {"ca_bundle": str(lab.ca.bundle_path), "nameservers": [lab.dns_addr],
                         "allow_cidrs": ["198.18.0.0/24"]},
            "audit": {"fsync": "never"},
            "vault": {"api_port": base + 2},
            "policy_api": {"port": base + 3},
        }
        for k, v in (settings_extra or {}).items():
            if isinstance(v, dict):
                settings.setdefault(k, {}).update(v)
            else:
                settings[k] = v
        self.settings_path = self.dir / "settings.yaml"
        self.settings_path.write_text(yaml.safe_dump(settings))
        self.tokens: dict[str, str] = {}
        for sb, labels in (sandboxes or {"sb-1": {}}).items():
            self.tokens[sb] = self._add_identity(sb, labels)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "gateway.log"

    @property
    def audit_dir(self) -> Path:
        return self.state_dir / "audit"

    @property
    def ca_cert(self) -> Path:
        return self.state_dir / "ca" / "mitmproxy-ca-cert.pem"

    def _add_identity(self, sandbox: str, labels: dict[str, str]) -> str:
        """What `cubegate identity add` does (the same settings, the same store call), in this
        process: set-up of every gateway, without a CLI process start (~0.5 s) per sandbox. The
        CLI command itself is run by the tests that re-key or add identities later."""
        import os

        from cubegate.settings import load_settings
        from egress.identity import IdentityStore

        settings = load_settings(str(self.settings_path), state_dir=os.environ.get("CUBEGATE_STATE_DIR"))
        store = IdentityStore(settings.identity_db)
        try:
            return store.add(sandbox, {k: str(v) for k, v in labels.items()})
        finally:
            store.close()

    def cli(self, *args: str, check: bool = True, input: str | None = None) -> str:
        r = subprocess.run([*CUBEGATE, "-c", str(self.settings_path), *args], capture_output=True, text=True,
                           cwd=REPO, input=input, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"cubegate {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r.stdout if check else r

    def start(self, wait_ready: bool = True, log_level: str | None = None) -> "Gateway":
        level = ["--log-level", log_level] if log_level else []
        with open(self.log_path, "ab") as log:    # the child has its own copy of the fd
            self.proc = self.lab.spawn_gw([*CUBEGATE, "-c", str(self.settings_path), "run", *level],
                                          stdout=log, stderr=log, cwd=REPO, lab_dns=False)
        if wait_ready:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()          # not left running (holding its ports) until the lab closes
                raise
        return self

    def ops(self, path: str) -> subprocess.CompletedProcess:
        return self.lab.curl("-s", "-o", "/dev/stdout", "-w", "\n%{http_code}",
                             f"http://127.0.0.1:{self.ops_port}{path}", cacert=False, lab_dns=False)

    def ops_status(self, path: str) -> tuple[int, str]:
        r = self.ops(path)
        body, _, code = r.stdout.rpartition("\n")
        return int(code or 0), body

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited {self.proc.returncode}: {self.log()}")
            code, _ = self.ops_status("/readyz")
            if code == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"gateway not ready after {timeout}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def proxy_url(self, sandbox: str = "sb-1", token: str | None = None) -> str:
        token = self.tokens[sandbox] if token is None else token
        return f"http://{sandbox}:{token}@127.0.0.1:{self.proxy_port}"

    def curl(self, url: str, *args: str, sandbox: str = "sb-1", token: str | None = None,
             timeout: float = 10) -> "CurlResult":
        r = self.lab.curl("-x", self.proxy_url(sandbox, token), "-o", "/dev/stdout",
                          "-w", "\n__CODE__%{http_code} %{http_connect}", *args, url,
                          timeout=timeout, lab_dns=False)
        return CurlResult(r)

    def audit_records(self) -> list[dict]:
        return audit_records_in(self.audit_dir)

    def wait_record(self, pred, timeout: float = 5.0) -> dict:
        return wait_record_in(self.audit_dir, pred, timeout)


class CurlResult:
    def __init__(self, r: subprocess.CompletedProcess):
        self.rc = r.returncode
        self.stderr = r.stderr
        out = r.stdout
        body, _, tail = out.rpartition("\n__CODE__")
        codes = tail.split()
        self.body = body
        self.status = int(codes[0]) if codes else 0
        self.connect_status = int(codes[1]) if len(codes) > 1 else 0

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"CurlResult(rc={self.rc}, status={self.status}, connect={self.connect_status}, body={self.body[:200]!r}, stderr={self.stderr[:300]!r})"
