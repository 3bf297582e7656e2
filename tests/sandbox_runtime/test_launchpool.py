"""Parked launchers and their pool (launcher.py, launchpool.py), with the real agent binary,
real cgroups and real sandboxes: a pooled launcher goes to one sandbox only, carries
nothing of one sandbox into another, leaves nothing pooled when its sandbox is destroyed,
and nothing claimable when the daemon dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

if os.geteuid() != 0:
    pytest.skip("needs root", allow_module_level=True)

from sandbox_runtime.backend import Limits, SandboxSpec  # noqa: E402
from sandbox_runtime.cgroups import SandboxCgroups, detect  # noqa: E402
from sandbox_runtime.launcher import Launcher, LauncherError, claim_message  # noqa: E402
from sandbox_runtime.launchpool import PREFIX, LauncherPool  # noqa: E402
from sandbox_runtime.namespace import NamespaceBackend  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SH_VIEW = [p for p in ("/bin", "/etc/ld.so.cache", "/lib", "/lib64", "/usr") if os.path.lexists(p)]

if detect()[0] != "v1":
    pytest.skip("the launcher pool needs cgroup v1 (rename)", allow_module_level=True)


def _group() -> str:
    return "tlp" + uuid.uuid4().hex[:8]


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pooled_cgroups(group: str) -> list[SandboxCgroups]:
    return SandboxCgroups.named(PREFIX, group=group)


def _remove_group(group: str) -> None:
    for c in ("memory", "pids", "cpu", "cpuacct", "freezer"):
        try:
            os.rmdir(f"/sys/fs/cgroup/{c}/cubegate/{group}")
        except OSError:
            pass


@pytest.fixture
def pool(agent_binary):
    group = _group()
    p = LauncherPool(agent_binary, group, 4, SH_VIEW, quiet_s=0.0)
    try:
        yield p
    finally:
        p.stop()
        _remove_group(group)


@pytest.fixture
def backend(tmp_path, agent_binary):
    b = NamespaceBackend(tmp_path / "state", launchers=3)
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    b.prepare("10.0.0.1")
    yield b
    b.close()
    _remove_group(b.instance)


def test_claim_message_refuses_root_and_nul():
    assert claim_message(1234, ["/srv/x"], ["/bin/true", "a"]) == b"1234\x001\x00/srv/x\x00/bin/true\x00a\x00"
    with pytest.raises(LauncherError, match="host root"):
        claim_message(0, [], ["/bin/true"])
    with pytest.raises(LauncherError, match="malformed"):
        claim_message(1234, [], ["/bin/true", "a\0b"])
    with pytest.raises(LauncherError, match="malformed"):
        claim_message(1234, [], [])
    for view in ([], ["usr"], ["/usr/../etc"], ["/usr", "/usr/bin"], ["/"], ["/tmp"]):
        with pytest.raises(LauncherError, match="view"):
            Launcher(Path("/bin/true"), [], view)


def test_concurrent_takes_never_share_a_launcher_and_stop_leaves_nothing(pool):
    pool.start()
    assert _wait(lambda: pool.ready() == 4)
    parked = _pooled_cgroups(pool.group)
    assert len(parked) == 4
    for cg in parked:       # each parked launcher sits in its own fresh cgroups, alone
        assert len(cg.pids()) == 1 and set(cg.paths) >= {"memory", "pids", "cpu"}
    pool.size = 0           # no refill: exactly the four are handed out
    with ThreadPoolExecutor(8) as ex:
        got = [g for g in ex.map(lambda _: pool.take(), range(8)) if g is not None]
    for _ in got:
        pool.start_done()
    assert len(got) == 4 and len({g.launcher.pid for g in got}) == 4
    assert len({tuple(sorted(g.cgroups.paths.values())) for g in got}) == 4
    assert pool.take() is None
    for g in got:
        g.discard()
    assert _wait(lambda: not any(_alive(g.launcher.pid) for g in got), 5)
    assert _pooled_cgroups(pool.group) == []


def test_stop_ends_parked_launchers_and_removes_their_cgroups(pool):
    pool.start()
    assert _wait(lambda: pool.ready() == 4)
    pids = [pid for cg in _pooled_cgroups(pool.group) for pid in cg.pids()]
    assert len(pids) == 4
    pool.stop()
    assert _wait(lambda: not any(_alive(p) for p in pids), 5)
    assert _pooled_cgroups(pool.group) == [] and pool.ready() == 0


def test_a_launcher_runs_at_most_one_claim_and_nothing_when_its_socket_closes(tmp_path, agent_binary, bare_netns):
    group = _group()
    cg = SandboxCgroups.create(PREFIX + "t1", None, group=group)
    marker = tmp_path / "ran"
    try:
        one = Launcher(agent_binary, cg.procs_files(), SH_VIEW)
        one.wait_parked(5)
        one.close_socket()                  # what a dead daemon looks like to it
        assert one.proc.wait(timeout=5) == 0
        assert not marker.exists()
        two = Launcher(agent_binary, cg.procs_files(), SH_VIEW)
        two.wait_parked(5)
        assert cg.pids() == [two.pid]       # it joined the cgroups before saying 'R'
        ns = os.open(f"/run/netns/{bare_netns}", os.O_RDONLY)
        try:
            two.claim(ns, 65534, {}, ["/bin/sh", "-c", "id -u >&2; id -G >&2; exit 7"], [])
            with pytest.raises(LauncherError, match="already claimed"):
                two.claim(ns, 65534, {}, ["/bin/sh", "-c", f"touch {marker}"], [])
        finally:
            os.close(ns)
        assert two.proc.wait(timeout=5) == 7
        assert two.stderr_tail().split() == ["65534", "65534"]     # unprivileged, no host groups
        two.close_socket()
        assert not marker.exists()
    finally:
        cg.kill_all()
        cg.remove()
        _remove_group(group)


def test_a_claim_as_root_or_malformed_is_refused_by_the_launcher(agent_binary):
    group = _group()
    cg = SandboxCgroups.create(PREFIX + "t2", None, group=group)
    try:
        for raw in (b"0\x000\x00/bin/true\x00",              # uid 0: stays host root: never
                    b"1234\x000\x00/bin/true",                # not NUL-terminated
                    b"abc\x000\x00/bin/true\x00",
                    b"1234\x001\x00/srv\x00/bin/true\x00",   # a tree path without its tree fd
                    b"1234\x002\x00/srv\x00/bin/true\x00",   # no command after the trees
                    b"1234\x00/bin/true\x00"):                # no tree count
            launcher = Launcher(agent_binary, cg.procs_files(), SH_VIEW)
            launcher.wait_parked(5)
            launcher.sock.send(raw)
            assert launcher.proc.wait(timeout=5) == 2
            assert "malformed claim" in launcher.stderr_tail()
            launcher.close_socket()
    finally:
        cg.kill_all()
        cg.remove()
        _remove_group(group)


def test_pooled_sandboxes_get_their_own_cgroups_limits_uid_and_env(backend, bare_netns):
    assert _wait(lambda: backend.launchers.ready() == 3)
    parked = {pid for cg in _pooled_cgroups(backend.instance) for pid in cg.pids()}
    specs = [SandboxSpec(sandbox_id=f"tlpa-{uuid.uuid4().hex[:6]}", tenant="t", env={"WHO": "a"},
                         limits=Limits(memory_mb=96, pids=40, cpus=0.3)),
             SandboxSpec(sandbox_id=f"tlpb-{uuid.uuid4().hex[:6]}", tenant="t", env={"WHO": "b"},
                         limits=Limits(memory_mb=80, pids=50, cpus=0.7))]
    hs = [backend.create(s, bare_netns, ip=ip, gateway_ip="10.0.0.1") for s, ip in zip(specs, ("10.0.0.2", "10.0.0.3"))]
    try:
        assert backend.launchers.hits >= 2
        assert {h.data["bwrap_pid"] for h in hs} <= parked        # the starts used parked launchers
        assert hs[0].data["bwrap_pid"] != hs[1].data["bwrap_pid"]
        for h, s in zip(hs, specs):
            paths = h.data["cgroups"]["paths"]
            assert all(Path(p).name == s.sandbox_id for p in paths.values())    # renamed: no token left
            mem = int(Path(paths["memory"], "memory.limit_in_bytes").read_text())
            assert mem == s.limits.memory_mb << 20
            assert int(Path(paths["pids"], "pids.max").read_text()) == s.limits.pids
            assert int(Path(paths["cpu"], "cpu.cfs_quota_us").read_text()) == int(s.limits.cpus * 100_000)
            assert h.data["bwrap_pid"] in SandboxCgroups.from_json(h.data["cgroups"]).pids()
            r = backend.exec(h, ["sh", "-c", "echo $WHO $HOSTNAME; tr '\\0' '\\n' < /proc/1/environ | sort"])
            lines = r.stdout.decode().splitlines()
            assert lines[0] == f"{s.env['WHO']} {s.sandbox_id}"
            assert lines[1:] == ["LANG=C.UTF-8", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]   # the launcher's, no one's
            st = os.stat(f"/proc/{h.data['bwrap_pid']}")
            assert st.st_uid == h.data["host_uid"] != 0
        assert hs[0].data["host_uid"] != hs[1].data["host_uid"]
        # no sandbox pid sits in a pooled cgroup, and the pool's launchers are others
        pooled_now = {pid for cg in _pooled_cgroups(backend.instance) for pid in cg.pids()}
        assert not pooled_now & {h.data["bwrap_pid"] for h in hs}
    finally:
        for h in hs:
            backend.destroy(h)
    for h in hs:
        assert not any(Path(p).exists() for p in h.data["cgroups"]["paths"].values())
        assert _wait(lambda: not _alive(h.data["bwrap_pid"]), 5)
    # destroyed sandboxes gave nothing back: every pooled launcher is a new process
    assert _wait(lambda: backend.launchers.ready() == 3)
    again = {pid for cg in _pooled_cgroups(backend.instance) for pid in cg.pids()}
    assert not again & {h.data["bwrap_pid"] for h in hs}


def test_a_dead_daemon_leaves_nothing_claimable(tmp_path, agent_binary):
    group = _group()
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from sandbox_runtime.launchpool import LauncherPool
        p = LauncherPool({str(agent_binary)!r}, {group!r}, 3, {SH_VIEW!r}, quiet_s=0.0).start()
        deadline = time.monotonic() + 20
        while p.ready() < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        print(p.ready(), flush=True)
        os.kill(os.getpid(), 9)
    """)
    daemon = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert daemon.returncode == -signal.SIGKILL and daemon.stdout.strip() == "3", daemon.stderr
    try:
        left = _pooled_cgroups(group)
        assert len(left) == 3
        # their launchers read EOF and exit having run nothing: the cgroups empty out
        assert _wait(lambda: all(cg.pids() == [] for cg in left), 10)
        fresh = LauncherPool(agent_binary, group, 0, SH_VIEW)
        assert fresh.discard_leftovers() == 3
        assert _pooled_cgroups(group) == []
        assert fresh.take() is None          # a new daemon's pool holds nothing of the old one
    finally:
        for cg in _pooled_cgroups(group):
            cg.kill_all()
            cg.remove()
        _remove_group(group)
