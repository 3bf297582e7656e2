"""The unmodified e2b / e2b-code-interpreter SDKs against the real daemon: namespace
sandboxes on the cubevs switch, the transparent gateway, sandbox DNS and the vault.

The SDK runs in a subprocess in the lab's gw namespace (where the daemon's loopback API
listens: its HTTP client is Rust, so a setns'd Python thread would not do), with only the
E2B_* variables the README names; tests/e2b/sdk_driver.py reports what it saw."""
from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

from testbed.netns import call_in_netns
from tests.sandbox_runtime.daemonlab import (REPO, lab_policy, put_placeholder_secret, runtime_daemon, runtime_settings,
                                             runtime_token)

pytestmark = pytest.mark.netns
pytest.importorskip("e2b")
pytest.importorskip("e2b_code_interpreter")

TPORT, API_PORT, E2B_PORT = 18174, 18173, 18175
SECRET = "sk-live-e2b-8a7b6c5d4e3f2a1b0c9d"
POLICY = lab_policy()


def _vault(gw) -> None:
    put_placeholder_secret(gw, SECRET)


@pytest.fixture(scope="module")
def e2b(lab, tmp_path_factory):
    settings = {**runtime_settings(API_PORT, memory_mb=4096, cpus=2.0, max_sandboxes=16, host_reserve_mb=256,
                                   default_memory_mb=128),
                "e2b": {"enabled": True, "port": E2B_PORT, "tenant": "acme", "domain": "e2b.cubegate.test",
                        "templates": {"code-interpreter-v1": {"kind": "code-interpreter", "memory_mb": 256}}}}
    with runtime_daemon(lab, tmp_path_factory.mktemp("e2b"), POLICY, tport=TPORT, prefix="ce",
                        settings=settings, before_start=_vault) as (gw, _):
        yield gw


