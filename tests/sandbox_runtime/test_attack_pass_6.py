"""Attack pass 6 on the sandbox runtime: what a sandbox leaves in its writable layer against
the host-side code that handles that layer as root (clone/rollback seeding), and the
manager's snapshot/clone/rollback calls against a destroy of the same sandbox.

Layer shapes are made by the sandbox's own means (a sparse file, hard links) on a real tmpfs
like the one a sandbox's layer lives on; the code under test runs in a child process, so a
crash of it (SIGBUS) fails the test instead of killing pytest."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OLD, NEW = b"cg-ph-0123456789abcdef0123", b"cg-ph-fedcba9876543210fedc"


def _in_tmpfs(script: str, size_mb: int = 8, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run `script` (python; `d` is a fresh tmpfs of size_mb) in its own mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tmpfs mount)")
    code = textwrap.dedent(f"""
        import os, subprocess, sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from sandbox_runtime.templates import rootfs
        d = Path(tempfile.mkdtemp(prefix="a6tm"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size={size_mb}m", "a6", str(d)], check=True)
        OLD, NEW = {OLD!r}, {NEW!r}
    """) + textwrap.dedent(script)
    return subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=timeout)


def test_a_sparse_file_in_a_layer_does_not_crash_the_token_replacement():
    # A sandbox runs `truncate -s 64G x` in its 8 MiB layer (holes cost nothing); a clone of its
    # snapshot replaces placeholders in the copied layer. Faulting the holes in (mmap) allocates
    # tmpfs pages past the size limit: SIGBUS, the daemon is gone for every tenant.
    r = _in_tmpfs("""
        with open(d / "sparse", "wb") as f:
            f.write(b"x" * 100 + OLD)
            f.truncate(64 << 30)
            f.seek(32 << 30)
            f.write(OLD + b"tail")
        n = rootfs.replace_tokens(d, {OLD: NEW})
        data = open(d / "sparse", "rb")
        head = data.read(200); data.seek(32 << 30); mid = data.read(len(NEW) + 4)
        print(n, OLD in head, NEW in head, mid == NEW + b"tail", os.stat(d / "sparse").st_blocks * 512 < (1 << 20))
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert r.stdout.split() == ["1", "False", "True", "True", "True"], r.stdout


def test_hard_links_are_replaced_once_and_tokens_across_chunks_are_found():
    # Thousands of links to one big file: each inode is read once (not once per name), and a
    # token that straddles the reader's chunk boundary is still replaced.
    r = _in_tmpfs("""
        import resource
        def io():
            rchar = int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
            return rchar + resource.getrusage(resource.RUSAGE_SELF).ru_minflt * 4096
        blob = bytearray(b"a" * (3 << 20))
        at = (1 << 20) - 5                    # straddles a 1 MiB boundary
        blob[at:at + len(OLD)] = OLD
        (d / "big").write_bytes(bytes(blob))
        for i in range(2000):
            os.link(d / "big", d / f"l{i}")
        before = io()
        n = rootfs.replace_tokens(d, {OLD: NEW})
        touched = io() - before               # bytes read + pages faulted in
        got = (d / "l7").read_bytes()
        print(n, got[at:at + len(NEW)] == NEW, OLD not in got, touched < (64 << 20), touched >> 20, file=sys.stderr)
        print(n, got[at:at + len(NEW)] == NEW, OLD not in got, touched < (64 << 20))
    """, size_mb=16)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert r.stdout.split() == ["1", "True", "True", "True"], r.stdout


# ------------------------------------------------------------------ real sandboxes on a template

CACHE = Path(os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates"))


@pytest.fixture(scope="module")
def tbackend(tmp_path_factory, agent_binary):
    import shutil
    from sandbox_runtime.namespace import NamespaceBackend
    from sandbox_runtime.templates import TemplateStore
    if os.geteuid() != 0 or not shutil.which("mmdebstrap"):
        pytest.skip("needs root and mmdebstrap (apt)")
    store = TemplateStore(CACHE)
    store.build("base")                          # cached on this machine: returns at once
    b = NamespaceBackend(tmp_path_factory.mktemp("a6") / "state", templates=store)
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    yield b
    b.close()


def _spec(**kw):
    import uuid
    from sandbox_runtime.backend import Limits, SandboxSpec
    return SandboxSpec(sandbox_id=f"a6{kw.pop('tag', 's')}-{uuid.uuid4().hex[:8]}", tenant="t", template="base",
                       limits=Limits(disk_mb=32), **kw)


def test_a_clone_of_a_layer_holding_a_huge_sparse_file_starts_and_gets_its_own_placeholder(
        tbackend, bare_netns, tmp_path):
    """The whole path: code in the sandbox makes a 64 GiB sparse file in its 32 MiB layer, the
    host snapshots it (cp -a keeps the holes) and starts a clone with its own placeholders."""
    from sandbox_runtime.snapshots import tree_size
    parent = tbackend.create(_spec(tag="p", env={"K": OLD.decode()}), bare_netns, ip="10.0.0.2", gateway_ip="10.0.0.1")
    clone = None
    try:
        r = tbackend.exec(parent, ["sh", "-c", 'truncate -s 64G big && printf "%s" "$K" >> big && echo "$K" > k'])
        assert r.exit_code == 0, r.stderr
        layer = tmp_path / "layer"
        info = tbackend.snapshot_layer(parent, layer)
        assert os.stat(layer / "workspace/big").st_size > (64 << 30)
        assert tree_size(layer) < (1 << 20)          # what the snapshot takes on disk, not 64 GiB
        clone = tbackend.create(_spec(tag="c", env={"K": NEW.decode()}, seed_layer=str(layer),
                                      seed_uid=info["layer_uid"], seed_tokens={OLD.decode(): NEW.decode()}),
                                bare_netns, ip="10.0.0.3", gateway_ip="10.0.0.1")
        r = tbackend.exec(clone, ["sh", "-c", 'cat k; tail -c 26 big; echo; du -k big | cut -f1'])
        lines = r.stdout.decode().split()
        assert r.exit_code == 0 and lines[:2] == [NEW.decode(), NEW.decode()] and int(lines[2]) < 1024, r
    finally:
        for h in (clone, parent):
            if h is not None:
                tbackend.destroy(h)


# ------------------------------------------------------------------ snapshot vs. pause, destroy, rollback

from tests.sandbox_runtime.test_auto_pause_races import _Switch  # noqa: E402 - one switch double


class _FreezingBackend:
    """Freezes like the namespace backend: a snapshot freezes the sandbox for the copy and thaws
    it after unless it was frozen before; the copy waits for `release`."""
    name = "rec"

    def __init__(self):
        import threading
        self.frozen: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.copying, self.release = threading.Event(), threading.Event()

    def available(self):
        return True, ""

    def pause(self, h):
        self.frozen.add(h.sandbox_id)

    def resume(self, h):
        self.frozen.discard(h.sandbox_id)

    def snapshot_layer(self, h, dest):
        was = h.sandbox_id in self.frozen
        self.frozen.add(h.sandbox_id)
        self.copying.set()
        assert self.release.wait(10)
        dest.mkdir()
        if not was:
            self.frozen.discard(h.sandbox_id)
        return {"template": None, "template_key": None, "layer_uid": None}

    def rollback(self, h, **kw):
        self.calls.append(("rollback", h.sandbox_id))
        return h

    def destroy(self, h):
        self.calls.append(("destroy", h.sandbox_id))


@pytest.fixture
def copying(tmp_path):
    """A manager whose sandbox "x" is in the middle of a snapshot copy; yields (manager, backend)."""
    import threading
    from sandbox_runtime.backend import Handle
    from sandbox_runtime.capacity import default_budget
    from sandbox_runtime.manager import SandboxManager
    from sandbox_runtime.snapshots import SnapshotStore
    from sandbox_runtime.state import SandboxRecord, StateStore
    backend = _FreezingBackend()
    m = SandboxManager(switch=_Switch(), backends={"rec": backend}, state=StateStore(tmp_path / "s.db"),
                       budget=default_budget(4096, 2.0, 8, 0), snapshots=SnapshotStore(tmp_path / "snaps"))
    m.state.put(SandboxRecord("x", "t", "rec", state="running", handle=Handle("x", "rec", "ns")))
    backend.release.set()
    m.snapshot("x", "x-old")                  # one to roll back to
    backend.release.clear()
    backend.copying.clear()
    done: list = []
    t = threading.Thread(target=lambda: done.append(m.snapshot("x", "x-snap")))
    t.start()
    assert backend.copying.wait(10)
    try:
        yield m, backend
    finally:
        backend.release.set()
        t.join(10)
    assert not t.is_alive() and done and done[0]["id"] == "x-snap"


def test_a_pause_during_a_snapshot_is_refused_not_undone_by_the_copy(copying):
    # Before: the pause froze an already frozen sandbox and said "paused"; the copy then thawed
    # it: a sandbox running while its record (and the capacity count) said paused.
    from sandbox_runtime.manager import Conflict
    m, backend = copying
    with pytest.raises(Conflict, match="being snapshotted"):
        m.pause("x")
    backend.release.set()
    assert m.get_record("x").state == "running"


def test_a_destroy_rollback_or_second_snapshot_during_a_snapshot_is_refused(copying):
    # Before: the backend tore the sandbox down (or replaced its layer) under the running copy,
    # and a second copy's thaw ended the first one's freeze.
    from sandbox_runtime.manager import Conflict
    m, backend = copying
    for call in (lambda: m.destroy("x"), lambda: m.rollback("x", "x-old"), lambda: m.snapshot("x", "x-second")):
        with pytest.raises(Conflict, match="being snapshotted"):
            call()
    assert backend.calls == [] and m.get_record("x").state == "running"
    backend.release.set()


def test_a_rollback_during_a_destroy_is_refused(tmp_path):
    import threading
    from sandbox_runtime.backend import Handle
    from sandbox_runtime.capacity import default_budget
    from sandbox_runtime.manager import Conflict, SandboxManager
    from sandbox_runtime.snapshots import SnapshotStore
    from sandbox_runtime.state import SandboxRecord, StateStore
    backend = _FreezingBackend()
    backend.release.set()
    m = SandboxManager(switch=_Switch(), backends={"rec": backend}, state=StateStore(tmp_path / "s.db"),
                       budget=default_budget(4096, 2.0, 8, 0), snapshots=SnapshotStore(tmp_path / "snaps"))
    m.state.put(SandboxRecord("x", "t", "rec", state="running", handle=Handle("x", "rec", "ns")))
    m.snapshot("x", "x-old")
    tearing, go = threading.Event(), threading.Event()

    def slow_destroy(h):
        backend.calls.append(("destroy", h.sandbox_id))
        tearing.set()
        assert go.wait(10)
    backend.destroy = slow_destroy
    t = threading.Thread(target=m.destroy, args=("x",))
    t.start()
    try:
        assert tearing.wait(10)
        with pytest.raises(Conflict, match="being removed"):
            m.rollback("x", "x-old")          # before: a rollback started a new sandbox being torn down
    finally:
        go.set()
        t.join(10)
    assert backend.calls == [("destroy", "x")] and m.state.get("x") is None


# ------------------------------------------------------------------ the runtime API's body budget

def test_idle_unauthenticated_bodies_cannot_take_the_runtime_apis_body_budget(tmp_path):
    """Two connections declaring 48 MiB bodies (the API's limit; the budget is twice that) and
    sending nothing held the whole budget for the body timeout: every operator's create, exec
    and upload was 503 meanwhile. Now a body needs a valid bearer token in the headers to be
    more than 64 KiB; without one it is a 401 before it is read."""
    import socket
    import time
    import httpx
    from cubegate import runtime_api
    from sandbox_runtime.capacity import default_budget
    from sandbox_runtime.manager import SandboxManager
    from sandbox_runtime.state import StateStore
    from tests.httpkit.conftest import served
    state = StateStore(tmp_path / "s.db")
    manager = SandboxManager(switch=None, backends={}, state=state, budget=default_budget(1024, 1.0, 4, 0))
    token_file = tmp_path / "api.token"
    with served(lambda: runtime_api.serve(manager, host="127.0.0.1", port=0, token_file=token_file, workers=2)) as srv:
        token = token_file.read_text().strip()
        head = (f"PUT /v1/sandboxes/x/files?path=a HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Length: {runtime_api.MAX_BODY}\r\n\r\n").encode()
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(2)]
        try:
            for s in socks:
                s.sendall(head)
            time.sleep(0.3)
            r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/sandboxes", content=b"{not json",
                           headers={"Authorization": f"Bearer {token}"}, timeout=10)
            assert r.status_code == 400, (r.status_code, r.text)     # before: 503 "busy"
            for s in socks:
                s.settimeout(5)
                assert s.recv(4096).startswith(b"HTTP/1.1 401")
        finally:
            for s in socks:
                s.close()
    state.close()


def test_a_layer_holds_a_bounded_number_of_files(tbackend, bare_netns, tmp_path):
    """Empty files cost a sandbox ~0.5 KiB of memory each and no disk: a 256 MiB sandbox made
    200 000 in 18 s (and a 2 GiB one could make millions), its layer's tmpfs allowed 3 million,
    and each snapshot copied every one onto the host's disk (20 s for 200 000, the host here has
    16.7 million inodes). The layer now holds one inode per 4 KiB of its size."""
    from sandbox_runtime.templates.rootfs import layer_inodes
    h = tbackend.create(_spec(tag="i"), bare_netns, ip="10.0.0.2", gateway_ip="10.0.0.1")   # 32 MiB
    try:
        r = tbackend.exec(h, ["sh", "-c", "mkdir f && cd f && seq -f 'n%g' 1 20000 | xargs touch 2>/dev/null;"
                                          " ls | wc -l; df -i /workspace | tail -1"], timeout=60)
        made, inodes = int(r.stdout.split()[0]), int(r.stdout.split()[2])
        assert inodes == layer_inodes(32) and made < layer_inodes(32), r.stdout
    finally:
        tbackend.destroy(h)


# ------------------------------------------------------------------ socket families no netns confines

VSOCK_PROBE_C = r"""
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <sys/socket.h>
int main(void) {   /* socket() only: nothing is connected to */
    int s = socket(40 /* AF_VSOCK */, SOCK_STREAM, 0);
    puts(s >= 0 ? "open" : strerror(errno));
    s = socket(AF_INET, SOCK_STREAM, 0);
    puts(s >= 0 ? "inet-open" : strerror(errno));
    return 0;
}
"""


def test_the_filter_refuses_vsock_sockets_only():
    from sandbox_runtime import seccomp as sc
    from tests.sandbox_runtime.test_namespace import run_bpf
    prog = sc.build_filter()
    allow, eperm = sc.SECCOMP_RET_ALLOW, sc.SECCOMP_RET_ERRNO | 1
    assert run_bpf(prog, sc.SYS_SOCKET, arg0=40) == eperm
    for family in (1, 2, 10, 16):                   # unix, inet, inet6, netlink
        assert run_bpf(prog, sc.SYS_SOCKET, arg0=family) == allow, family
    for name, nr in sc.DENIED_X86_64.items():       # the rest of the table still holds
        assert run_bpf(prog, nr) == eperm, name
    assert run_bpf(prog, 56, arg0=0x01200011) == allow and run_bpf(prog, 56, arg0=0x10000000 | 17) == eperm
    assert run_bpf(prog, 0x40000000 | 41, arg0=40) == eperm and run_bpf(prog, 0) == allow


def test_a_sandbox_cannot_open_a_vsock_socket(tbackend, bare_netns, tmp_path):
    """FINDING: AF_VSOCK is in no network namespace: from any sandbox it reaches the hypervisor's
    vsock services (CID 2) when the host is a VM (this one is: /dev/vsock), past the netns and
    the switch. The sandbox now gets EPERM at socket(); other families are unchanged."""
    import shutil
    if shutil.which("gcc") is None:
        pytest.skip("gcc needed")
    src = tmp_path / "v.c"
    src.write_text(VSOCK_PROBE_C)
    subprocess.run(["gcc", "-O2", "-static", "-o", str(tmp_path / "v"), str(src)], check=True, timeout=120)
    h = tbackend.create(_spec(tag="v"), bare_netns, ip="10.0.0.2", gateway_ip="10.0.0.1")
    try:
        tbackend.write_file(h, "/workspace/v", (tmp_path / "v").read_bytes(), 0o755)
        r = tbackend.exec(h, ["/workspace/v"])
        assert r.exit_code == 0 and r.stdout.decode().split("\n")[:2] == ["Operation not permitted", "inet-open"], r
    finally:
        tbackend.destroy(h)
