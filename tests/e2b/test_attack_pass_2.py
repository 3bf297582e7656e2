"""Attack pass 2 on #14 (the E2B-compatible API and envd, the process table, the kernel):
the real daemon, namespace sandboxes on the cubevs switch; raw HTTP as the SDK sends it
(so the test controls disconnects and timing). Each test asserts the secure behaviour."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from testbed.netns import call_in_netns
from tests.gateway.switchlab import HUB_IP, switch_lab

pytestmark = pytest.mark.netns

TPORT, API_PORT, E2B_PORT = 18384, 18383, 18385
BASE = f"http://127.0.0.1:{E2B_PORT}"
POLICY = """\
name: acme-agents
tenant: acme
applies_to: {labels: {tenant: acme}}
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test], ports: [443, 80]}
"""


@pytest.fixture(scope="module")
def e2b(lab, tmp_path_factory):
    settings = {"dns": {"listen_host": HUB_IP, "port": 53},
                "runtime": {"enabled": True, "api_port": API_PORT, "memory_mb": 2048, "cpus": 2.0,
                            "max_sandboxes": 8, "host_reserve_mb": 256, "default_memory_mb": 128},
                "e2b": {"enabled": True, "port": E2B_PORT, "tenant": "acme", "domain": "e2b.cubegate.test",
                        "templates": {"code-interpreter-v1": {"kind": "code-interpreter", "memory_mb": 256}}}}
    with switch_lab(lab, tmp_path_factory.mktemp("e2b-attack2"), POLICY, sandbox=None, tport=TPORT, prefix="a3",
                    settings_extra=settings) as (gw, sw, _):
        gw.key = (gw.state_dir / "runtime" / "api.token").read_text().strip()
        yield gw


def _in_gw(lab, fn, timeout: float = 90):
    return call_in_netns(lab.gw_ns, fn, timeout=timeout)


def _create(c: httpx.Client, key: str, template: str, timeout: int = 120) -> tuple[str, str]:
    r = c.post(f"{BASE}/v2/sandboxes", headers={"X-API-Key": key}, json={"templateID": template, "timeout": timeout})
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"], r.json()["envdAccessToken"]


def _envd(sid: str, token: str, port: int = 49983) -> dict:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port), "X-Access-Token": token}


def test_stuck_cells_of_one_sandbox_do_not_stall_the_e2b_api(e2b, lab):
    """FINDING: POST /execute runs core.execute in the E2B API's one shared thread pool (64
    workers) and waits for the cell up to the sandbox's end time; a client that gives up
    (timeout, retry) does not stop that wait, and a second call waits on the kernel's lock
    with no bound at all. Code in one sandbox that never finishes a cell (`while True`),
    with an SDK that retries, pins every worker: create, list, connect, files and the TTL
    reaper of every tenant then hang (the reaper runs in the same pool, so the stuck
    sandbox never even expires). The API must keep answering for others."""
    key = e2b.key

    def scenario():
        with httpx.Client(timeout=60) as c:
            sid, tok = _create(c, key, "code-interpreter-v1", timeout=120)
            # the cells end when the test says so (a file appears in the sandbox), at the latest by
            # themselves at `release` (clean-up, not part of the attack)
            release, go = time.time() + 14, "/tmp/.stuck-cells-may-end"
            code = (f"import os, time\nwhile time.time() < {release} and not os.path.exists({go!r}):\n"
                    "    time.sleep(0.05)\n")

            async def stuck(n: int) -> list[str]:
                async with httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=5.0)) as ac:
                    async def one():
                        try:
                            await ac.post(f"{BASE}/execute", headers=_envd(sid, tok, 49999), json={"code": code})
                            return "answered"
                        except httpx.TimeoutException:
                            return "client gave up"
                    return await asyncio.gather(*(one() for _ in range(n)))
            outcomes = asyncio.run(stuck(70))
            t0 = time.monotonic()
            try:
                status = c.get(f"{BASE}/v2/sandboxes", headers={"X-API-Key": key}, timeout=5).status_code
            except httpx.TimeoutException:
                status = None
            waited = time.monotonic() - t0
            stuck_throughout = time.time() < release     # the list was asked while the cells still ran
            ended = c.post(f"http://127.0.0.1:{API_PORT}/v1/sandboxes/{sid}/exec", headers={"Authorization": f"Bearer {key}"},
                           json={"argv": ["touch", go], "timeout": 10}, timeout=30).status_code == 200
            end_by = (time.time() + 1) if ended else (release + 1)
            while time.time() < end_by:
                time.sleep(0.2)
            c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key}, timeout=60)
            return outcomes, status, waited, stuck_throughout
    outcomes, status, waited, stuck_throughout = _in_gw(lab, scenario, timeout=120)
    summary = {o: outcomes.count(o) for o in set(outcomes)}
    assert status == 200 and waited < 5, f"list of sandboxes: status {status} after {waited:.1f}s; cells: {summary}"
    assert stuck_throughout, "the cells had ended before the list was answered: nothing was proven"


def test_run_code_keeps_working_after_16_mib_of_kernel_output(e2b, lab):
    """FINDING (low; feeds the one above): the kernel is one long-lived agent exec, and the
    agent caps an exec's stdout at 16 MiB for its whole life (agent.c MAX_STREAM). Once a
    code-interpreter sandbox has printed 16 MiB in all, the kernel's answers (and its
    `done` line) are dropped: every later run_code hangs until the sandbox's end time,
    holding an E2B worker thread each. A cell's output must not end the kernel."""
    key = e2b.key

    def scenario():
        with httpx.Client(timeout=60) as c:
            sid, tok = _create(c, key, "code-interpreter-v1", timeout=120)
            try:
                def cell(code: str, timeout: float):
                    got = []
                    try:
                        with c.stream("POST", f"{BASE}/execute", headers=_envd(sid, tok, 49999), json={"code": code},
                                      timeout=timeout) as r:
                            for line in r.iter_lines():
                                if '"result"' in line or '"number_of_executions"' in line:
                                    got.append(line[:200])
                    except httpx.TimeoutException:
                        got.append("timeout")
                    return got
                first = cell("import sys\nfor _ in range(9):\n    print('x' * (1 << 20))\n", 30)
                second = cell("import sys\nfor _ in range(9):\n    print('y' * (1 << 20))\n", 15)
                third = cell("40 + 2", 8)
                return first, second, third
            finally:
                c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key}, timeout=60)
    first, second, third = _in_gw(lab, scenario, timeout=150)
    assert "timeout" not in first, first
    assert "timeout" not in second and any('"42"' in x for x in third), {"second": second, "third": third}


