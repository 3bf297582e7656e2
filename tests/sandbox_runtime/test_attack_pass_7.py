"""Attack pass 7 on the sandbox runtime: what a sandbox gets from the host besides its cgroup."""
from __future__ import annotations

import resource
import uuid

import pytest

from sandbox_runtime.backend import SandboxSpec
from sandbox_runtime.namespace import NamespaceBackend

# /proc/self/limits' names of the limits sandbox_runtime.rlimits sets
PROC_NAMES = {resource.RLIMIT_NOFILE: "Max open files", resource.RLIMIT_CORE: "Max core file size",
              resource.RLIMIT_MEMLOCK: "Max locked memory", resource.RLIMIT_RTPRIO: "Max realtime priority",
              resource.RLIMIT_NICE: "Max nice priority", resource.RLIMIT_MSGQUEUE: "Max msgqueue size",
              resource.RLIMIT_STACK: "Max stack size"}


@pytest.fixture(scope="module", params=[0, 1], ids=["spawned", "pooled"])
def backend(request, tmp_path_factory, agent_binary):
    b = NamespaceBackend(tmp_path_factory.mktemp("a7") / "state", launchers=request.param)
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    b.prepare("10.0.0.1")
    yield b
    b.close()


@pytest.fixture
def daemon_like_limits():
    """This process's limits raised as far as it may, as a daemon's are (cubegate run raises
    NOFILE to its hard limit; a unit's LimitCORE=infinity, ...): what a sandbox inherited
    before. Restored after."""
    saved = {r: resource.getrlimit(r) for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_CORE)}
    for r, (_, hard) in saved.items():
        resource.setrlimit(r, (hard, hard))
    try:
        yield
    finally:
        for r, v in saved.items():
            resource.setrlimit(r, v)


def _proc_limits(text: str) -> dict[str, tuple[int, int]]:
    out = {}
    for line in text.splitlines()[1:]:
        name, soft, hard = line[:26].strip(), *line[26:].split()[:2]
        out[name] = tuple(resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in (soft, hard))
    return out


def test_a_sandbox_starts_with_its_own_resource_limits_not_the_daemons(backend, bare_netns, daemon_like_limits):
    """FINDING: a sandbox inherited the daemon's rlimits: NOFILE raised to its hard limit (a
    sandbox of 256 pids could hold 256 x that many of the host's fs.file-max open files), and
    whatever the unit set: an unlimited MEMLOCK, an unlimited CORE (a crash dump goes to the
    host's core_pattern, which may write to the host's disk)."""
    from sandbox_runtime.rlimits import SANDBOX_RLIMITS
    h = backend.create(SandboxSpec(sandbox_id=f"a7r-{uuid.uuid4().hex[:8]}", tenant="t"), bare_netns,
                       ip="10.0.0.2", gateway_ip="10.0.0.1")
    try:
        r = backend.exec(h, ["sh", "-c", "cat /proc/self/limits"])
        got = _proc_limits(r.stdout.decode())
        assert {PROC_NAMES[k]: got[PROC_NAMES[k]] for k in SANDBOX_RLIMITS} == \
            {PROC_NAMES[k]: v for k, v in SANDBOX_RLIMITS.items()}, r.stdout.decode()
        # and nothing inside can raise a hard limit again
        r = backend.exec(h, ["sh", "-c", "ulimit -H -n 8192 || echo refused; ulimit -H -c unlimited || echo refused"])
        assert r.stdout.decode().split() == ["refused", "refused"], (r.stdout, r.stderr)
    finally:
        backend.destroy(h)


@pytest.mark.parametrize("wanted,current,expect", [
    ((1024, 4096), (20000, 20000), (1024, 4096)),
    ((1024, 4096), (512, 2048), (1024, 2048)),
    ((0, 0), (resource.RLIM_INFINITY, resource.RLIM_INFINITY), (0, 0)),
    ((8 << 20, resource.RLIM_INFINITY), (8 << 20, 16 << 20), (8 << 20, 16 << 20)),
    ((8 << 20, resource.RLIM_INFINITY), (1 << 20, 4 << 20), (4 << 20, 4 << 20)),
])
def test_the_sandbox_limits_are_ceilings_never_a_raise(wanted, current, expect):
    """A daemon without CAP_SYS_RESOURCE (a container) cannot raise a hard limit: a start
    must not fail because the daemon's own limit is lower already."""
    from sandbox_runtime.rlimits import ceiling
    assert ceiling(wanted, current) == expect


