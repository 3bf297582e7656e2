"""The namespace backend with real bwrap, cgroups, seccomp and (at the end) a real
cubevs switch + transparent gateway from the lab."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from sandbox_runtime.backend import Handle, Limits, SandboxError, SandboxSpec
from sandbox_runtime.namespace import NamespaceBackend

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parents[2]
TPORT = 18077            # differs from test_transparent (18075), test_sandbox_dns (18076)
HUB_IP = "10.200.0.1"


def _sid(tag: str) -> str:
    return f"t{tag}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", params=[0, 2], ids=["spawned", "pooled"])
def backend(request, tmp_path_factory, agent_binary):
    """Every test twice: launchers spawned per start, and taken from a pool (launchpool.py)."""
    b = NamespaceBackend(tmp_path_factory.mktemp("ns") / "state", launchers=request.param)
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    b.prepare("10.0.0.1")       # starts filling the launcher pool
    yield b
    b.close()           # its roots dir under /run goes with it


@contextmanager
def sandbox(backend, netns, *, tag="s", limits=Limits(), env=None, files=None, ip="10.0.0.2", gw="10.0.0.1"):
    spec = SandboxSpec(sandbox_id=_sid(tag), tenant="t", limits=limits, env=env or {}, files=files or {})
    h = backend.create(spec, netns, ip=ip, gateway_ip=gw)
    try:
        yield h
    finally:
        backend.destroy(h)


def sh(backend, h, script: str, **kw):
    return backend.exec(h, ["sh", "-c", script], **kw)


def traces(h: Handle) -> dict:
    """Everything a sandbox can leave on the host."""
    cg = h.data.get("cgroups", {}).get("paths", {})
    pid = h.data.get("bwrap_pid")
    return {"cgroups": [p for p in cg.values() if Path(p).exists()],
            "state_dir": Path(h.data["state_dir"]).exists(),
            "bwrap": bool(pid) and _running(pid)}


def _running(pid: int) -> bool:
    """Exists and is not a zombie (an orphan's zombie is reaped by the host's init, on its own time)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ basics

def test_create_exec_env_files_and_read_back(backend, bare_netns):
    files = {"app/main.py": b"print('hi from file')\n", "top.txt": b"top"}
    with sandbox(backend, bare_netns, env={"OPENAI_API_KEY": "cg-placeholder-1"}, files=files) as h:
        r = sh(backend, h, "pwd; hostname; id -u; echo $OPENAI_API_KEY; python3 app/main.py; cat top.txt")
        assert r.exit_code == 0, r
        assert r.stdout.decode().split("\n")[:6] == ["/workspace", h.sandbox_id, "1000", "cg-placeholder-1",
                                                     "hi from file", "top"]
        backend.write_file(h, "/workspace/out/x.bin", b"\x00\x01", 0o600)
        assert backend.read_file(h, "/workspace/out/x.bin") == b"\x00\x01"
        backend.set_env(h, {"OPENAI_API_KEY": "cg-placeholder-2"})
        assert sh(backend, h, "echo $OPENAI_API_KEY $SSL_CERT_FILE").stdout == \
            b"cg-placeholder-2 /etc/ssl/certs/ca-certificates.crt\n"
        assert backend.alive(h)
        u = backend.usage(h)
        assert u["memory_bytes"] > 0 and u["pids"] >= 2 and u["cpu_seconds"] > 0


def test_read_only_base_and_writable_workspace(backend, bare_netns):
    with sandbox(backend, bare_netns, limits=Limits(disk_mb=8)) as h:
        r = sh(backend, h, "for p in / /usr/bin /etc /etc/passwd; do touch $p/x 2>/dev/null && echo W$p; done;"
                           " touch /workspace/ok /tmp/ok && echo ok")
        assert r.stdout == b"ok\n", r
        r = sh(backend, h, "head -c 20M /dev/zero > /workspace/big")      # tmpfs sized disk_mb
        assert r.exit_code != 0 and b"No space left" in r.stderr


def test_bad_file_path_is_refused_and_cleaned_up(backend, bare_netns):
    spec = SandboxSpec(sandbox_id=_sid("p"), tenant="t", files={"../escape": b"x"})
    with pytest.raises(SandboxError, match="invalid file path"):
        backend.create(spec, bare_netns, ip="10.0.0.2", gateway_ip="10.0.0.1")
    assert not (backend.state_dir / spec.sandbox_id).exists()
    assert not Path(f"/sys/fs/cgroup/memory/cubegate/{backend.instance}/{spec.sandbox_id}").exists()


