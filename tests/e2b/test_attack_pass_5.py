"""Attack pass 5 on the E2B API, the runtime API and what a sandbox can reach: the real daemon,
namespace sandboxes on the cubevs switch, the vault; raw HTTP as the SDK sends it."""
from __future__ import annotations

import httpx
import pytest
import yaml

from testbed.netns import call_in_netns
from tests.gateway.switchlab import HUB_IP, switch_lab
from tests.sandbox_runtime.daemonlab import runtime_api, sandbox_create, sandbox_sh

pytestmark = pytest.mark.netns

TPORT, API_PORT, E2B_PORT = 18484, 18483, 18485
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
    settings = {"dns": {"listen_host": HUB_IP, "port": 53, "audit_interval_seconds": 5},
                "runtime": {"enabled": True, "api_port": API_PORT, "memory_mb": 2048, "cpus": 2.0,
                            "max_sandboxes": 8, "host_reserve_mb": 256, "default_memory_mb": 128,
                            "auto_pause_seconds": 3},
                "e2b": {"enabled": True, "port": E2B_PORT, "tenant": "acme"}}
    keys = {}

    def vault_and_tenant_key(gw):
        """Before the daemon starts: a vault, an operator's admin token and globex's E2B key."""
        gw.cli("vault", "init")
        for name in ("operator", "globex"):
            keys[name] = gw.cli("vault", "token", "create", "--scope", "admin", "--description", name).strip()
        doc = yaml.safe_load(gw.settings_path.read_text())
        doc["e2b"]["token_tenants"] = {keys["globex"].split("_")[1]: "globex"}
        gw.settings_path.write_text(yaml.safe_dump(doc))

    with switch_lab(lab, tmp_path_factory.mktemp("e2b-attack5"), POLICY, sandbox=None, tport=TPORT, prefix="a5",
                    settings_extra=settings, before_start=vault_and_tenant_key) as (gw, sw, _):
        gw.keys = keys
        gw.sandbox_ca = gw.ca_cert
        yield gw


def _in_gw(lab, fn, timeout: float = 90):
    return call_in_netns(lab.gw_ns, fn, timeout=timeout)


def test_a_tenants_e2b_key_cannot_drive_the_runtime_api(e2b, lab):
    """FINDING: globex's E2B API key (e2b.token_tenants) was an admin token of the runtime API:
    it listed acme's sandboxes and ran commands in them (and read their files). Now the runtime
    API refuses it (401), while it still works on the E2B API for globex's own sandboxes; an
    operator's admin token and the runtime token file keep working (the control)."""
    sid = "attack5-acme-1"
    sandbox_create(lab, e2b, sid)
    try:
        key, operator = e2b.keys["globex"], e2b.keys["operator"]
        listed = runtime_api(lab, e2b, API_PORT, "GET", "/sandboxes", token=operator)
        assert listed.status_code == 200 and sid in listed.text, listed.text
        for method, path, body in (("GET", "/sandboxes", None), ("GET", f"/sandboxes/{sid}", None),
                                   ("POST", f"/sandboxes/{sid}/exec", {"argv": ["id"]}),
                                   ("DELETE", f"/sandboxes/{sid}", None)):
            r = runtime_api(lab, e2b, API_PORT, method, path, token=key, **({"json": body} if body else {}))
            assert r.status_code == 401, (method, path, r.status_code, r.text[:300])
        assert sandbox_sh(lab, e2b, sid, "echo alive") == (0, "alive\n")    # the DELETE did nothing

        def e2b_list():
            with httpx.Client(timeout=30, trust_env=False) as c:
                return [c.get(f"{BASE}/v2/sandboxes", headers={"X-API-Key": k}) for k in (key, operator)]
        mine, operators = _in_gw(lab, e2b_list)
        assert mine.status_code == 200 and sid not in mine.text, mine.text          # globex sees none of acme's
        assert operators.status_code == 200, operators.text
    finally:
        runtime_api(lab, e2b, API_PORT, "DELETE", f"/sandboxes/{sid}")


def test_held_a_sandbox_reaches_none_of_the_daemons_apis(e2b, lab):
    """Held: from inside a sandbox, a TCP connect to every API port of the daemon (runtime, E2B,
    vault admin, policy, ops) at the hub address, the lab address of the gateway's namespace,
    loopback and link-local/metadata gets nowhere; IPv6 (loopback, link-local) has no route."""
    sid = "attack5-probe-1"
    sandbox_create(lab, e2b, sid)
    try:
        s = yaml.safe_load(e2b.settings_path.read_text())
        ports = [API_PORT, E2B_PORT, s["vault"]["api_port"], s["policy_api"]["port"], s["ops"]["port"]]
        addrs = [HUB_IP, lab.gw_addr, "127.0.0.1", "169.254.169.254"]
        control = f"{HUB_IP}/{e2b.proxy_port}"      # the explicit proxy: the switch lets it through
        probe = " ".join([control, *(f"{a}/{p}" for a in addrs for p in ports), f"::1/{API_PORT}",
                          f"fe80::1/{API_PORT}"])
        # the probes run at once (each a connect bounded by 1 s), and every one must report: a probe
        # that never ran (a failed fork) cannot pass for a closed port
        script = (f"for t in {probe}; do (a=${{t%/*}}; p=${{t##*/}}; "
                  "if timeout 1 bash -c \"exec 3<>/dev/tcp/$a/$p\" 2>/dev/null; then echo OPEN $t; "
                  "else echo SHUT $t; fi) & done; wait; echo done")
        rc, out = sandbox_sh(lab, e2b, sid, script, timeout=120)
        assert rc == 0 and out.strip().endswith("done"), out
        reported = sorted(line.split()[1] for line in out.splitlines() if line.startswith(("OPEN ", "SHUT ")))
        assert reported == sorted(probe.split()), out
        assert out.count("OPEN") == 1 and f"OPEN {control}" in out, out
    finally:
        runtime_api(lab, e2b, API_PORT, "DELETE", f"/sandboxes/{sid}")


