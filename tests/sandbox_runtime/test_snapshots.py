"""Snapshots, clones, rollback and auto-pause through the real daemon (namespace backend on
the `base` template, cubevs switch with a pool of prepared network slots, transparent
gateway, vault with a placeholder binding), plus the pure parts.

One daemon for the module with runtime.auto_pause_seconds=1 and paused_capacity=memory:
sandboxes of the other tests here are paused between their calls too, and every call
must wake them transparently."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest

from sandbox_runtime.idle import Activity
from sandbox_runtime.templates import rootfs
from tests.sandbox_runtime.daemonlab import (lab_policy, put_placeholder_secret, runtime_api, runtime_daemon,
                                             runtime_settings)
from tests.sandbox_runtime.daemonlab import sandbox_cli as cli

pytestmark = pytest.mark.netns

CACHE = Path(os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates"))
TPORT, API_PORT = 18068, 18069      # below the harness's port range; unlike the other daemon tests
SECRET = "sk-live-snapshot-1a2b3c4d5e6f7a8b"
POOL_SIZE = 2
IDLE_S = 1.0
POLICY = lab_policy("snap-agents")


# ------------------------------------------------------------------ pure parts

def test_activity_idle_time_counts_calls_and_traffic_not_first_sight():
    now = [100.0]
    a = Activity(clock=lambda: now[0])
    assert a.idle_for("s") == 0.0                 # first seen: used now (a restart pauses nobody at once)
    a.traffic({"s": 10})                          # a first reading is a baseline, not use
    now[0] = 103.0
    assert a.due(["s"], 3.0) == ["s"]
    a.traffic({"s": 10})                          # unchanged counters: still idle
    assert a.idle_for("s") == 3.0
    a.traffic({"s": 11})                          # bytes moved: used now
    assert a.idle_for("s") == 0.0
    a.begin("s")                                  # a call in flight is never idle, however long
    now[0] = 200.0
    assert a.due(["s"], 3.0) == []
    a.end("s")
    now[0] = 202.0
    assert a.idle_for("s") == 2.0 and a.due(["s"], 3.0) == []
    a.forget("s")
    assert a.idle_for("s") == 0.0


def test_replace_tokens_in_a_layer_keeps_lengths_and_skips_non_files(tmp_path):
    old, new = b"cgph_" + b"A" * 32, b"cgph_" + b"B" * 32
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "env").write_bytes(b"KEY=" + old + b"\nX=" + old)
    (tmp_path / "bin").write_bytes(b"\0\1" + old + b"\xff" * 5)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "other").write_bytes(b"nothing here")
    (tmp_path / "link").symlink_to(tmp_path / "d" / "env")
    os.mkfifo(tmp_path / "fifo")
    assert rootfs.replace_tokens(tmp_path, {old: new}) == 2
    assert (tmp_path / "d" / "env").read_bytes() == b"KEY=" + new + b"\nX=" + new
    assert (tmp_path / "bin").read_bytes() == b"\0\1" + new + b"\xff" * 5
    assert (tmp_path / "other").read_bytes() == b"nothing here"
    with pytest.raises(rootfs.RootfsError, match="equal length"):
        rootfs.replace_tokens(tmp_path, {old: b"short"})


@pytest.mark.parametrize("inherited, requested, want", [
    ({}, {"allow": ["api.x.com"], "deny": ["b.x.com"]}, {"allow": ["api.x.com"], "deny": ["b.x.com"]}),
    ({"deny": ["*"]}, {}, {"allow": [], "deny": ["*"]}),                    # allow_internet_access=false stays
    ({"deny": ["*"]}, {"allow": ["api.x.com"]}, {"allow": ["api.x.com"], "deny": ["*"]}),  # deny still wins
    ({"deny": ["a.x.com"]}, {"deny": ["a.x.com", "c.x.com"]}, {"allow": [], "deny": ["a.x.com", "c.x.com"]}),
    ({"allow": ["*.x.com", "10.0.0.0/8"]}, {"allow": ["api.x.com:443", "*.b.x.com", "10.1.0.0/16:5432"]},
     {"allow": ["api.x.com:443", "*.b.x.com", "10.1.0.0/16:5432"], "deny": []}),
    ({"allow": ["api.x.com:443"]}, {}, {"allow": ["api.x.com:443"], "deny": []}),
])
def test_a_clone_network_is_the_inherited_one_narrowed(inherited, requested, want):
    from egress.policy.network import narrow_further, parse_network
    assert narrow_further(parse_network(inherited), parse_network(requested)).to_doc() == want


@pytest.mark.parametrize("inherited, allow", [
    ({"allow": ["api.x.com"]}, "other.x.com"),
    ({"allow": ["api.x.com"]}, "*.api.x.com"),        # an exact name covers no wildcard
    ({"allow": ["*.x.com"]}, "x.com"),                # *.x.com is strict subdomains only
    ({"allow": ["*.x.com"]}, "evil-x.com"),
    ({"allow": ["api.x.com:443"]}, "api.x.com"),      # every port is wider than 443
    ({"allow": ["10.0.0.0/16"]}, "10.0.0.0/8"),
    ({"allow": ["api.x.com"]}, "198.18.0.10"),        # an address is not a name the list names
    ({"allow": ["10.0.0.0/8"]}, "[2001:db8::/32]"),
])
def test_a_clone_request_that_widens_is_refused(inherited, allow):
    from egress.policy import PolicyError
    from egress.policy.network import narrow_further, parse_network
    with pytest.raises(PolicyError, match=r"allow\[1\].*not within the inherited allow list"):
        narrow_further(parse_network(inherited), parse_network({"allow": [inherited["allow"][0], allow]}))


# ------------------------------------------------------------------ the daemon

def _vault(gw) -> None:
    put_placeholder_secret(gw, SECRET)


@pytest.fixture(scope="module")
def rt(lab, tmp_path_factory):
    from sandbox_runtime.templates import TemplateStore
    if os.geteuid() != 0 or not shutil.which("mmdebstrap"):
        pytest.skip("needs root and mmdebstrap (apt)")
    TemplateStore(CACHE).build("base")          # cached on this machine: returns at once
    settings = runtime_settings(API_PORT, memory_mb=2048, cpus=2.0, max_sandboxes=8, host_reserve_mb=256,
                                template_cache=str(CACHE), default_template="base", pool_size=POOL_SIZE,
                                auto_pause_seconds=IDLE_S, paused_capacity="memory")
    with runtime_daemon(lab, tmp_path_factory.mktemp("snap"), POLICY, tport=TPORT, prefix="cq",
                        settings=settings, before_start=_vault) as (gw, sw):
        yield gw, sw


def api(lab, gw, method: str, path: str, **kw) -> httpx.Response:
    return runtime_api(lab, gw, API_PORT, method, path, **kw)


def sh(lab, gw, sid: str, script: str) -> str:
    r = api(lab, gw, "POST", f"/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", script], "timeout": 20})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, (script, r.text)
    return r.json()["stdout"]


def _sid(tag: str) -> str:
    return f"sq{tag}-{uuid.uuid4().hex[:6]}"


def create(lab, gw, sid: str) -> dict:
    return json.loads(cli(lab, gw, "create", sid, "--tenant", "acme", "--secret-env", "OPENAI_API_KEY=openai",
                          "--json").stdout)


def rm(lab, gw, *sids: str) -> None:
    cli(lab, gw, "rm", *sids, check=False)


def _auth_seen(lab, gw, sid: str, bearer: str, path: str) -> list[str]:
    out = sh(lab, gw, sid, f"curl -s --max-time 10 -H 'Authorization: Bearer {bearer}' https://echo.allowed.test{path}")
    return [v for k, v in json.loads(out)["header_list"] if k.lower() == "authorization"]


def test_a_clone_has_its_own_identity_placeholders_and_traffic(rt, lab):
    gw, sw = rt
    parent, clones = _sid("p"), [_sid("c1"), _sid("c2")]
    try:
        p = create(lab, gw, parent)
        assert p["template"] == "base"
        p_ph = sh(lab, gw, parent, "echo $OPENAI_API_KEY").strip()
        assert p_ph.startswith("cgph_")
        sh(lab, gw, parent, "echo $OPENAI_API_KEY > key.txt; echo kept > mark; mkdir -p d; echo x > d/f")
        snap = json.loads(cli(lab, gw, "snapshot", parent, "--json").stdout)
        assert snap["sandbox"] == parent and snap["template"] == "base" and snap["size_bytes"] > 0
        out = json.loads(cli(lab, gw, "clone", snap["id"], *clones, "--secret-env", "OPENAI_API_KEY=openai",
                             "--json").stdout)
        assert [c["id"] for c in out] == clones and all(c["state"] == "running" for c in out)
        ips = {p["ip"], *(c["ip"] for c in out)}
        assert len(ips) == 3                                       # each its own address
        seen = {p_ph}
        for c in clones:
            r = sh(lab, gw, c, "cat mark d/f; cat /etc/hostname; echo $HOSTNAME; echo $OPENAI_API_KEY; cat key.txt")
            mark, f, hostname, env_host, env_ph, file_ph = r.split()
            assert (mark, f) == ("kept", "x")                      # the snapshot's files
            assert hostname == env_host == c                       # its own identity
            assert env_ph.startswith("cgph_") and env_ph not in seen   # its own placeholder, not the parent's
            assert file_ph == env_ph                               # the copied file holds the clone's own
            seen.add(env_ph)
            # its traffic is its own: injected for its placeholder, audited under its id
            assert _auth_seen(lab, gw, c, env_ph, f"/clone-{c}") == ["Bearer [REDACTED]"]
            rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == f"/clone-{c}")
            assert rec["sandbox"] == c and rec["extra"]["secret"] == "openai", rec
            # the gateway knows its placeholder as its own: headed to an unbound host, a leak of this clone
            code = sh(lab, gw, c, "curl -s -o /dev/null -w '%{http_code}' --max-time 10 -H "
                                  f"\"Authorization: Bearer $OPENAI_API_KEY\" http://api.allowed.test/leak-{c}")
            assert code == "403", code
            rec = gw.wait_record(lambda x: x.get("path") == f"/leak-{c}" and x["decision"] == "deny")
            assert rec["sandbox"] == c and rec["reason"] == "credential_leak", rec
            # and nothing of the parent's placeholder is left anywhere in its files
            assert sh(lab, gw, c, f"grep -rl {p_ph} /workspace /tmp /etc 2>/dev/null; true") == ""
        # the snapshot is listed, and the clone call was audited with its snapshot
        listed = json.loads(cli(lab, gw, "snapshots", "--json").stdout)
        assert snap["id"] in [s["id"] for s in listed]
        rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "snapshot.clone.post")
        assert rec["extra"]["snapshot"] == snap["id"] and rec["status"] == 201, rec
        assert SECRET not in gw.log_path.read_text(errors="replace")
    finally:
        rm(lab, gw, parent, *clones)


def test_clone_is_all_or_none_and_refuses_a_taken_id(rt, lab):
    gw, sw = rt
    parent = _sid("p")
    try:
        create(lab, gw, parent)
        snap = json.loads(cli(lab, gw, "snapshot", parent, "--name", f"{parent}-s", "--json").stdout)
        fresh = _sid("n")
        r = api(lab, gw, "POST", f"/snapshots/{snap['id']}/clone", json={"ids": [fresh, parent]})
        assert r.status_code == 409, r.text
        assert api(lab, gw, "GET", f"/sandboxes/{fresh}").status_code == 404     # the first one was undone
        assert sw.sandbox(fresh) is None
        r = api(lab, gw, "POST", f"/snapshots/{snap['id']}/clone", json={"ids": [fresh], "env": {"K": SECRET}})
        assert r.status_code == 400 and "secret(s) openai" in r.json()["message"] and SECRET not in r.text
        assert api(lab, gw, "POST", "/snapshots/nope-1/clone", json={"ids": [fresh]}).status_code == 404
        assert api(lab, gw, "DELETE", f"/snapshots/{snap['id']}").status_code == 204
        assert api(lab, gw, "GET", f"/snapshots/{snap['id']}").status_code == 404
    finally:
        rm(lab, gw, parent)


def _reach(lab, gw, sid: str, url: str) -> str:
    return sh(lab, gw, sid, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 10 {url} || true")


def test_a_clone_inherits_its_parents_network_narrowing(rt, lab):
    gw, sw = rt
    narrow, closed, clone, clone2, clone3 = _sid("n"), _sid("x"), _sid("nc"), _sid("xc"), _sid("nd")
    try:
        narrowing = {"allow": ["api.allowed.test", "echo.allowed.test"], "deny": ["echo.allowed.test"]}
        for sid, network in ((narrow, narrowing), (closed, {"deny": ["*"]})):
            r = api(lab, gw, "POST", "/sandboxes", json={"id": sid, "tenant": "acme", "network": network})
            assert r.status_code == 201, r.text
        assert _reach(lab, gw, narrow, "http://api.allowed.test/n") == "200"
        assert _reach(lab, gw, narrow, "http://echo.allowed.test/n") != "200"
        snap = api(lab, gw, "POST", f"/sandboxes/{narrow}/snapshot", json={}).json()
        assert snap["network"] == narrowing, snap
        # a clone that asks for nothing is refused what its parent was refused
        r = api(lab, gw, "POST", f"/snapshots/{snap['id']}/clone", json={"ids": [clone]})
        assert r.status_code == 201, r.text
        assert _reach(lab, gw, clone, "http://api.allowed.test/clone-ok") == "200"
        assert _reach(lab, gw, clone, "http://echo.allowed.test/clone-dns") != "200"     # its resolver refuses
        echo_ip = lab.hosts["echo.allowed.test"]                                         # and so does the gateway
        pinned = f"--resolve echo.allowed.test:80:{echo_ip} http://echo.allowed.test/clone-ip"
        assert _reach(lab, gw, clone, pinned) == "403"
        rec = gw.wait_record(lambda x: x.get("sandbox") == clone and x.get("path") == "/clone-ip", timeout=10)
        assert rec["decision"] == "deny" and rec["reason"] == "sandbox_network_deny", rec
        # narrowed further through the CLI: the deny lists add up, and a clone of that clone inherits both
        out = json.loads(cli(lab, gw, "clone", snap["id"], clone3, "--deny", "api.allowed.test:80", "--json").stdout)
        assert out[0]["state"] == "running"
        assert _reach(lab, gw, clone3, "http://api.allowed.test/clone3") != "200"
        snap4 = api(lab, gw, "POST", f"/sandboxes/{clone3}/snapshot", json={}).json()
        assert snap4["network"] == {"allow": narrowing["allow"],
                                    "deny": ["echo.allowed.test", "api.allowed.test:80"]}, snap4
        # allow_internet_access=false (deny *): the clone has no egress either, and asking for an
        # allow list does not open it (deny wins)
        snap2 = api(lab, gw, "POST", f"/sandboxes/{closed}/snapshot", json={}).json()
        r = api(lab, gw, "POST", f"/snapshots/{snap2['id']}/clone",
                json={"ids": [clone2], "network": {"allow": ["api.allowed.test"]}})
        assert r.status_code == 201, r.text
        assert _reach(lab, gw, clone2, "http://api.allowed.test/closed") != "200"
        # a request to widen is refused (400, nothing started), not silently dropped
        wider = _sid("w")
        r = api(lab, gw, "POST", f"/snapshots/{snap['id']}/clone",
                json={"ids": [wider], "network": {"allow": ["api.allowed.test", "passthrough.allowed.test"]}})
        assert r.status_code == 400 and "not within the inherited allow list" in r.json()["message"], r.text
        assert api(lab, gw, "GET", f"/sandboxes/{wider}").status_code == 404 and sw.sandbox(wider) is None
    finally:
        rm(lab, gw, narrow, closed, clone, clone2, clone3)


def test_rollback_restores_the_files_and_keeps_identity_and_env(rt, lab):
    gw, sw = rt
    sid = _sid("r")
    try:
        sb = create(lab, gw, sid)
        ph = sh(lab, gw, sid, "echo $OPENAI_API_KEY").strip()
        sh(lab, gw, sid, "echo one > a; rm -f /tmp/t")
        snap = json.loads(cli(lab, gw, "snapshot", sid, "--json").stdout)
        sh(lab, gw, sid, "echo two > a; echo new > b; (sleep 300 >/dev/null 2>&1 &)")
        assert "sleep 300" in sh(lab, gw, sid, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
        cli(lab, gw, "rollback", sid, snap["id"])
        r = sh(lab, gw, sid, "cat a; test -e b && echo b-exists; echo $OPENAI_API_KEY; cat /etc/hostname")
        assert r.split() == ["one", ph, sid], r                    # files back, same env and identity
        assert "sleep 300" not in sh(lab, gw, sid, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")   # not kept
        got = api(lab, gw, "GET", f"/sandboxes/{sid}").json()
        assert got["state"] == "running" and got["ip"] == sb["ip"] and sw.lookup_by_ip(sb["ip"]) == sid
        rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.rollback.post")
        assert rec["sandbox"] == sid and rec["extra"]["snapshot"] == snap["id"] and rec["status"] == 200
    finally:
        rm(lab, gw, sid)


def _freezer_state(sid: str) -> str:
    v1 = list(Path("/sys/fs/cgroup/freezer/cubegate").glob(f"*/{sid}/freezer.state"))
    if v1:
        assert len(v1) == 1, v1
        return v1[0].read_text().strip()
    (events_path,) = Path("/sys/fs/cgroup/cubegate").glob(f"*/{sid}/cgroup.events")
    events = events_path.read_text()
    return "FROZEN" if "frozen 1" in events else "THAWED"


def _metric(text: str, name: str, labels: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_idle_sandbox_is_frozen_and_the_next_exec_resumes_it(rt, lab):
    gw, _ = rt
    sid = _sid("i")
    try:
        create(lab, gw, sid)
        (root,) = Path("/run/cubegate/roots").glob(f"*/{sid}")     # <instance>/<sandbox id>
        counter = root / "rw/upper/workspace/n"                     # its writable layer, seen from the host
        # busy inside, but no call and no traffic: that is idle
        sh(lab, gw, sid, "(i=0; while :; do i=$((i+1)); echo $i > n; sleep 0.05; done >/dev/null 2>&1 &)")
        _wait(lambda: api(lab, gw, "GET", f"/sandboxes/{sid}").json()["state"] == "paused", 30 * IDLE_S + 20,   # generous: a loaded 2-core CI box ticks late
              "auto-pause")      # (a GET is no use of the sandbox: it does not wake it)
        got = api(lab, gw, "GET", f"/sandboxes/{sid}").json()
        assert got["paused_by"] == "idle" and _freezer_state(sid) == "FROZEN"
        before = counter.read_text()
        time.sleep(0.3)
        assert counter.read_text() == before                      # its processes really stopped
        rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.auto_pause"
                             and x["sandbox"] == sid)
        assert rec["extra"]["actor"] == "runtime" and rec["reason"].startswith("idle "), rec
        metrics = gw.ops("/metrics").stdout
        assert _metric(metrics, "cubegate_sandboxes_paused", 'backend="namespace",by="idle"') >= 1
        assert _metric(metrics, "cubegate_sandbox_auto_pauses_total", 'backend="namespace"') >= 1
        # paused_capacity=memory: its CPUs are free for others, its memory stays reserved
        assert _metric(metrics, "cubegate_host_reserved", 'resource="cpus"') == 0.0
        assert _metric(metrics, "cubegate_host_reserved", 'resource="memory_bytes"') >= 256 * 2**20
        # the next exec wakes it, transparently
        r = cli(lab, gw, "exec", sid, "--", "cat", "n")
        assert r.returncode == 0 and int(r.stdout) >= int(before)
        assert _freezer_state(sid) == "THAWED"
        assert int(_wait(lambda: counter.read_text().strip() if counter.read_text() != before else None, 5,
                         "the loop to run again")) > int(before)
        rec = gw.wait_record(lambda x: x["event"] == "admin" and x["extra"].get("action") == "sandbox.auto_resume"
                             and x["sandbox"] == sid)
        assert "resumed by a call" in rec["reason"], rec
    finally:
        rm(lab, gw, sid)


def test_an_idle_sandbox_can_be_narrowed_while_paused_and_resumes_under_it(rt, lab):
    """Network options are gateway state: a PUT on an auto-paused sandbox is taken (not 409) and
    does not wake it; when the next call wakes it, its traffic is under the narrowed options."""
    gw, _ = rt
    sid = _sid("np")
    try:
        create(lab, gw, sid)
        assert _reach(lab, gw, sid, "http://api.allowed.test/before") == "200"
        _wait(lambda: api(lab, gw, "GET", f"/sandboxes/{sid}").json()["state"] == "paused", 30 * IDLE_S + 20,
              "auto-pause")
        r = api(lab, gw, "PUT", f"/sandboxes/{sid}/network", json={"deny": ["api.allowed.test"]})
        assert r.status_code == 200, r.text
        got = api(lab, gw, "GET", f"/sandboxes/{sid}").json()
        assert got["state"] == "paused" and got["paused_by"] == "idle", got      # not woken by the change
        assert _freezer_state(sid) == "FROZEN"
        api_ip = lab.hosts["api.allowed.test"]                     # refused by the gateway, not only by DNS
        pinned = f"--resolve api.allowed.test:80:{api_ip} http://api.allowed.test/after-pause"
        assert _reach(lab, gw, sid, pinned) == "403"               # this exec wakes it
        rec = gw.wait_record(lambda x: x.get("sandbox") == sid and x.get("path") == "/after-pause", timeout=10)
        assert rec["decision"] == "deny" and rec["reason"] == "sandbox_network_deny", rec
        assert _reach(lab, gw, sid, "http://echo.allowed.test/still") == "200"   # only what was denied
    finally:
        rm(lab, gw, sid)


def test_traffic_keeps_a_sandbox_awake(rt, lab):
    """One exec runs a loop of requests far longer than the idle time; while it runs the call
    itself is in flight — so the loop is started in the background, and the exec returns."""
    gw, _ = rt
    sid = _sid("t")
    try:
        create(lab, gw, sid)
        sh(lab, gw, sid, "(for i in $(seq 40); do curl -s -o /dev/null --max-time 2 http://api.allowed.test/keep;"
                         " sleep 0.1; done >/dev/null 2>&1 &)")
        t_end = time.monotonic() + 3 * IDLE_S
        while time.monotonic() < t_end:
            assert api(lab, gw, "GET", f"/sandboxes/{sid}").json()["state"] == "running"
            time.sleep(0.2)
    finally:
        rm(lab, gw, sid)


def test_the_pool_hands_each_sandbox_a_prepared_slot_once(rt, lab):
    gw, sw = rt
    _wait(lambda: len(sw.slots()) == POOL_SIZE, 20, "the pool to fill")
    ready = {sw.sandbox(t).netns for t in sw.slots()}
    a, b = _sid("pa"), _sid("pb")
    try:
        create(lab, gw, a)
        create(lab, gw, b)
        na, nb = sw.sandbox(a).netns, sw.sandbox(b).netns
        assert na != nb and {na, nb} <= ready                      # both from the pool
        _wait(lambda: len(sw.slots()) == POOL_SIZE, 20, "the pool to refill")
        assert not {sw.sandbox(t).netns for t in sw.slots()} & {na, nb}   # never handed out again
        assert sh(lab, gw, a, "cat /etc/hostname").strip() == a
    finally:
        rm(lab, gw, a, b)
    assert sw.sandbox(a) is None and not Path(f"/run/netns/{na}").exists()   # torn down, not returned
    assert len(sw.slots()) <= POOL_SIZE