def test_start_failure_reports_bwrap_error_and_leaves_nothing(backend):
    bogus = f"cgsrbogus{uuid.uuid4().hex[:6]}"
    Path(f"/run/netns/{bogus}").write_text("")     # exists, but is not a namespace: setns fails
    try:
        spec = SandboxSpec(sandbox_id=_sid("f"), tenant="t")
        with pytest.raises(SandboxError, match="netns") as ei:
            backend.create(spec, bogus, ip="10.0.0.2", gateway_ip="10.0.0.1")
        assert "exited during start" in str(ei.value)
        assert not (backend.state_dir / spec.sandbox_id).exists()
        assert not Path(f"/sys/fs/cgroup/pids/cubegate/{backend.instance}/{spec.sandbox_id}").exists()
    finally:
        os.unlink(f"/run/netns/{bogus}")
    with pytest.raises(SandboxError, match="does not exist"):
        backend.create(SandboxSpec(sandbox_id=_sid("f"), tenant="t"), "nonexistent-netns", ip="1.1.1.1",
                       gateway_ip="1.1.1.2")


def test_destroy_leaves_nothing_and_is_idempotent(backend, bare_netns):
    with sandbox(backend, bare_netns) as h:
        r = sh(backend, h, "sleep 300 > /dev/null 2>&1 & echo started")   # a process outliving its exec
        assert r.stdout == b"started\n"
        assert all(traces(h).values())
        pids = [int(p) for p in Path(h.data["cgroups"]["paths"]["pids"], "cgroup.procs").read_text().split()]
        assert len(pids) >= 3
    assert traces(h) == {"cgroups": [], "state_dir": False, "bwrap": False}
    assert not any(Path(f"/proc/{p}").exists() for p in pids)     # killed and reaped, not zombies
    backend.destroy(h)          # again: no error
    assert not backend.alive(h)


def test_pause_and_resume(backend, bare_netns):
    with sandbox(backend, bare_netns) as h:
        backend.pause(h)
        try:
            assert Path(h.data["cgroups"]["paths"]["freezer"], "freezer.state").read_text().strip() == "FROZEN"
            with pytest.raises(SandboxError):
                backend._client(h).ping(timeout=0.3)
        finally:
            backend.resume(h)
        assert sh(backend, h, "echo back").stdout == b"back\n"


# ------------------------------------------------------------------ limits

def test_memory_hog_is_oom_killed_and_the_sandbox_survives(backend, bare_netns):
    with sandbox(backend, bare_netns, limits=Limits(memory_mb=64)) as h:
        mem = Path(h.data["cgroups"]["paths"]["memory"])
        assert int((mem / "memory.limit_in_bytes").read_text()) == 64 << 20
        r = backend.exec(h, ["python3", "-c", "x = b'x' * (256 << 20); print('survived')"], timeout=20)
        assert r.exit_code == -9 and b"survived" not in r.stdout, r
        assert backend.alive(h)
        assert sh(backend, h, "echo fine").stdout == b"fine\n"


def test_fork_bomb_is_contained_by_pids_max(backend, bare_netns):
    limit = 40
    with sandbox(backend, bare_netns, limits=Limits(pids=limit)) as h:
        pids_dir = Path(h.data["cgroups"]["paths"]["pids"])
        assert (pids_dir / "pids.max").read_text().strip() == str(limit)
        peak, host_ok = [0], []

        def watch(stop: threading.Event):
            while not stop.is_set():
                with suppress(OSError, ValueError):
                    peak[0] = max(peak[0], int((pids_dir / "pids.current").read_text()))
                host_ok.append(subprocess.run(["true"], timeout=5).returncode == 0)   # the host still forks
                time.sleep(0.05)

        stop = threading.Event()
        t = threading.Thread(target=watch, args=(stop,))
        t.start()
        try:
            # the bomb runs in a subshell (dash exits when a fork fails); the top shell's loop is a
            # builtin that needs no fork, so the exec lasts until its timeout kills the whole group
            r = sh(backend, h, "(bomb() { bomb | bomb & }; bomb) 2>/dev/null; while :; do :; done", timeout=1.5)
        finally:
            stop.set()
            t.join(10)
        assert r.timed_out and r.exit_code == 124
        assert int((pids_dir / "pids.events").read_text().split()[1]) > 0, "pids.max was never hit"
        assert peak[0] <= limit and host_ok and all(host_ok)
        # the timeout killed the bomb's process group: the sandbox works again
        deadline = time.monotonic() + 5
        while int((pids_dir / "pids.current").read_text()) > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sh(backend, h, "echo recovered").stdout == b"recovered\n"