def test_only_an_upload_may_send_a_large_body(e2b, lab):
    """FINDING: the E2B API took every body up to e2b.max_upload_mb (256 MiB), read whole before
    the API key is checked and then parsed as JSON (several times its size in memory): a create or
    an envd RPC of 200 MiB from anyone on the host. Now only an upload (POST /files) may be that
    large; any other body over 4 MiB is a 413 before a byte of it is read. An upload of 6 MiB
    still works (the control)."""
    import socket

    def declared(path: str, length: int) -> bytes:
        s = socket.create_connection(("127.0.0.1", E2B_PORT), timeout=5)
        try:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {length}\r\n\r\n{{".encode())
            s.settimeout(3)
            try:
                return s.recv(4096)
            except socket.timeout:
                return b""
        finally:
            s.close()

    def scenario():
        out = {p: declared(p, 8 << 20)[:12] for p in ("/v2/sandboxes", "/process.Process/Start", "/execute")}
        key = e2b.keys["operator"]
        with httpx.Client(timeout=120, trust_env=False) as c:
            r = c.post(f"{BASE}/v2/sandboxes", headers={"X-API-Key": key}, json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
            try:
                blob = bytes(range(256)) * (6 * 4096)
                envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
                up = c.post(f"{BASE}/files", params={"path": "/home/user/big.bin"}, headers=envd,
                            files={"file": ("big.bin", blob)})
                back = c.get(f"{BASE}/files", params={"path": "/home/user/big.bin"}, headers=envd)
                out["upload"] = (up.status_code, back.status_code, back.content == blob)
            finally:
                c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key})
        return out
    out = _in_gw(lab, scenario, timeout=240)
    for path in ("/v2/sandboxes", "/process.Process/Start", "/execute"):
        assert out[path] == b"HTTP/1.1 413", out
    assert out["upload"] == (200, 200, True), out


def _wait(pred, timeout: float, step: float = 0.5):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    return pred()


def test_an_idle_paused_e2b_sandbox_still_ends_at_its_end_time(e2b, lab):
    """FINDING: with runtime.auto_pause_seconds, an E2B sandbox nobody used was frozen for
    idleness and the E2B reaper, which keeps paused sandboxes past their end time (as E2B keeps
    the ones a client paused), kept it forever: a tenant's forgotten sandboxes never expired and
    held their reservations. Now only a sandbox paused by the client outlives its end time."""
    key = e2b.keys["operator"]

    def scenario():
        with httpx.Client(timeout=60, trust_env=False) as c:
            r = c.post(f"{BASE}/v2/sandboxes", headers={"X-API-Key": key}, json={"templateID": "base", "timeout": 8})
            assert r.status_code == 201, r.text
            sid = r.json()["sandboxID"]
            try:
                state = lambda: c.get(f"http://127.0.0.1:{API_PORT}/v1/sandboxes/{sid}",  # noqa: E731
                                      headers={"Authorization": f"Bearer {key}"})
                paused = _wait(lambda: state().status_code == 200 and state().json()["state"] == "paused", 30)
                gone = _wait(lambda: c.get(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key}).status_code == 404,
                             40)
                return paused, gone, state().status_code
            finally:
                c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key})
    paused, gone, runtime_status = _in_gw(lab, scenario, timeout=150)
    assert paused, "never auto-paused: the test proves nothing"
    assert gone and runtime_status == 404, (gone, runtime_status)