def test_held_envd_is_per_sandbox_and_files_stay_inside(e2b, lab):
    """Held: another sandbox's id (header or Host form) with one's own token, no token, a port
    not served; files outside the sandbox (host paths, .. from home, symlinks to host
    paths, multipart filenames with ..) resolve inside the sandbox's own mount namespace."""
    key = e2b.key

    def scenario():
        out = {}
        with httpx.Client(timeout=60) as c:
            a, ta = _create(c, key, "base")
            b, tb = _create(c, key, "base")
            try:
                stat = f"{BASE}/filesystem.Filesystem/Stat"
                body = {"path": "/home/user"}
                out["own"] = c.post(stat, headers=_envd(a, ta), json=body).status_code
                out["other_by_header"] = c.post(stat, headers=_envd(b, ta), json=body).status_code
                out["other_by_host"] = c.post(stat, headers={"Host": f"49983-{b}.e2b.cubegate.test",
                                                             "X-Access-Token": ta}, json=body).status_code
                out["no_token"] = c.post(stat, headers={"E2b-Sandbox-Id": b}, json=body).status_code
                out["jupyter_on_base"] = c.post(f"{BASE}/execute", headers=_envd(a, ta, 49999),
                                                json={"code": "1"}).status_code
                # write a symlink to a host path and read through it (inside, the host's file is not there)
                w = c.post(f"{BASE}/process.Process/Start", headers={**_envd(a, ta),
                                                                    "Content-Type": "application/connect+json"},
                           content=_env_msg({"process": {"cmd": "sh", "args": ["-c",
                                            "ln -s /etc/shadow /home/user/sh; ln -s / /home/user/root"]}}))
                out["ln"] = w.status_code
                time.sleep(0.5)
                out["shadow"] = c.get(f"{BASE}/files", params={"path": "/home/user/sh"}, headers=_envd(a, ta)).status_code
                out["passwd"] = [c.get(f"{BASE}/files", params={"path": p}, headers=_envd(a, ta)).text
                                 for p in ("../../etc/passwd", "root/etc/passwd", "/proc/1/root/etc/passwd")]
                up = c.post(f"{BASE}/files", headers=_envd(a, ta),
                            files={"file": ("../../../../tmp/escaped", b"data")})
                out["upload"] = (up.status_code, up.text[:200])
                out["host_tmp_escaped"] = Path("/tmp/escaped").exists()
            finally:
                for sid in (a, b):
                    c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key})
        return out
    out = _in_gw(lab, scenario)
    assert (out["own"], out["other_by_header"], out["other_by_host"], out["no_token"]) == (200, 401, 401, 401), out
    assert out["jupyter_on_base"] == 502 and out["ln"] == 200, out
    assert out["shadow"] == 404, out                           # no /etc/shadow inside the sandbox
    assert all("sandbox:x:" in p and "/bin/bash" not in p for p in out["passwd"]), out   # the sandbox's own /etc
    assert out["upload"][0] == 200 and "/tmp/escaped" in out["upload"][1] and not out["host_tmp_escaped"], out


def _env_msg(msg: dict) -> bytes:
    import json
    import struct
    data = json.dumps(msg).encode()
    return b"\x00" + struct.pack(">I", len(data)) + data
