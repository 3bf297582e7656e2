"""What a sandbox's bwrap sees of the host's mounts (launcher.py, agent.c small_view): only
the paths it needs, whatever else the host has mounted. Every other sandbox's netns and
template root stays out of its sight (and out of its mountinfo, which it re-reads for every
mount it makes), the sandbox still runs in its own netns on its own root, and nothing of
this reaches the host's mount table."""
from __future__ import annotations

import os
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from cubevs import netns as cubevs_netns
from sandbox_runtime.backend import Limits, SandboxError, SandboxSpec
from sandbox_runtime.launcher import LauncherError, check_view, outermost
from sandbox_runtime.namespace import NamespaceBackend, bwrap_argv, launcher_view, static_view, view_additions

pytestmark = pytest.mark.netns

CACHE = Path(os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates"))


def _mount_points(pid: int | str) -> list[str]:
    return [line.split(" ")[4].replace("\\040", " ") for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]


def _under(points: list[str], d: str) -> list[str]:
    return [p for p in points if p == d or p.startswith(d.rstrip("/") + "/")]


# ------------------------------------------------------------------ pure

def test_outermost_drops_nested_and_repeated_paths_only():
    assert outermost(["/a/c", "/a", "/a-b", "/a", "/b/x", "/b/xy"]) == ["/a", "/a-b", "/b/x", "/b/xy"]


def test_view_of_bwrap_argv_has_its_binds_its_fds_and_bwraps_own_paths(tmp_path):
    agent = tmp_path / "agent"
    agent.write_bytes(b"")
    etc = tmp_path / "etc"
    etc.mkdir()
    (tmp_path / "link").symlink_to(etc)
    argv = bwrap_argv(sandbox_id="sb", disk_mb=8, seccomp_fd=4, agent_fd=5, listen_fd=3, etc_dir_fd=6,
                      etc_fds={"hosts": 7, "hostname": 8}, usr_links={}, env={"X": "--ro-bind"})
    view = launcher_view(argv, [str(agent), str(tmp_path / "link")])
    check_view(view)                        # what agent.c accepts
    assert {"/usr", "/proc", "/dev", str(agent), str(etc)} <= set(view)
    assert str(tmp_path / "link") not in view          # an fd names its target
    if os.path.isdir("/etc/alternatives"):
        assert "/etc/alternatives" in view              # an argv bind's source
    assert not any(p.startswith("/usr/") for p in view)     # nested: /usr covers it
    assert "--ro-bind" not in view                      # an env value is not an option
    with pytest.raises(SandboxError, match="unknown bwrap option"):
        launcher_view(["/usr/bin/bwrap", "--bind-anything", "/", "/", "/bin/true"], [])
    for bad in ([], ["/usr", "/usr/lib"], ["/usr/./lib"], ["relative"], ["/tmp"]):
        with pytest.raises(LauncherError):
            check_view(bad)


def test_a_claim_adds_only_what_the_static_view_lacks():
    static = static_view()
    assert "/usr" in static and "/proc" in static and not any(p.startswith("/run") for p in static)
    needed = outermost(static + ["/run/cubegate/roots/i/sb/root", "/opt/agent"])
    assert view_additions(needed, static) == ["/opt/agent", "/run/cubegate/roots/i/sb/root"]
    with pytest.raises(SandboxError, match="contains the static"):
        view_additions(["/etc"], ["/etc/alternatives"])     # cannot be attached around a bind


# ------------------------------------------------------------------ real sandboxes

@pytest.fixture(scope="module", params=[0, 2], ids=["spawned", "pooled"])
def backend(request, tmp_path_factory, agent_binary):
    b = NamespaceBackend(tmp_path_factory.mktemp("view") / "state", launchers=request.param,
                         templates=_store_or_none())
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    b.prepare("10.0.0.1")
    yield b
    b.close()


def _store_or_none():
    from sandbox_runtime.templates import TemplateStore
    return TemplateStore(CACHE) if CACHE.is_dir() else None


@contextmanager
def _netns():
    """A named netns the way cubevs makes them (one nsfs bind mount under /run/netns)."""
    name = f"cgvw{uuid.uuid4().hex[:8]}"
    cubevs_netns.create(name)
    try:
        yield name
    finally:
        cubevs_netns.remove(name)


@contextmanager
def _sandbox(backend, netns: str, ip: str, template: str | None = None):
    spec = SandboxSpec(sandbox_id=f"tvw-{uuid.uuid4().hex[:8]}", tenant="t", limits=Limits(disk_mb=8),
                       template=template)
    h = backend.create(spec, netns, ip=ip, gateway_ip="10.0.0.1")
    try:
        yield h
    finally:
        backend.destroy(h)


def test_bwrap_sees_no_other_sandboxs_netns_and_a_table_that_does_not_grow(backend):
    with ExitStack() as stack:
        ns_a, ns_b = stack.enter_context(_netns()), stack.enter_context(_netns())
        a = stack.enter_context(_sandbox(backend, ns_a, "10.0.0.2"))
        more = [stack.enter_context(_netns()) for _ in range(5)]     # the host's table grows
        b = stack.enter_context(_sandbox(backend, ns_b, "10.0.0.3"))
        seen_a, seen_b = _mount_points(a.data["bwrap_pid"]), _mount_points(b.data["bwrap_pid"])
        for seen in (seen_a, seen_b):
            assert _under(seen, "/run/netns") == [], seen      # no netns mount, its own neither
            assert "/" in seen and "/usr" in seen and "/proc" in seen
        assert len(seen_a) == len(seen_b) <= 30, (seen_a, seen_b)
        # each still runs in its own netns (entered by fd before its mount went away)
        for h, name in ((a, ns_a), (b, ns_b)):
            assert os.stat(f"/proc/{h.data['bwrap_pid']}/ns/net").st_ino == os.stat(f"/run/netns/{name}").st_ino
            assert backend.exec(h, ["sh", "-c", "echo ok"]).stdout == b"ok\n"
        # the detaching happened in the launcher's own namespace: the host's table is whole
        host = _mount_points("self")
        assert {f"/run/netns/{n}" for n in (ns_a, ns_b, *more)} <= set(host)


def test_bwrap_sees_its_own_template_root_and_no_other(backend):
    if backend.templates is None:
        pytest.skip(f"no template cache at {CACHE}")
    try:
        backend.templates.resolve("base")
    except Exception as e:  # noqa: BLE001 - not built on this machine
        pytest.skip(str(e))
    with ExitStack() as stack:
        ns_a, ns_b = stack.enter_context(_netns()), stack.enter_context(_netns())
        a = stack.enter_context(_sandbox(backend, ns_a, "10.0.0.2", "base"))
        b = stack.enter_context(_sandbox(backend, ns_b, "10.0.0.3", "base"))
        seen_b = _mount_points(b.data["bwrap_pid"])
        root_a, root_b = a.data["rootfs"], b.data["rootfs"]
        assert _under(seen_b, root_a) == [], seen_b
        assert _under(seen_b, root_b) == [root_b + "/root"], seen_b     # the overlay, not its rw tmpfs
        assert _under(_mount_points(a.data["bwrap_pid"]), root_b) == []
        assert len(_under(_mount_points("self"), root_a)) == 2         # the host keeps A's mounts
        r = backend.exec(b, ["sh", "-c", "command -v git; touch /workspace/ok && echo ok"])
        assert r.stdout.decode().split() == ["/usr/bin/git", "ok"], r


# ------------------------------------------------------------------ fail closed

SH_VIEW = [p for p in ("/bin", "/etc/ld.so.cache", "/lib", "/lib64", "/usr") if os.path.lexists(p)]


def test_a_launcher_whose_view_cannot_be_built_never_parks(agent_binary, tmp_path):
    from sandbox_runtime.launcher import Launcher
    launcher = Launcher(agent_binary, [], SH_VIEW + [str(tmp_path / "missing")])
    try:
        with pytest.raises(LauncherError, match="missing: No such file"):
            launcher.wait_parked(5)
        assert launcher.proc.wait(timeout=5) == 2
    finally:
        launcher.discard()


def test_a_claimed_tree_inside_the_static_view_is_refused_and_nothing_runs(agent_binary, bare_netns):
    import socket

    from sandbox_runtime.launcher import Launcher, claim_message, clone_tree
    launcher = Launcher(agent_binary, [], SH_VIEW)
    ns, tree = os.open(f"/run/netns/{bare_netns}", os.O_RDONLY), clone_tree("/usr/share")
    try:
        launcher.wait_parked(5)
        with pytest.raises(LauncherError, match="nested"):       # the daemon's side checks first
            launcher.claim(ns, 65534, {"/usr/share": tree}, ["/bin/true"], [])
        msg = claim_message(65534, ["/usr/share"], ["/bin/true"])      # /bin/true would exit 0
        socket.send_fds(launcher.sock, [msg], [ns, tree])        # ... and the launcher's
        assert launcher.proc.wait(timeout=5) == 2
        assert "nested view paths" in launcher.stderr_tail()
    finally:
        os.close(ns)
        os.close(tree)
        launcher.discard()
