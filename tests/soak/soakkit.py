"""I/O glue shared by the soak tests and bench/soak.py: gateway setup, load process, /proc stats, sweep."""
from __future__ import annotations

import json
import os
import secrets as pysecrets
import subprocess
import sys
import time
from pathlib import Path

from egress.identity import IdentityStore
from tests.gateway.harness import REPO, Gateway
from tests.soak import sweep

TENANT, SECRET_ID, BINDING_ID = "soak", "openai", "b-soak"
# api.allowed.test is intercepted because its rule needs the path; echo.allowed.test because of
# the credential binding; passthrough.allowed.test passes through; denied.test matches nothing.
POLICY = f"""\
name: soak
tenant: {TENANT}
default: deny
rules:
  - name: api-soak-paths
    action: allow
    match: {{hosts: [api.allowed.test], ports: [443, 80], paths: [/soak/]}}
  - name: lab
    action: allow
    match: {{hosts: [echo.allowed.test, passthrough.allowed.test], ports: [443]}}
"""


def new_secret() -> str:
    # '+', '/' and '=' make the url-encoded form differ from the raw one.
    return f"sk-soak+{pysecrets.token_hex(10)}/{pysecrets.token_hex(6)}="


def make_gateway(lab, workdir: Path, n_sandboxes: int, secret: str, *, drain_seconds: float = 5.0,
                 start: bool = True) -> Gateway:
    gw = Gateway(lab, workdir, {"soak.yaml": POLICY}, sandboxes={"sb-0000": {}},
                 settings_extra={"proxy": {"drain_seconds": drain_seconds}, "audit": {"fsync": "interval"}})
    store = IdentityStore(gw.state_dir / "identities.db")   # bulk: one CLI process per identity is too slow
    try:
        for i in range(1, n_sandboxes):
            gw.tokens[f"sb-{i:04d}"] = store.add(f"sb-{i:04d}")
    finally:
        store.close()
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", TENANT, SECRET_ID, input=secret + "\n")
    gw.cli("vault", "binding", "add", "--id", BINDING_ID, "--tenant", TENANT, "--secret", SECRET_ID,
           "--host", "echo.allowed.test", "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")
    if start:
        start_gateway(gw)
    return gw


def start_gateway(gw: Gateway) -> Gateway:
    gw.start()
    pin(gw.proc.pid, {0})
    return gw


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process and of its children (the daemon's workers; threads made
    later inherit it)."""
    from tests.faults.helpers import tree_pids
    if len(os.sched_getaffinity(0)) < 2:
        return
    for p in tree_pids(pid):
        for tid in os.listdir(f"/proc/{p}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass


def proc_stats(pid: int) -> dict:
    """RSS, fds and CPU of the daemon and its workers together."""
    from tests.faults.helpers import tree_pids
    rss_kb, fds, cpu_s = 0, 0, 0.0
    for p in tree_pids(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kb += int(line.split()[1])
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cpu_s += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except FileNotFoundError:
            pass
    return {"rss_mb": round(rss_kb / 1024, 1), "fds": fds, "cpu_s": round(cpu_s, 2)}


def spec_for(gw: Gateway, lab, *, duration: float, max_requests: int, concurrency: int, run_tag: str,
             ip_base: int, secrets: list[str], seed: int = 1, sandboxes: list[str] | None = None, **kw) -> dict:
    names = sandboxes or sorted(gw.tokens)
    return {"proxy_port": gw.proxy_port, "sandboxes": [[n, gw.tokens[n]] for n in names],
            "duration": duration, "max_requests": max_requests, "concurrency": concurrency,
            "run_tag": run_tag, "ip_base": ip_base, "secrets": secrets, "seed": seed,
            "gateway_ca": str(gw.ca_cert), "lab_ca": str(lab.ca.bundle_path),
            "cpu": 1 if len(os.sched_getaffinity(0)) >= 2 else None, **kw}


def start_load(lab, spec: dict, spool: Path) -> tuple[subprocess.Popen, Path]:
    """The load generator as its own process in the gw namespace. `spool` must not be swept
    (the spec holds the test secrets so the client can check answers for them)."""
    spool.mkdir(parents=True, exist_ok=True)
    tag = f"{spec['run_tag']}-{spec['ip_base']}"
    spec_path, out_path = spool / f"spec-{tag}.json", spool / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    proc = lab.spawn_gw([sys.executable, "-m", "testbed.loadgen", str(spec_path), str(out_path)],
                        cwd=REPO, lab_dns=False, stdout=subprocess.DEVNULL, stderr=open(spool / f"err-{tag}.txt", "wb"),
                        env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, out_path


def finish_load(proc: subprocess.Popen, out_path: Path, timeout: float) -> dict:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise AssertionError("load generator overran its bound")
    if proc.returncode != 0:
        err = out_path.with_name(out_path.name.replace("out-", "err-").replace(".json", ".txt"))
        raise AssertionError(f"load generator failed ({proc.returncode}): {err.read_text()[-3000:]}")
    return json.loads(out_path.read_text())


def run_load(lab, spec: dict, spool: Path) -> dict:
    proc, out = start_load(lab, spec, spool)
    return finish_load(proc, out, spec["duration"] + 30)


def settle(gw: Gateway, quiet: float = 1.0, timeout: float = 20.0) -> list[dict]:
    """Audit records once their count stopped changing for `quiet` seconds (closes land late)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        recs = gw.audit_records()
        if len(recs) != last:
            last, since = len(recs), time.monotonic()
        elif time.monotonic() - since >= quiet:
            return recs
        time.sleep(0.2)
    return gw.audit_records()


def vault_reads(gw: Gateway) -> dict[str, bytes]:
    """Bodies of the admin API's read endpoints (read-scope token)."""
    token = gw.cli("vault", "token", "create", "--scope", "read").strip().split()[-1]
    port = gw.proxy_port + 2   # harness convention: vault.api_port = proxy port + 2
    out = {}
    for path in ("/v1/status", "/v1/secrets", f"/v1/secrets/{TENANT}/{SECRET_ID}", "/v1/bindings",
                 f"/v1/bindings/{BINDING_ID}"):
        r = gw.lab.curl("-s", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {token}",
                        f"http://127.0.0.1:{port}{path}", cacert=False, lab_dns=False)
        body, _, code = r.stdout.rpartition("\n")
        out[f"vault-api{path}"] = (body.encode(), int(code or 0))
    return out


def secret_sweep(gw: Gateway, secret_values: list[str], *, extra_blobs: dict[str, bytes] | None = None,
                 gateway_running: bool = True) -> dict:
    """Grep the gateway's dir (state: audit, index, vault db; logs incl. stderr), /metrics,
    vault API reads and core files for every secret encoding."""
    patterns = {f"secret{i}": sweep.encodings(s) for i, s in enumerate(secret_values)}
    blobs = dict(extra_blobs or {})
    status: dict[str, int] = {}
    if gateway_running:
        blobs["/metrics"] = gw.ops("/metrics").stdout.encode()
        for name, (body, code) in vault_reads(gw).items():
            blobs[name], status[name] = body, code
    hits, nfiles = sweep.search_files([gw.dir], patterns)
    cores = sweep.core_files([REPO, gw.dir])
    chits, _ = sweep.search_files(cores, patterns)
    for name, data in blobs.items():
        hits += sweep.search_blob(name, data, patterns)
    return {"hits": hits + chits, "files": nfiles, "blobs": sorted(blobs), "core_files": [str(c) for c in cores],
            "blob_bytes": {k: len(v) for k, v in blobs.items()}, "blob_status": status, "patterns": sum(len(p) for p in patterns.values())}