# ------------------------------------------------------------------ pseudo-terminals

HOG_PTYS = r"""
ulimit -n 4096
exec python3 -c '
import os, time
fds, why = [], "no bound met"
try:
    while len(fds) < 4000:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
except OSError as e:
    why = e.strerror
open("/workspace/held", "w").write("%d %s" % (len(fds), why))
time.sleep(6)
'
"""


def test_one_sandbox_cannot_take_every_pseudo_terminal_of_the_host(backend, bare_netns):
    """FINDING: bwrap's /dev/pts is a devpts instance without a bound, and all instances but the
    host's share kernel.pty.max - kernel.pty.reserve (3072 here): one sandbox opening /dev/ptmx
    in a loop took every one, and no other sandbox could open a terminal (pty.openpty, script,
    ssh) until it let go. Now each sandbox has its own instance of PTYS_PER_SANDBOX."""
    import threading
    import time
    from sandbox_runtime.ptys import PTYS_PER_SANDBOX
    hog = backend.create(SandboxSpec(sandbox_id=f"a7p-{uuid.uuid4().hex[:8]}", tenant="t"), bare_netns,
                         ip="10.0.0.2", gateway_ip="10.0.0.1")
    other = backend.create(SandboxSpec(sandbox_id=f"a7q-{uuid.uuid4().hex[:8]}", tenant="t"), bare_netns,
                           ip="10.0.0.3", gateway_ip="10.0.0.1")
    try:
        t = threading.Thread(target=backend.exec, args=(hog, ["sh", "-c", HOG_PTYS]), kwargs={"timeout": 30})
        t.start()
        held = b""
        deadline = time.monotonic() + 20
        while not held and time.monotonic() < deadline:
            held = backend.exec(hog, ["sh", "-c", "cat /workspace/held 2>/dev/null"]).stdout
            time.sleep(0.2)
        count, _, why = held.decode().partition(" ")
        assert int(count) == PTYS_PER_SANDBOX and why == "No space left on device", held   # before: 3072
        r = backend.exec(other, ["python3", "-c", "import os, pty; m, s = pty.openpty(); print(os.ttyname(s))"])
        assert r.exit_code == 0 and r.stdout.startswith(b"/dev/pts/"), (r.stdout, r.stderr)
        t.join(30)
    finally:
        backend.destroy(hog)
        backend.destroy(other)


# ------------------------------------------------------------------ the host's task space

def test_admission_keeps_half_the_hosts_task_space_for_the_host():
    """FINDING: admission counted memory, CPUs and sandboxes, never tasks. Every task of every
    sandbox takes a pid of the host (kernel.pid_max is 32768 here): 128 small sandboxes of 256
    pids each (64 MiB of memory each: 8 GiB) could take every pid of the host, and then the
    daemon, the gateway's workers and every other sandbox could start nothing. Now the
    sandboxes' pids limits together stay within half the host's task space."""
    from sandbox_runtime.backend import Limits
    from sandbox_runtime.capacity import CapacityError, admit, default_budget, host_tasks, reserved
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    budget = default_budget(memory_mb=1 << 20, cpus=1024.0, max_sandboxes=100_000, host_reserve_mb=0)
    assert budget.pids == host_tasks() // 2 and budget.pids <= pid_max // 2
    small = Limits(memory_mb=64, cpus=0.01, pids=256)
    fits = budget.pids // small.pids
    admit(budget, reserved([small] * (fits - 1)), small, None)              # the last one that fits
    with pytest.raises(CapacityError, match="not enough tasks"):
        admit(budget, reserved([small] * fits), small, None)                # before: admitted