def test_cpu_quota_is_set_and_enforced(backend, bare_netns):
    with sandbox(backend, bare_netns, limits=Limits(cpus=0.2)) as h:
        cpu = Path(h.data["cgroups"]["paths"]["cpu"])
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 20_000
        assert int((cpu / "cpu.cfs_period_us").read_text()) == 100_000
        before = backend.usage(h)["cpu_seconds"]
        # two busy loops (demand 2 CPUs) for 1 s of wall time against a 0.2 CPU quota
        r = sh(backend, h, "timeout 1 sh -c 'while :; do :; done' & timeout 1 sh -c 'while :; do :; done'; wait",
               timeout=10)
        used = backend.usage(h)["cpu_seconds"] - before
        stat = dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0, (stat, r)
        assert used < 0.2 * r.duration_s + 0.15, (used, r.duration_s)


# ------------------------------------------------------------------ isolation

def test_cannot_see_host_files_or_processes(backend, bare_netns, tmp_path):
    marker = Path("/root") / f".cg-marker-{uuid.uuid4().hex[:8]}"
    marker.write_text("host secret")
    host_proc = subprocess.Popen(["sleep", "37.5"])
    try:
        with sandbox(backend, bare_netns) as h:
            r = sh(backend, h, f"cat {marker}; ls /root /work /home /run/netns /sys 2>&1; "
                               f"cat /proc/1/cmdline | tr '\\0' ' '; echo; ps -eo pid,comm,args")
            out = r.stdout.decode()
            assert "host secret" not in out and "No such file" in r.stderr.decode() + out
            assert "37.5" not in out
            pids = [int(line.split()[0]) for line in out.splitlines()[-50:] if line.split()[0].isdigit()]
            assert pids and max(pids) < 50, out          # own pid namespace: only the sandbox's tasks
            # the host's view of the same sandbox: its tasks run as the unprivileged host uid
            bwrap = h.data["bwrap_pid"]
            status = Path(f"/proc/{bwrap}/status").read_text()
            uid = h.data["host_uid"]
            assert uid >= 0x40000000 and f"Uid:\t{uid}\t{uid}\t{uid}" in status
    finally:
        host_proc.kill()
        host_proc.wait()
        marker.unlink()


def test_capabilities_empty_and_no_new_privs(backend, bare_netns):
    with sandbox(backend, bare_netns) as h:
        status = backend.read_file(h, "/proc/self/status").decode()   # the agent's own status
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(fields[cap], 16) == 0, (cap, fields[cap])
        assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
        r = sh(backend, h, "grep CapEff /proc/self/status")
        assert r.stdout.split()[1] == b"0000000000000000"
        # the agent (pid 2, same uid) is not dumpable: its memory/environ/fds are off limits
        r = sh(backend, h, "cat /proc/2/cmdline; echo; cat /proc/2/environ")
        assert b"cubegate" in r.stdout and r.exit_code != 0 and b"Permission denied" in r.stderr, r


SYSCALL_PROBE = textwrap.dedent("""
    import ctypes, errno, json
    libc = ctypes.CDLL(None, use_errno=True)
    def call(nr, *args):
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
        return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    print(json.dumps({
        "ptrace_traceme": call(101, 0, 0, 0, 0),         # succeeds without the filter
        "keyctl_get_id": call(250, 0, -3, 0),            # KEYCTL_GET_KEYRING_ID(session): succeeds without it
        "userfaultfd_user": call(323, 1),                # UFFD_USER_MODE_ONLY: allowed unprivileged otherwise
        "io_uring_setup": call(425, 1, 0),               # EFAULT without the filter
        "perf_event_open": call(298, 0, 0, -1, -1, 0),   # EFAULT without it
        "unshare_user": call(272, 0x10000000),           # ENOSPC (--disable-userns) without it
        "mount": call(165, 0, 0, 0, 0, 0),
        "setns": call(308, -1, 0),                       # EBADF without it
        "bpf": call(321, 0, 0, 0),
        "clone_newnet": call(56, 0x40000000 | 17, 0, 0, 0, 0),
        "open_by_handle_at": call(304, -1, 0, 0),        # EBADF without it
        "reboot": call(169, 0, 0, 0, 0),
        "swapon": call(167, 0, 0),
        "pidfd_getfd": call(438, -1, 0, 0),              # EBADF without it
        "getpid": call(39),
    }))
""")


