"""The sandbox runtime end to end through the real daemon: REST API + CLI, namespace
backend (bubblewrap), cubevs switch, transparent gateway, sandbox DNS, vault.

One daemon for the module; sandboxes are created through `cubegate sandbox ...`
(run in the gateway's namespace, where the loopback API listens)."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from testbed.netns import call_in_netns
from tests.gateway.switchlab import HUB_IP
from tests.sandbox_runtime.daemonlab import (lab_policy, put_placeholder_secret, runtime_api, runtime_daemon,
                                             runtime_settings)
from tests.sandbox_runtime.daemonlab import sandbox_cli as cli

pytestmark = pytest.mark.netns

TPORT = 18074
API_PORT = 18073
SECRET = "sk-live-runtime-5d4c3b2a1f0e9d8c"
LABEL_SECRET = "lbl:Secret+9f8e7d6c5b4a3210zz"       # not a valid label value: used to come back in a 500
HEX_SECRET = "5f1e2d3c4b5a69788796a5b4c3d2e1f0"      # a valid sandbox id
POLICY = lab_policy()


CANARY = "cubegate-daemon-env-canary-7c1e"


def _vault(gw) -> None:
    # A value only the daemon's environment holds (like CUBEGATE_VAULT_KEY would): sandboxes
    # must not be able to read it anywhere (their processes' /proc/*/environ included).
    os.environ["CUBEGATE_TEST_CANARY"] = CANARY
    put_placeholder_secret(gw, SECRET)
    gw.cli("vault", "secret", "put", "acme", "labelkey", input=LABEL_SECRET + "\n")
    gw.cli("vault", "secret", "put", "acme", "hexkey", input=HEX_SECRET + "\n")


@pytest.fixture(scope="module")
def rt(lab, tmp_path_factory):
    settings = runtime_settings(API_PORT, memory_mb=1024, cpus=1.0, backends=["namespace", "microvm"],
                                max_sandboxes=8, host_reserve_mb=256)
    with runtime_daemon(lab, tmp_path_factory.mktemp("rt"), POLICY, tport=TPORT, prefix="cr",
                        settings=settings, before_start=_vault) as (gw, sw):
        try:
            yield gw, sw
        finally:
            os.environ.pop("CUBEGATE_TEST_CANARY", None)


def api(lab, gw, method: str, path: str, token: str | None = "file", **kw) -> httpx.Response:
    return runtime_api(lab, gw, API_PORT, method, path, token, **kw)


def create(lab, gw, sid: str, *extra: str) -> dict:
    out = cli(lab, gw, "create", sid, "--tenant", "acme", "--file", f"ca.pem={gw.sandbox_ca}", "--json", *extra)
    return json.loads(out.stdout)


def sexec(lab, gw, sid, *argv, check=False) -> subprocess.CompletedProcess:
    return cli(lab, gw, "exec", sid, "--timeout", "20", "--", *argv, check=check)


def test_create_exec_and_exit_codes(rt, lab):
    gw, sw = rt
    sb = create(lab, gw, "sb-one")
    try:
        assert sb["state"] == "running" and sb["ip"].startswith("10.200.") and sb["start_ms"] > 0
        assert sw.lookup_by_ip(sb["ip"]) == "sb-one"      # network attached before "running"
        r = sexec(lab, gw, "sb-one", "sh", "-c", "echo out; echo err >&2; exit 3")
        assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
        # The host OOM killer takes sandboxes first; the sandbox cannot lower that.
        r = sexec(lab, gw, "sb-one", "sh", "-c", "cat /proc/self/oom_score_adj; echo -100 > /proc/self/oom_score_adj")
        assert r.stdout == "500\n" and r.returncode != 0, r
        r = sexec(lab, gw, "sb-one", "cat", "/workspace/ca.pem", check=True)
        assert "BEGIN CERTIFICATE" in r.stdout
        # Nothing of the daemon's environment is readable in the sandbox, not even in the
        # environ of bwrap's own pid 1; and pid 1's stderr is no host file to fill.
        r = sexec(lab, gw, "sb-one", "sh", "-c", "cat /proc/[0-9]*/environ | tr '\\0' '\\n'")
        assert CANARY not in r.stdout and "PATH=" in r.stdout, r
        r = sexec(lab, gw, "sb-one", "sh", "-c", "echo fill >> /proc/1/fd/2")
        assert r.returncode != 0, r
        ls = json.loads(cli(lab, gw, "ls", "--json").stdout)
        assert [(s["id"], s["state"]) for s in ls] == [("sb-one", "running")]
        local = gw.dir / "cp-in.bin"
        local.write_bytes(bytes(range(256)) * 10)
        cli(lab, gw, "cp", str(local), "sb-one:/workspace/in.bin")
        assert sexec(lab, gw, "sb-one", "sha256sum", "/workspace/in.bin", check=True).stdout.split()[0] == \
            __import__("hashlib").sha256(local.read_bytes()).hexdigest()
        cli(lab, gw, "cp", "sb-one:/workspace/in.bin", str(gw.dir / "cp-out.bin"))
        assert (gw.dir / "cp-out.bin").read_bytes() == local.read_bytes()
        got = json.loads(cli(lab, gw, "get", "sb-one").stdout)
        assert got["usage"]["memory_bytes"] > 0 and got["usage"]["pids"] >= 1
    finally:
        cli(lab, gw, "rm", "sb-one", check=False)


def test_traffic_goes_through_the_gateway_with_the_tenants_policy_and_credentials(rt, lab):
    gw, _ = rt
    create(lab, gw, "sb-net", "--secret-env", "OPENAI_API_KEY=openai")
    try:
        curl = ("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
                "--cacert", "/workspace/ca.pem")
        r = sexec(lab, gw, "sb-net", *curl, "https://api.allowed.test/rt-allowed")
        assert r.stdout == "200", (r, gw.log()[-2000:])
        rec = gw.wait_record(lambda x: x.get("sandbox") == "sb-net" and x.get("host") == "api.allowed.test")
        assert rec["decision"] == "allow"
        r = sexec(lab, gw, "sb-net", *curl, "https://denied.test/")
        assert r.stdout != "200"
        # The sandbox holds a placeholder, never the key; the gateway injects the real one.
        env = sexec(lab, gw, "sb-net", "sh", "-c", "echo $OPENAI_API_KEY", check=True).stdout.strip()
        assert env.startswith("cgph_") and SECRET not in env
        r = sexec(lab, gw, "sb-net", "curl", "-s", "--max-time", "10", "--cacert", "/workspace/ca.pem",
                  "-H", f"Authorization: Bearer {env}", "https://echo.allowed.test/rt-inject", check=True)
        auth = [v for k, v in json.loads(r.stdout)["header_list"] if k.lower() == "authorization"]
        assert auth == ["Bearer [REDACTED]"], r.stdout
        rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/rt-inject")
        assert rec["sandbox"] == "sb-net" and rec["extra"]["secret"] == "openai"
        # The sandbox API (and anything else of the host) is unreachable from inside. A dropped
        # SYN is only seen as a timeout; a reachable port answers it from the kernel at once,
        # so 1 s to connect is plenty (and 3 s for an answer).
        for target in (f"http://{HUB_IP}:{API_PORT}/v1/sandboxes", f"http://127.0.0.1:{API_PORT}/v1/sandboxes"):
            r = sexec(lab, gw, "sb-net", "curl", "-s", "--connect-timeout", "1", "--max-time", "3", "-o", "/dev/null",
                      "-w", "%{http_code}", target)
            assert r.returncode != 0 and r.stdout in ("", "000"), (target, r)
        # Direct egress that bypasses the gateway is dropped by the switch.
        r = sexec(lab, gw, "sb-net", "curl", "-s", "--connect-timeout", "1", "--max-time", "3",
                  "http://198.18.0.10:8443/")
        assert r.returncode != 0
    finally:
        cli(lab, gw, "rm", "sb-net", check=False)


def test_real_secret_in_env_is_refused(rt, lab):
    gw, _ = rt
    create(lab, gw, "sb-ok")
    try:   # every way in is checked: exec env, exec stdin, file upload
        r = cli(lab, gw, "exec", "sb-ok", "--env", f"K={SECRET}", "--", "true", check=False)
        assert r.returncode != 0 and "real value of secret(s) openai" in r.stderr
        r = cli(lab, gw, "exec", "sb-ok", "--stdin", "--", "cat", input=f"x{SECRET}y", check=False)
        assert r.returncode != 0 and "real value of secret(s) openai" in r.stderr
        r = api(lab, gw, "PUT", "/sandboxes/sb-ok/files?path=/workspace/k", content=SECRET.encode())
        assert r.status_code == 400 and SECRET not in r.text
        # refused after the handler took the path from the query: the record drops it
        rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.files.put"
                             and x["status"] == 400)
        assert "secret(s)" in rec["reason"] and "path" not in rec["extra"] and rec["sandbox"] == "sb-ok", rec
        assert api(lab, gw, "PUT", "/sandboxes/sb-ok/files?path=/workspace/k", content=b"fine").status_code == 204
    finally:
        cli(lab, gw, "rm", "sb-ok", check=False)
    r = cli(lab, gw, "create", "sb-leak", "--tenant", "acme", "--env", f"KEY={SECRET}", check=False)
    assert r.returncode != 0 and "real value of secret(s) openai" in r.stderr
    assert SECRET not in r.stderr and SECRET not in gw.log()
    assert api(lab, gw, "GET", "/sandboxes/sb-leak").status_code == 404   # nothing half-made left


def test_json_strings_are_every_key_and_string_value_repeated_keys_too():
    from cubegate.runtime_api import json_strings
    doc = b'{"env": {"A": 1, "B": ["x", {"C": "y"}]}, "env": {"D": true}}'
    assert sorted(json_strings(doc)) == ["A", "B", "C", "D", "env", "env", "x", "y"]
    assert json_strings(b"not json") == [] and json_strings(b"") == []   # the model refuses these itself
    assert json_strings(b"[" * 100_000) == []                            # too deep: no RecursionError


def _no_value_anywhere(gw, *values: str) -> None:
    """Neither the daemon log nor any audit record holds a secret value."""
    log, audit = gw.log_path.read_text(errors="replace"), json.dumps(gw.audit_records())
    for v in values:
        assert v not in log and v not in audit, v


def test_real_secret_in_exec_argv_or_cwd_is_refused(rt, lab):
    gw, _ = rt
    create(lab, gw, "sb-argv")
    try:
        r = sexec(lab, gw, "sb-argv", "sh", "-c", f"echo {SECRET} > /workspace/k")
        assert r.returncode != 0 and "real value of secret(s) openai" in r.stderr and SECRET not in r.stderr, r
        b64 = __import__("base64").b64encode(SECRET.encode()).decode()    # an encoded form is the same key
        r = sexec(lab, gw, "sb-argv", "sh", "-c", f"echo {b64} | base64 -d > /workspace/k")
        assert r.returncode != 0 and "secret(s) openai" in r.stderr, r
        assert sexec(lab, gw, "sb-argv", "test", "-e", "/workspace/k").returncode == 1   # nothing got in
        for body in ({"argv": ["true"], "cwd": f"/workspace/{SECRET}"},
                     {"argv": ["true"], "env": {SECRET: "x"}},          # an invalid name: used to be echoed
                     {"argv": [HEX_SECRET]},
                     {"argv": ["true", LABEL_SECRET]},
                     {"argv": ["true"], "env": {SECRET: 5}},            # the model would name the key
                     {"argv": ["true"], SECRET: 1}):
            r = api(lab, gw, "POST", "/sandboxes/sb-argv/exec", json=body)
            assert r.status_code == 400 and "secret(s)" in r.json()["message"], (body, r.text)
            assert SECRET not in r.text and HEX_SECRET not in r.text and LABEL_SECRET not in r.text
        # a repeated key: whichever one a parser keeps, both are checked
        r = api(lab, gw, "POST", "/sandboxes/sb-argv/exec",
                content=b'{"argv": ["true"], "env": {"%s": 5}, "env": {}}' % SECRET.encode())
        assert r.status_code == 400 and "secret(s)" in r.json()["message"] and SECRET not in r.text, r.text
        # Placeholders are what sandboxes get: they pass.
        ph = sexec(lab, gw, "sb-argv", "sh", "-c", "echo $CUBEGATE_PLACEHOLDER_OPENAI", check=True).stdout.strip()
        assert ph.startswith("cgph_")
        assert sexec(lab, gw, "sb-argv", "echo", ph, check=True).stdout == ph + "\n"
        # Uploads: the path is checked like the contents.
        r = api(lab, gw, "PUT", f"/sandboxes/sb-argv/files?path=/workspace/{SECRET}", content=b"x")
        assert r.status_code == 400 and SECRET not in r.text
        rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.exec.post"
                             and x["status"] == 400)
        assert "secret(s)" in rec["reason"]
    finally:
        cli(lab, gw, "rm", "sb-argv", check=False)
    _no_value_anywhere(gw, SECRET, HEX_SECRET, LABEL_SECRET)


def test_secret_values_in_any_create_or_init_field_are_400_without_the_value(rt, lab):
    gw, _ = rt
    b64 = __import__("base64").b64encode(b"data").decode()
    cases = [
        {"labels": {"team": SECRET}},              # a valid label value
        {"labels": {"team": LABEL_SECRET}},        # an invalid one: was a 500 that quoted it
        {"labels": {LABEL_SECRET: "x"}},
        {"id": HEX_SECRET},                        # a valid sandbox id
        {"backend": SECRET},                       # unknown backends are named in the error
        {"env": {SECRET: "v"}},
        {"secret_env": {SECRET: "openai"}},
        {"secret_env": {"K": SECRET}},
        {"files": {SECRET: b64}},
        {"files": {SECRET: "not base64!"}},
        {"limits": {SECRET: 1}},
        # The body models would name these keys in their errors: the secret check runs first.
        {"env": {SECRET: 5}},
        {"labels": {SECRET: ["x"]}},
        {SECRET: 1},                               # an unknown field
    ]
    for extra in cases:
        body = {"id": "sb-field", "tenant": "acme", **extra}
        r = api(lab, gw, "POST", "/sandboxes", json=body)
        if r.status_code == 201:        # a regression: remove it (daemon restarts keep sandboxes) and fail
            api(lab, gw, "DELETE", f"/sandboxes/{body['id']}")
        assert r.status_code == 400 and "secret(s)" in r.json()["message"], (extra, r.text)
        for v in (SECRET, LABEL_SECRET, HEX_SECRET):
            assert v not in r.text, (extra, r.text)
        # nothing half-made (listed, not GET by id: the access log names request paths)
        assert body["id"] not in [x["id"] for x in api(lab, gw, "GET", "/sandboxes").json()["sandboxes"]]
    # An invalid label without a secret: 400 too (it was a 500), saying what is wrong.
    r = api(lab, gw, "POST", "/sandboxes", json={"id": "sb-field", "tenant": "acme", "labels": {"team": "a:b"}})
    if r.status_code == 201:
        api(lab, gw, "DELETE", "/sandboxes/sb-field")
    assert r.status_code == 400 and "labels" in r.json()["message"], r.text
    # Without a valid id or tenant there is no tenant to check for: only those two fields are named.
    r = api(lab, gw, "POST", "/sandboxes", json={"id": "Bad_Id", "tenant": "acme", "env": {SECRET: 5}})
    assert r.status_code == 400 and r.json()["message"].startswith("/id: ") and SECRET not in r.text, r.text
    r = api(lab, gw, "POST", "/sandboxes", json={"id": "sb-field", "env": {SECRET: 5}})
    assert r.status_code == 400 and r.json()["message"] == "/tenant: required" and SECRET not in r.text, r.text
    # A refused create is audited without the id and tenant it claimed.
    rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.post"
                         and "secret(s)" in (x["reason"] or ""))
    assert rec["sandbox"] is None and "tenant" not in rec["extra"], rec
    create(lab, gw, "sb-init")
    try:
        for body in ({"env": {"K": SECRET}}, {"env": {LABEL_SECRET: "v"}}, {"files": {HEX_SECRET: b64}},
                     {"secret_env": {SECRET: "openai"}}, {"files": {SECRET: "not base64!"}}, {SECRET: 1}):
            r = api(lab, gw, "POST", "/sandboxes/sb-init/init", json=body)
            assert r.status_code == 400 and "secret(s)" in r.json()["message"], (body, r.text)
            assert SECRET not in r.text and LABEL_SECRET not in r.text and HEX_SECRET not in r.text
    finally:
        cli(lab, gw, "rm", "sb-init", check=False)
    _no_value_anywhere(gw, SECRET, HEX_SECRET, LABEL_SECRET)


def test_sealed_vault_refuses_exec_and_create_503_then_recovers(rt, lab):
    """argv is always there to check: with the vault sealed nothing can be checked, so every exec,
    create and upload is refused (503) — like env/stdin/files already were — until it is unsealed.
    (Without any vault there is no secret to leak and nothing is refused.)"""
    gw, _ = rt
    create(lab, gw, "sb-sealed")
    token = gw.cli("vault", "token", "create", "--scope", "admin").strip().split()[-1]

    def vault_admin(path, body):
        return call_in_netns(lab.gw_ns, lambda: httpx.post(f"http://127.0.0.1:{gw.proxy_port + 2}/v1{path}",
                                                           json=body, timeout=30,
                                                           headers={"Authorization": f"Bearer {token}"}))
    assert vault_admin("/seal", {}).status_code == 200
    try:
        r = api(lab, gw, "POST", "/sandboxes/sb-sealed/exec", json={"argv": ["true"]})
        assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
        r = api(lab, gw, "POST", "/sandboxes", json={"id": "sb-sealed2", "tenant": "acme"})
        if r.status_code == 201:
            api(lab, gw, "DELETE", "/sandboxes/sb-sealed2")
        assert r.status_code == 503, r.text
        r = api(lab, gw, "PUT", "/sandboxes/sb-sealed/files?path=/workspace/f", content=b"x")
        assert r.status_code == 503, r.text
    finally:
        assert vault_admin("/unseal", {"key_file": str(gw.state_dir / "vault.key")}).status_code == 200
    try:
        assert sexec(lab, gw, "sb-sealed", "true").returncode == 0
        assert api(lab, gw, "GET", "/sandboxes/sb-sealed2").status_code == 404
    finally:
        cli(lab, gw, "rm", "sb-sealed", check=False)


def test_admission_refuses_beyond_the_budget_at_once(rt, lab):
    gw, _ = rt
    create(lab, gw, "sb-cap1", "--memory-mb", "400")
    create(lab, gw, "sb-cap2", "--memory-mb", "400")
    try:
        t0 = time.monotonic()
        r = cli(lab, gw, "create", "sb-cap3", "--tenant", "acme", "--memory-mb", "400", check=False)
        assert r.returncode != 0 and "429: not enough memory: 400 MB asked, 224 MB of 1024 MB" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 10
        metrics = gw.ops("/metrics").stdout
        assert 'cubegate_sandbox_creations_total{backend="namespace",result="capacity"} 1.0' in metrics
        assert 'cubegate_host_reserved{resource="memory_bytes"} 8.388608e+08' in metrics
        assert 'cubegate_sandboxes_live{backend="namespace",state="running"} 2.0' in metrics
        assert 'cubegate_sandbox_memory_bytes{backend="namespace",sandbox="sb-cap1"}' in metrics
        assert "cubegate_sandbox_start_seconds_bucket" in metrics
        status, body = gw.ops_status("/readyz")
        assert status == 200 and '"runtime"' in body, body
    finally:
        cli(lab, gw, "rm", "sb-cap1", "sb-cap2", check=False)


def test_destroy_leaves_nothing(rt, lab):
    gw, sw = rt
    sb = create(lab, gw, "sb-gone")
    netns = sw.sandbox("sb-gone").netns
    cli(lab, gw, "rm", "sb-gone")
    assert sw.sandbox("sb-gone") is None
    assert not Path(f"/run/netns/{netns}").exists()
    assert "sb-gone" not in gw.cli("identity", "ls")
    assert not list(Path("/sys/fs/cgroup/memory").glob("**/sb-gone"))
    assert not (gw.state_dir / "runtime" / "namespace" / "sb-gone").exists()
    assert subprocess.run(["pgrep", "-f", "sb-gone"], capture_output=True).returncode == 1
    assert api(lab, gw, "GET", "/sandboxes/sb-gone").status_code == 404
    assert sb["ip"] and sw.lookup_by_ip(sb["ip"]) is None


def test_api_needs_a_token_and_audits_admin_actions(rt, lab):
    gw, _ = rt
    assert api(lab, gw, "GET", "/sandboxes", token=None).status_code == 401
    assert api(lab, gw, "POST", "/sandboxes", token="wrong", json={"id": "x", "tenant": "acme"}).status_code == 401
    r = api(lab, gw, "POST", "/sandboxes", json={"id": "Bad_Id", "tenant": "acme"})
    assert r.status_code == 400 and r.json()["message"].startswith("/id: String should match pattern")
    r = api(lab, gw, "POST", "/sandboxes", json={"id": "ok-id", "tenant": "acme", "limits": {"memory_mb": -1}})
    assert r.status_code == 400
    doc = api(lab, gw, "GET", "/openapi.json", token=None).json()
    assert "/v1/sandboxes/{id}/exec" in doc["paths"]
    # a sealed vault (nothing can be checked for secrets) is documented where it can occur
    for path, method in (("/v1/sandboxes", "post"), ("/v1/sandboxes/{id}/exec", "post"),
                         ("/v1/sandboxes/{id}/init", "post"), ("/v1/sandboxes/{id}/files", "put")):
        assert "503" in doc["paths"][path][method]["responses"], (path, method)
    assert "503" not in doc["paths"]["/v1/sandboxes/{id}/files"]["get"]["responses"]
    rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.post"
                         and x["status"] == 401)
    assert rec["decision"] == "deny"


def test_sandbox_survives_a_daemon_restart_and_orphans_are_reaped(rt, lab):
    from sandbox_runtime.backend import SandboxSpec
    from sandbox_runtime.namespace import NamespaceBackend
    gw, sw = rt
    create(lab, gw, "sb-keep")
    # An orphan: a sandbox the daemon started but did not live to record (killed mid-create).
    net = sw.attach_sandbox("sb-orphan")
    ns_state = gw.state_dir / "runtime" / "namespace"
    orphan = NamespaceBackend(ns_state).create(SandboxSpec("sb-orphan", "acme"), net.netns, ip=net.ip,
                                               gateway_ip=HUB_IP)
    try:
        sexec(lab, gw, "sb-keep", "sh", "-c", "echo before > /workspace/mark", check=True)
        gw.stop()
        gw.start()
        r = sexec(lab, gw, "sb-keep", "cat", "/workspace/mark", check=True)
        assert r.stdout == "before\n"
        ls = json.loads(cli(lab, gw, "ls", "--json").stdout)
        assert [(s["id"], s["state"]) for s in ls] == [("sb-keep", "running")]
        assert not (ns_state / "sb-orphan").exists()
        assert not Path(f"/proc/{orphan.data['bwrap_pid']}/status").exists() or \
            "State:\tZ" in Path(f"/proc/{orphan.data['bwrap_pid']}/status").read_text()
        assert "1 orphan(s) reaped" in gw.log(), gw.log()[-2000:]
    finally:
        cli(lab, gw, "rm", "sb-keep", check=False)
        sw.detach_sandbox("sb-orphan")


def test_a_create_killed_midway_leaves_nothing_after_a_restart(rt, lab):
    """The daemon is SIGKILLed inside five creates: one had its identity, network slot,
    cgroups and a running bwrap (handle written, record still "creating"); four (namespace,
    microvm) only their cgroups with a task in them, with or without their state dir
    (killed before any handle was stored). After the restart none leaves a process, cgroup, netns, slot or identity;
    every record says why, and its failure is audited."""
    from egress.identity import IdentityStore
    from sandbox_runtime import ids as sandbox_ids
    from sandbox_runtime.backend import Limits, SandboxSpec
    from sandbox_runtime.cgroups import SandboxCgroups
    from sandbox_runtime.namespace import NamespaceBackend
    from sandbox_runtime.state import SandboxRecord, StateStore
    gw, sw = rt
    ns_state, vm_state = gw.state_dir / "runtime" / "namespace", gw.state_dir / "runtime" / "microvm"
    ns = NamespaceBackend(ns_state)
    net = sw.attach_sandbox("sb-halfmade")
    made = ns.create(SandboxSpec("sb-halfmade", "acme"), net.netns, ip=net.ip, gateway_ip=HUB_IP)
    # killed before any handle was stored: a state dir and cgroups, or only the cgroups
    partial = {"sb-nohandle": ("namespace", ns_state, True), "sb-cgonly": ("namespace", ns_state, False),
               "vm-nohandle": ("microvm", vm_state, True), "vm-cgonly": ("microvm", vm_state, False)}
    cgs, tasks = [], []
    try:
        for sid, (_, sdir, with_dir) in partial.items():
            if with_dir:
                (sdir / sid).mkdir(mode=0o700, parents=True)
            cgs.append(SandboxCgroups.create(sid, Limits(), group=sandbox_ids.instance_name(sdir)))
            tasks.append(subprocess.Popen(["sleep", "300"]))
            for procs in cgs[-1].procs_files():
                Path(procs).write_text(str(tasks[-1].pid))
        gw.proc.kill()          # the crash: SIGKILL, nothing of the daemon runs after it
        gw.proc.wait(10)
        idents = IdentityStore(gw.state_dir / "identities.db")
        idents.add("sb-halfmade", {"tenant": "acme"}, replace=True)
        idents.close()
        store = StateStore(gw.state_dir / "runtime" / "sandboxes.sqlite3")
        for sid, backend in (("sb-halfmade", "namespace"), *((s, b) for s, (b, _, _) in partial.items())):
            assert store.insert_new(SandboxRecord(sid, "acme", backend))
        store.close()
        gw.start()
        ls = {s["id"]: s for s in json.loads(cli(lab, gw, "ls", "--json").stdout)}
        for sid, sdir in (("sb-halfmade", ns_state), *((s, d) for s, (_, d, _) in partial.items())):
            assert (ls[sid]["state"], ls[sid]["error"]) == ("failed", "creation interrupted by a daemon restart")
            assert not (sdir / sid).exists()
            r = gw.wait_record(lambda r, sid=sid: r.get("sandbox") == sid
                               and r.get("extra", {}).get("action") == "sandbox.failed")
            assert r["reason"] == "creation interrupted by a daemon restart", r
        pid = made.data["bwrap_pid"]
        assert not Path(f"/proc/{pid}/status").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
        assert [t.wait(10) for t in tasks] == [-9] * len(partial)
        assert not any(cg.exists() for cg in cgs)
        assert not SandboxCgroups.from_json(made.data["cgroups"]).exists()
        assert sw.sandbox("sb-halfmade") is None and not Path(f"/run/netns/{net.netns}").exists()
        idents = IdentityStore(gw.state_dir / "identities.db")
        assert idents.get("sb-halfmade") is None
        idents.close()
        # the capacity they held is free again: failed records are not charged
        assert 'cubegate_host_reserved{resource="sandboxes"} 0.0' in gw.ops("/metrics").stdout
    finally:
        for t in tasks:
            t.kill()
            t.wait()
        ns.destroy(made)
        for cg in cgs:
            cg.kill_all()
            cg.remove()
        sw.detach_sandbox("sb-halfmade")
        for sid in ("sb-halfmade", *partial):
            cli(lab, gw, "rm", sid, check=False)


@pytest.mark.slow
def test_microvm_sandbox_through_the_daemon(rt, lab):
    """Same API, strong-isolation backend: a QEMU microVM started from the shared template."""
    gw, sw = rt
    ca_b64 = __import__("base64").b64encode(gw.sandbox_ca.read_bytes()).decode()
    result = {}
    creator = threading.Thread(target=lambda: result.update(r=api(
        lab, gw, "POST", "/sandboxes", json={"id": "vm-api", "tenant": "acme", "backend": "microvm",
                                             "files": {"ca.pem": ca_b64}})))
    creator.start()
    try:
        # While it is being created, a destroy is refused (the create undoes itself on failure);
        # it must not leave a "running" record without network or identity behind.
        # Polled until the record shows or the create returns (under load its first look can
        # come late): 404 is all a GET may say before the record exists.
        seen, deadline = None, time.monotonic() + 120
        while seen is None and creator.is_alive() and time.monotonic() < deadline:
            r = api(lab, gw, "GET", "/sandboxes/vm-api")
            if r.status_code == 200:
                seen = r.json()
            else:
                assert r.status_code == 404, r.text
                time.sleep(0.01)
        if seen is not None and seen["state"] == "creating":
            assert api(lab, gw, "DELETE", "/sandboxes/vm-api").status_code == 409
    finally:
        creator.join(120)
    assert result["r"].status_code == 201, result["r"].text
    sb = result["r"].json()
    try:
        assert sb["backend"] == "microvm" and sb["state"] == "running"
        r = sexec(lab, gw, "vm-api", "sh", "-c", "cat /proc/version; ip -4 addr show eth0", check=True)
        assert "Linux version" in r.stdout and f"{sb['ip']}/" in r.stdout
        r = sexec(lab, gw, "vm-api", "sh", "-c", "timeout 10 wget -q -O - http://api.allowed.test/vm-api-allow")
        assert r.returncode == 0, (r, gw.log()[-2000:])
        rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/vm-api-allow")
        assert rec["sandbox"] == "vm-api" and rec["decision"] == "allow"
        got = json.loads(cli(lab, gw, "get", "vm-api").stdout)
        assert got["usage"]["memory_bytes"] > 32 * 2**20      # a real VM's RSS, measured
    finally:
        cli(lab, gw, "rm", "vm-api", check=False)
    assert sw.sandbox("vm-api") is None
    assert not (gw.state_dir / "runtime" / "microvm" / "vm-api").exists()