def test_a_command_whose_output_a_client_reads_is_not_frozen(e2b, lab):
    """FINDING: an E2B command (process.Start, its output streamed to the client) counted as a
    call only while it was being started: a command quiet on the network for longer than
    auto_pause_seconds (a build, a sleep) was frozen under the client, which then waited for
    output that could not come. A stream being read now keeps the sandbox awake."""
    import json
    import struct
    key = e2b.keys["operator"]

    def envelope(doc: dict) -> bytes:
        raw = json.dumps(doc).encode()
        return struct.pack(">BI", 0, len(raw)) + raw

    def scenario():
        with httpx.Client(timeout=60, trust_env=False) as c:
            r = c.post(f"{BASE}/v2/sandboxes", headers={"X-API-Key": key}, json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
            try:
                body = envelope({"process": {"cmd": "sh", "args": ["-c", "sleep 7; echo done-after-sleep"]}})
                got = c.post(f"{BASE}/process.Process/Start", content=body, timeout=25,
                             headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": token,
                                      "Content-Type": "application/connect+json"})
                rec = c.get(f"http://127.0.0.1:{API_PORT}/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {key}"})
                return got.status_code, got.content, rec.json()
            except httpx.ReadTimeout:
                return "timeout", b"", None
            finally:
                c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": key})
    status, content, rec = _in_gw(lab, scenario, timeout=150)
    import base64
    assert status == 200 and base64.b64encode(b"done-after-sleep").decode()[:16] in content.decode(errors="replace"), \
        (status, content[-400:])
    assert rec["state"] == "running", rec


def test_a_sandbox_flooding_denied_names_cannot_flood_the_audit_log(e2b, lab):
    """FINDING: every refused lookup was one audit record: one sandbox sending random names
    (6,493 in 5 s here, 3.3 MB of records) fills a 64 MiB audit file in minutes and pushes every
    sandbox's older records out of the rotation (20 files by default) within the hour. Now at
    most 50 refusals per sandbox and interval are written one by one; the rest are counted into
    one `dns_denials_counted` record at the interval's end. Every query is still refused."""
    import json
    import time
    sid = "attack5-dnsflood-1"
    sandbox_create(lab, e2b, sid)
    try:
        script = ("python3 - <<'PY'\n"
                  "import socket, struct, time\n"
                  "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1)\n"
                  "t0, n, nx = time.monotonic(), 0, 0\n"
                  "while n < 2000 and time.monotonic() - t0 < 8:\n"
                  "    labels = [b'f%d' % n, b'denied', b'example']\n"
                  "    q = struct.pack('>HHHHHH', n & 0xffff, 0x0100, 1, 0, 0, 0) + b''.join(bytes([len(x)]) + x for x in labels)\n"
                  "    s.sendto(q + b'\\0' + struct.pack('>HH', 1, 1), ('HUB_IP', 53))\n"
                  "    try:\n"
                  "        nx += (s.recv(512)[3] & 15) == 3\n"
                  "    except OSError:\n"
                  "        pass\n"
                  "    n += 1\n"
                  "print(n, nx)\n"
                  "PY").replace("HUB_IP", HUB_IP)
        rc, out = sandbox_sh(lab, e2b, sid, script, timeout=60)
        sent, nxdomain = map(int, out.split())
        assert rc == 0 and sent > 100 and nxdomain == sent, out

        def records():
            recs = [json.loads(line) for f in sorted(e2b.audit_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]
            return [r for r in recs if r.get("event") == "dns" and r.get("sandbox") == sid and r.get("decision") == "deny"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:      # the interval's count is written at its end (5 s here)
            recs = records()
            one_by_one = [r for r in recs if r["reason"] == "dns_not_allowed"]
            counted = sum(r["extra"]["refused"] for r in recs if r["reason"] == "dns_denials_counted")
            if len(one_by_one) + counted >= sent:
                break
            time.sleep(0.5)
        assert len(one_by_one) + counted == sent, (len(one_by_one), counted, sent)
        intervals = 8 // 5 + 2
        assert len(one_by_one) <= 50 * intervals, len(one_by_one)
    finally:
        runtime_api(lab, e2b, API_PORT, "DELETE", f"/sandboxes/{sid}")


def test_held_an_exec_inherits_no_descriptor_and_cannot_reach_the_agent(e2b, lab):
    """Held: a command started through the agent holds only stdin/stdout/stderr (no agent socket,
    listening socket or pipe of another exec) and cannot read the agent's environment, memory or
    descriptors (the agent is not dumpable, though it runs as the same uid)."""
    sid = "attack5-fds-1"
    sandbox_create(lab, e2b, sid)
    try:
        rc, out = sandbox_sh(lab, e2b, sid, "ls /proc/self/fd | sort -n | tr '\\n' ' '; echo;"
                             " a=$(for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = agent ] && echo ${p#/proc/}; done | head -1); echo agent=$a;"
                             " cat /proc/$a/environ >/dev/null 2>&1 && echo ENVIRON-READ;"
                             " head -c1 /proc/$a/mem >/dev/null 2>&1 && echo MEM-READ;"
                             " ls /proc/$a/fd >/dev/null 2>&1 && echo FD-LISTED; echo end")
        lines = out.split("\n")
        assert rc == 0 and lines[0].split() == ["0", "1", "2", "3"], out     # 3: ls's own directory
        assert lines[1].startswith("agent=") and lines[1] != "agent=", out
        assert "ENVIRON-READ" not in out and "MEM-READ" not in out and "FD-LISTED" not in out, out
    finally:
        runtime_api(lab, e2b, API_PORT, "DELETE", f"/sandboxes/{sid}")