def run_bpf(prog: bytes, nr: int, arch: int = 0xC000003E, arg0: int = 0) -> int:
    """A tiny classic-BPF interpreter for the opcodes the filter uses (pure check of every entry)."""
    import struct as st
    data = st.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    ins = [st.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    for _ in range(len(ins)):
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc = st.unpack_from("<I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("program did not return")


def test_seccomp_program_decisions():
    from sandbox_runtime import seccomp as sc
    prog = sc.build_filter()
    allow, eperm, enosys = sc.SECCOMP_RET_ALLOW, sc.SECCOMP_RET_ERRNO | 1, sc.SECCOMP_RET_ERRNO | 38
    for name, nr in sc.DENIED_X86_64.items():
        assert run_bpf(prog, nr) == eperm, name
    for nr in (0, 1, 2, 39, 57, 59, 61, 231, 257, 434):      # read write open getpid fork execve wait4 ...
        assert run_bpf(prog, nr) == allow, nr
    assert run_bpf(prog, 56, arg0=0x01200011) == allow             # fork() as glibc does it
    assert run_bpf(prog, 56, arg0=0x003D0F00) == allow             # pthread_create
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert run_bpf(prog, 56, arg0=flag | 17) == eperm, hex(flag)
    assert run_bpf(prog, 435) == enosys                               # clone3: flags unreadable → ENOSYS
    assert run_bpf(prog, 0x40000000 | 39) == eperm                    # x32 ABI
    assert run_bpf(prog, 20, arch=0x40000003) == eperm                # i386 ABI


def test_seccomp_denies_with_eperm(backend, bare_netns):
    with sandbox(backend, bare_netns) as h:
        r = backend.exec(h, ["python3", "-c", SYSCALL_PROBE])
        assert r.exit_code == 0, r
        res = json.loads(r.stdout)
        assert res.pop("getpid") == "ok"
        assert res == {k: "EPERM" for k in res}, res
        r = sh(backend, h, "unshare -U true; mount -t tmpfs none /tmp")
        assert r.exit_code != 0 and r.stderr.count(b"Operation not permitted") >= 1, r


def test_two_sandboxes_do_not_see_each_other(backend, bare_netns):
    with sandbox(backend, bare_netns, tag="a") as a, sandbox(backend, bare_netns, tag="b") as b:
        sh(backend, a, "echo a-secret > /workspace/a.txt; echo a-tmp > /tmp/a.tmp; "
                       "sleep 41.5 >/dev/null 2>&1 &")
        r = sh(backend, b, "ls -A /workspace /tmp; cat /workspace/a.txt")
        assert r.stdout == b"/tmp:\n\n/workspace:\n" and b"a-secret" not in r.stdout, r
        assert b"41.5" not in sh(backend, b, "ps -eo args").stdout
        assert b"41.5" in sh(backend, a, "ps -eo args").stdout        # the probe itself works


# ------------------------------------------------------------------ survives its creator

CREATOR = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from sandbox_runtime.backend import SandboxSpec
    from sandbox_runtime.namespace import NamespaceBackend
    b = NamespaceBackend(Path(sys.argv[1]))
    h = b.create(SandboxSpec(sandbox_id=sys.argv[2], tenant="t"), sys.argv[3], ip="10.0.0.2", gateway_ip="10.0.0.1")
    b.exec(h, ["sh", "-c", "echo kept > /workspace/k"])
    print(json.dumps({"sandbox_id": h.sandbox_id, "backend": h.backend, "netns": h.netns, "data": h.data}))
""")


def test_sandbox_survives_its_creator_and_is_found_again(backend, bare_netns):
    sid = _sid("r")
    r = subprocess.run([sys.executable, "-c", CREATOR, str(backend.state_dir), sid, bare_netns],
                       capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 0, r.stderr
    h = Handle(**json.loads(r.stdout))
    try:
        fresh = NamespaceBackend(backend.state_dir)
        assert fresh.alive(h)
        assert fresh.exec(h, ["cat", "/workspace/k"]).stdout == b"kept\n"
        assert [x.sandbox_id for x in fresh.list() if x.sandbox_id == sid] == [sid]
    finally:
        NamespaceBackend(backend.state_dir).destroy(h)
    assert traces(h) == {"cgroups": [], "state_dir": False, "bwrap": False}


# ------------------------------------------------------------------ network, through the real gateway

POLICY = """\
name: ns-sandbox
default: deny
rules:
  - name: lab-api
    action: allow
    match: {hosts: [api.allowed.test], ports: [443, 80]}
"""
NET_SANDBOX = f"sb-ns1-{uuid.uuid4().hex[:6]}"     # cgroup paths are host-global: unique per run


@pytest.fixture(scope="module")
def nslab(lab, tmp_path_factory, agent_binary):
    from tests.gateway.switchlab import switch_lab

    tmp = tmp_path_factory.mktemp("nslab")
    with switch_lab(lab, tmp, POLICY, sandbox=NET_SANDBOX, tport=TPORT, prefix="cn",
                    settings_extra={"dns": {"listen_host": HUB_IP, "port": 53}}) as (gw, sw, net):
        b = NamespaceBackend(tmp / "state", ca_bundle=lab.ca.bundle_path)
        ok, why = b.available()
        if not ok:
            pytest.skip(why)
        h = b.create(SandboxSpec(sandbox_id=NET_SANDBOX, tenant="t"), net.netns, ip=net.ip, gateway_ip=HUB_IP)
        try:
            yield gw, sw, net, b, h
        finally:
            b.destroy(h)
            b.close()


def test_allowed_https_goes_through_the_gateway(nslab):
    gw, _, net, b, h = nslab
    # name resolved by the gateway's DNS (resolv.conf), TLS verified with the bundle the backend built
    r = b.exec(h, ["curl", "-sS", "--max-time", "5", "https://api.allowed.test/ns-allowed"], timeout=10)
    assert r.exit_code == 0 and b'"path": "/ns-allowed"' in r.stdout, (r, gw.log())
    dec = gw.wait_record(lambda x: x["event"] == "decision" and x.get("sandbox") == NET_SANDBOX
                         and x.get("host") == "api.allowed.test")
    assert dec["decision"] == "allow" and dec["client"].startswith(net.ip + ":")


def test_denied_host_is_refused(nslab, lab):
    gw, _, net, b, h = nslab
    r = b.exec(h, ["curl", "-sS", "--max-time", "5", "https://denied.test/ns-denied-dns"], timeout=10)
    assert r.exit_code == 6, r                   # the sandbox resolver does not answer for it
    # the connection reaches the gateway, which refuses it after the SNI (curl sees no TLS answer)
    r = b.exec(h, ["curl", "-sS", "--max-time", "2", "--resolve", "denied.test:443:198.18.0.12",
                   "https://denied.test/ns-denied"], timeout=10)
    assert r.exit_code != 0, r
    rec = gw.wait_record(lambda x: x["event"] == "decision" and x.get("sandbox") == NET_SANDBOX
                         and x.get("host") == "denied.test" and x.get("port") == 443)
    assert rec["decision"] == "deny"
    assert "ns-denied" not in lab.logs("upstream")


def test_sandboxes_on_the_switch_cannot_reach_each_other(nslab):
    gw, sw, net, b, h = nslab
    sid2 = _sid("ns2")
    net2 = sw.attach_sandbox(sid2)
    try:
        h2 = b.create(SandboxSpec(sandbox_id=sid2, tenant="t"), net2.netns, ip=net2.ip, gateway_ip=HUB_IP)
        try:
            # B serves two connections on 8000: its own probes before and after A's attempt
            server = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 8000)); s.listen()\n"
                      "for _ in range(2):\n c, _ = s.accept(); c.sendall(b'hello'); c.close()")
            t = threading.Thread(target=lambda: b.exec(h2, ["python3", "-c", server], timeout=8))
            t.start()
            probe = ("import socket, sys; s = socket.socket(); s.settimeout(2); "
                     "s.connect((sys.argv[1], 8000)); print(s.recv(5).decode())")
            deadline = time.monotonic() + 5     # server up: it answers on its own address
            while time.monotonic() < deadline:
                own = b.exec(h2, ["python3", "-c", probe, net2.ip], timeout=5)
                if own.stdout == b"hello\n":
                    break
                time.sleep(0.05)
            assert own.stdout == b"hello\n", own
            cross = b.exec(h, ["python3", "-c", probe, net2.ip], timeout=5)
            assert cross.exit_code != 0 and b"hello" not in cross.stdout, cross
            # and the server was up all along
            assert b.exec(h2, ["python3", "-c", probe, net2.ip], timeout=5).stdout == b"hello\n"
            t.join(10)
        finally:
            b.destroy(h2)
    finally:
        sw.detach_sandbox(sid2)


def test_cgroup_v2_kill_all_freezes_and_kills_a_fork_bomb():
    """The v2 code path on this host's (controller-less) unified hierarchy: freeze + kill are
    core cgroup v2 features, so kill_all can be exercised for real even where v1 is in use."""
    import signal
    import uuid as _uuid
    from sandbox_runtime.cgroups import SandboxCgroups
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.procs").exists():
        pytest.skip("no cgroup2 hierarchy mounted")
    d = unified / f"cgtest-{_uuid.uuid4().hex[:8]}"
    d.mkdir()
    proc = None
    try:
        cg = SandboxCgroups.from_json({"version": "v2", "paths": {"unified": str(d)}})
        # a shell that joins the cgroup, then forks without end (bounded by the test's kill)
        proc = subprocess.Popen(["sh", "-c", f"echo $$ > {d}/cgroup.procs; "
                                 "while :; do sleep 30 & done"], start_new_session=True)
        deadline = time.monotonic() + 5
        while len(cg.pids()) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(cg.pids()) >= 20
        cg.kill_all(timeout=5.0)      # cgroup.kill where the kernel has it, else freeze + SIGKILL
        assert not cg.pids()
        proc.wait(5)
        assert (d / "cgroup.freeze").read_text().strip() == "0"     # left thawed
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.02)


# ------------------------------------------------------------------ shared /etc

def test_shared_etc_names_no_sandbox_and_is_rebuilt_when_a_source_changes(tmp_path, agent_binary, bare_netns):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nCgMarkA\n-----END CERTIFICATE-----\n")
    b = NamespaceBackend(tmp_path / "state", ca_bundle=ca)
    with sandbox(b, bare_netns, tag="e1") as h1, sandbox(b, bare_netns, tag="e2") as h2:
        for h in (h1, h2):      # each sees its own name, from its own files
            r = sh(b, h, "cat /etc/hostname; grep -c . /etc/hosts; grep -c CgMarkA /etc/ssl/certs/ca-certificates.crt;"
                         " touch /etc/x 2>/dev/null || echo ro")
            assert r.stdout.decode().split() == [h.sandbox_id, "3", "1", "ro"], r
            assert h.sandbox_id.encode() in sh(b, h, "cat /etc/hosts").stdout
        shared = Path(h1.data["etc_dir"])
        assert h2.data["etc_dir"] == str(shared)          # one build for both
        for p in shared.rglob("*"):                       # nothing in it names a sandbox
            if p.is_file() and not p.is_symlink():
                data = p.read_bytes()
                assert h1.sandbox_id.encode() not in data and h2.sandbox_id.encode() not in data, p
                assert p.stat().st_uid == 0 and (p.stat().st_mode & 0o777) == 0o644
        ca.write_bytes(ca.read_bytes() + b"-----BEGIN CERTIFICATE-----\nCgMarkB\n-----END CERTIFICATE-----\n")
        with sandbox(b, bare_netns, tag="e3") as h3:
            assert h3.data["etc_dir"] != str(shared)
            assert shared.is_dir()                        # still used by the two running ones
            assert sh(b, h3, "grep -c CgMarkB /etc/ssl/certs/ca-certificates.crt").stdout == b"1\n"
            assert sh(b, h1, "grep -c CgMarkB /etc/ssl/certs/ca-certificates.crt").stdout == b"0\n"
    with sandbox(b, bare_netns, tag="e4") as h4:
        pass
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nCgMarkC\n-----END CERTIFICATE-----\n")
    with sandbox(b, bare_netns, tag="e5") as h5:          # a rebuild prunes builds nobody uses
        assert sorted(p.name for p in shared.parent.iterdir()) == [Path(h5.data["etc_dir"]).name]
    assert Path(h4.data["etc_dir"]) != Path(h5.data["etc_dir"])
    import shutil
    shutil.rmtree(b.roots_dir, ignore_errors=True)