def drive(lab, gw, scenario: str, *args: str, timeout: float = 240) -> dict:
    key = runtime_token(gw)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=f"http://127.0.0.1:{E2B_PORT}", E2B_SANDBOX_URL=f"http://127.0.0.1:{E2B_PORT}",
               E2B_API_KEY=key, E2B_DOMAIN="e2b.cubegate.test", PYTHONPATH=str(REPO))
    r = lab.run_gw([sys.executable, "-m", "tests.e2b.sdk_driver", scenario, *args], lab_dns=False, cwd=REPO,
                   env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "driver_error" not in out, out["driver_error"] + "\n" + gw.log()[-3000:]
    return out


def test_control_plane_commands_and_files(e2b, lab):
    out = drive(lab, e2b, "lifecycle")
    info = out["info"]
    assert info["template"] == "base" and info["metadata"] == {"suite": "e2b-a"} and info["state"] == "running"
    assert 119 <= info["window"] <= 121 and info["mem"] == 128 and out["running"] is True
    assert len(out["pages"]) == 2 and all(len(p) == 1 for p in out["pages"])   # paging with X-Next-Token
    assert sorted(i for p in out["pages"] for i in p) == out["ids"]
    assert out["window_after"] > 590
    assert out["metrics"]["n"] == 1 and out["metrics"]["mem_total"] == 128 << 20 and out["metrics"]["mem_used"] > 0
    run = out["run"]
    assert run["stdout"] == "hello\n/home/user\nsandbox\n1000\n" and run["stderr"] == "oops\n" and run["exit"] == 0
    assert run["cb_out"] == run["stdout"] and run["cb_err"] == "oops\n"
    assert out["exit_exc"] == {"type": "CommandExitException", "code": 7, "stdout": "before\n"}
    # live: the first tick arrives while the command still runs (~0.8 s before its end)
    ticks = out["live"]
    assert [t[1] for t in ticks] == ["tick1\n", "tick2\n", "tick3\n"] and ticks[2][0] - ticks[0][0] > 0.5
    assert out["bg_pid"] in out["listed"] and out["killed"] is True
    # connect(pid) replayed what the process wrote before; SIGKILL reads as exit code -1 (as envd says)
    assert out["after_kill"] == {"type": "CommandExitException", "code": -1, "stdout": "got:abc\n"}
    assert out["bg_pid"] not in out["listed_after"] and out["bg_wait"] == "done-bg\n" and out["kill_gone"] is False
    assert out["envs_per_cmd"] == "x1\n" and out["cwd_cmd"] == "/tmp\n"
    assert out["read_text"] == "hi there" and out["big"] == {"len": 20 * (1 << 20) + 4, "same": True}
    assert out["exists"] == [True, False]
    assert out["info_file"] == {"name": "hello.txt", "type": "file", "size": 8, "path": "/home/user/notes/hello.txt"}
    assert out["mkdir"] == [True, False]
    assert out["list"] == [["d2", "dir"], ["moved.txt", "file"]]
    assert out["list_depth2"] == ["/home/user/d1/d2", "/home/user/d1/moved.txt"]
    assert out["exists_after_remove"] is False and out["read_missing"]["type"] == "FileNotFoundException"
    assert out["paused_state"] == "paused" and out["resumed_state"] == "running" and out["after_resume"] == "alive\n"
    assert out["kill"] == [True, True, False] and out["running_after_kill"] is False
    assert out["connect_killed"]["type"] == "SandboxNotFoundException"
    assert out["unknown_template"]["type"] == "NotFoundException" or "not found" in out["unknown_template"]["message"]
    assert "dns" in out["network_opt"]["message"].lower()    # network options cubegate cannot honour: refused


def test_run_code_keeps_state_and_reports_errors(e2b, lab):
    out = drive(lab, e2b, "code")
    assert out["first"] == {"stdout": ["side effect\n"], "text": "42", "error": False}
    assert out["state"] == "400"
    err = out["error"]
    assert err["name"] == "ZeroDivisionError" and err["value"] == "division by zero" and err["tb"]
    assert err["stdout"] == ["cell-env\n"] and err["cb"] == ["cell-env\n"]
    assert out["after_error"] == "40" and out["cmd_too"] == "from-shell\n"


def test_egress_policy_and_credentials_from_inside_an_e2b_sandbox(e2b, lab):
    out = drive(lab, e2b, "network", str(e2b.sandbox_ca))
    assert out["allowed"] == "200"
    assert out["denied"] is not None and out["denied"]["type"] == "CommandExitException"
    assert out["placeholder"].startswith("cgph_") and SECRET not in out["placeholder"]
    auth = [v for k, v in out["echo"]["header_list"] if k.lower() == "authorization"]
    assert auth == ["Bearer [REDACTED]"]      # the upstream got the real key; the sandbox sees it scrubbed
    rec = e2b.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/e2b-inject")
    assert rec["sandbox"] == out["sid"] and rec["extra"]["secret"] == "openai"
    assert SECRET not in json.dumps(out) and SECRET not in e2b.log()


def test_e2b_network_options_narrow_the_tenant_policy(e2b, lab):
    """allowOut/denyOut and allow_internet_access map onto the per-sandbox network options
    (attack pass 2): the tenant's policy allows api. and echo.allowed.test, never evil.test."""
    out = drive(lab, e2b, "network_opts", str(e2b.sandbox_ca))

    def code(case, host):
        got = out[case]
        assert "error" not in got, (case, got)
        return got[host]
    assert code("only_api", "api.allowed.test") == "200"
    assert code("only_api", "echo.allowed.test") != "200" and code("only_api", "evil.test") != "200"
    assert code("deny_echo", "api.allowed.test") == "200" and code("deny_echo", "echo.allowed.test") != "200"
    assert all(code("no_internet", h) != "200" for h in ("api.allowed.test", "echo.allowed.test", "evil.test"))
    rec = e2b.wait_record(lambda x: x.get("host") == "echo.allowed.test" and x.get("decision") == "deny")
    # the sandbox resolver already refuses the name (the narrowing applies to DNS too), else the gate
    assert rec["reason"] == "dns_not_allowed" or rec["reason"].startswith("sandbox_network"), rec


def test_real_secret_values_are_refused_everywhere(e2b, lab):
    out = drive(lab, e2b, "secrets", SECRET)
    for key in ("create_env", "create_meta", "cmd", "cmd_env", "write"):
        assert out[key] is not None and "openai" in out[key]["message"], (key, out[key])
        assert SECRET not in out[key]["message"]
    assert out["file_there"] is False and out["ok_cmd"] == "fine\n"
    assert SECRET not in e2b.log()


def test_sandbox_is_killed_at_its_end_time(e2b, lab):
    out = drive(lab, e2b, "ttl")
    assert out["running_before"] is True and out["running_after"] is False and out["listed"] is False
    assert out["waited_s"] < 6


def test_envd_routing_by_host_and_access_token(e2b, lab):
    key = runtime_token(e2b)

    def calls():
        base = f"http://127.0.0.1:{E2B_PORT}"
        with httpx.Client(timeout=60) as c:
            r = c.post(f"{base}/v2/sandboxes", headers={"X-API-Key": key}, json={"templateID": "base", "timeout": 60})
            assert r.status_code == 201, r.text
            sb = r.json()
            sid, tok = sb["sandboxID"], sb["envdAccessToken"]
            host = f"49983-{sid}.e2b.cubegate.test"
            try:
                ok = c.get(f"{base}/health", headers={"Host": host, "X-Access-Token": tok}).status_code
                bad_tok = c.get(f"{base}/health", headers={"Host": host, "X-Access-Token": "nope"}).status_code
                wrong_dom = c.post(f"{base}/filesystem.Filesystem/ListDir",
                                   headers={"Host": f"49983-{sid}.evil.test", "X-Access-Token": tok},
                                   json={"path": "/home/user"}).status_code
                ls = c.post(f"{base}/filesystem.Filesystem/ListDir", headers={"Host": host, "X-Access-Token": tok},
                            json={"path": "/home/user", "depth": 1})
                no_key = c.get(f"{base}/v2/sandboxes").status_code
                other = c.get(f"{base}/sandboxes/{sid}", headers={"X-API-Key": "wrong"}).status_code
                return ok, bad_tok, wrong_dom, ls.status_code, ls.json(), no_key, other
            finally:
                c.delete(f"{base}/sandboxes/{sid}", headers={"X-API-Key": key})
    ok, bad_tok, wrong_dom, ls_status, ls, no_key, other = call_in_netns(lab.gw_ns, calls)
    assert (ok, bad_tok, ls_status, no_key, other) == (204, 401, 200, 401, 401)
    assert wrong_dom == 400          # the Host form only for the configured domain: no sandbox named
    assert "entries" in ls
