"""microvm backend against real QEMU: one template snapshot per session, sandboxes restored
from it, attached to a real cubevs switch with the real gateway in transparent mode.

Slow: the first run probes the accelerator and boots the template (~30 s); guest assets
are built into .cache/microvm if missing (downloads Debian's cloud kernel).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from sandbox_runtime.backend import Limits, SandboxError, SandboxSpec
from tests.gateway.switchlab import HUB_IP, switch_lab


TPORT = 18078
SANDBOX = "sb-vm1"
POLICY = """\
name: microvm
default: deny
rules:
  - name: lab-api
    action: allow
    match: {hosts: [api.allowed.test], ports: [80, 443]}
"""


@pytest.fixture(scope="session")
def microvm(lab, agent_binary):
    """MicrovmBackend with assets built and the 256 MB template booted once for the session."""
    from sandbox_runtime.microvm import MicrovmBackend, assets, vm

    if shutil.which(vm.QEMU) is None:
        pytest.skip("qemu-system-x86 not installed")
    if not assets.assets_ready(assets.DEFAULT_ASSETS_DIR, agent_binary)[0]:   # missing, or another agent
        assets.build(assets.DEFAULT_ASSETS_DIR, agent=agent_binary, force=True)
    state = Path(tempfile.mkdtemp(prefix="cgvm", dir="/tmp"))   # short: unix socket paths
    b = MicrovmBackend(state, assets.DEFAULT_ASSETS_DIR, ca_bundle=lab.ca.bundle_path, agent_binary=agent_binary)
    ok, why = b.available()
    assert ok, why
    b.template_for(Limits())
    try:
        yield b
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def vmlab(lab, tmp_path_factory):
    with switch_lab(lab, tmp_path_factory.mktemp("vmlab"), POLICY, sandbox=SANDBOX, tport=TPORT, prefix="cm",
                    settings_extra={"dns": {"listen_host": HUB_IP, "port": 53}}) as env:
        yield env


@pytest.fixture(scope="module")
def vm1(microvm, vmlab):
    _, _, net = vmlab
    spec = SandboxSpec(SANDBOX, "t", "microvm", Limits(), env={"CG_GREETING": "hello-vm"},
                       files={"in/data.txt": b"payload\n"})
    h = microvm.create(spec, net.netns, ip=net.ip, gateway_ip=HUB_IP)
    try:
        yield h
    finally:
        microvm.destroy(h)


def sh(microvm, h, script: str, **kw):
    return microvm.exec(h, ["sh", "-c", script], **kw)


# ---------------------------------------------------------------- pure parts (fast)
def _parse_newc(blob: bytes) -> dict[str, tuple[int, bytes]]:
    out, off = {}, 0
    while True:
        assert blob[off:off + 6] == b"070701"
        f = [int(blob[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = f[1], f[6], f[11]
        name = blob[off + 110: off + 110 + namesize - 1].decode()
        off = (off + 110 + namesize + 3) & ~3
        data = blob[off: off + size]
        off = (off + size + 3) & ~3
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, data)


def test_initramfs_is_valid_newc_with_init_agent_modules_and_applets():
    import gzip

    from sandbox_runtime.microvm import assets
    blob = assets.build_initramfs(b"BB", ["sh", "ip", "busybox"], {"virtio_net": b"KO"}, b"AGENT")
    assert blob == assets.build_initramfs(b"BB", ["sh", "ip", "busybox"], {"virtio_net": b"KO"}, b"AGENT")
    ents = _parse_newc(gzip.decompress(blob))
    assert ents["init"][0] == 0o100755 and b"cg-serve" in ents["init"][1]
    assert b"--serve-fd /dev/virtio-ports/cubegate.agent" in ents["sbin/cg-serve"][1]
    assert ents["sbin/cubegate-agent"] == (0o100755, b"AGENT")
    assert ents["bin/sh"] == (0o120777, b"busybox") and "bin/busybox" in ents
    assert ents["lib/modules/virtio_net.ko"][1] == b"KO" and ents["tmp"][0] == 0o041777


def test_module_order_is_checked_against_modinfo():
    from sandbox_runtime.microvm import assets
    assert assets.modinfo_depends(b"\0license=GPL\0depends=virtio_ring,virtio\0x") == ["virtio_ring", "virtio"]
    assets.check_module_order(["virtio_ring", "virtio"], {"virtio": ["virtio_ring"]})
    with pytest.raises(RuntimeError, match="virtio_ring"):
        assets.check_module_order(["virtio", "virtio_ring"], {"virtio": ["virtio_ring"]})


def test_restore_command_line_matches_the_template_boot():
    from sandbox_runtime.microvm import template, vm
    t = template.Template(snapshot="/a/state", accel="tcg", memory_mb=256, cpus=2, tsc_khz=2_000_000)
    boot = vm.qemu_argv(template.vm_config(Path("/a"), "/r", memory_mb=256, cpus=2, accel="tcg", tsc=2_000_000))
    rest = vm.qemu_argv(template.restore_config(Path("/a"), t, "/r", tap="cgtap0", mac="02:00:00:00:00:09",
                                                incoming_fd=7, runas="1234:1234"))
    # migration needs the same machine, memory, cpus, kernel command line and device order
    i = rest.index("-runas")
    assert rest[i:i + 4] == ["-runas", "1234:1234", "-sandbox",
                             "on,obsolete=deny,spawn=deny,resourcecontrol=deny"]
    rest_core = rest[:i] + rest[i + 4:]
    strip = lambda a: [x for x in a if not x.startswith(("virtio-net-device", "tap,", "fd:"))
                       and x not in ("-netdev", "-incoming")]
    assert strip(boot) == strip(rest_core)
    assert "tsc_early_khz=2000000" in boot[boot.index("-append") + 1]
    assert rest[rest.index("-incoming") + 1] == "fd:7" and "-runas" not in boot
    assert "virtio-net-device,mac=02:00:00:00:00:09,netdev=net0" in rest


def test_tap_wiring_commands():
    from sandbox_runtime.microvm import netplumb
    tc = netplumb.tc_setup_cmds()
    assert any("dev eth0 ingress" in c and "redirect dev cgtap0" in c for c in tc)
    assert any("dev cgtap0 ingress" in c and "redirect dev eth0" in c for c in tc)
    assert "addr flush dev eth0" in netplumb.ip_setup_cmds()
    _, ip_cmds = netplumb.teardown_cmds("10.200.0.5", "10.200.0.1")
    assert "addr add 10.200.0.5/32 dev eth0" in ip_cmds and ip_cmds[0] == "link del cgtap0"


@pytest.mark.slow
@pytest.mark.netns
def test_exec_stdout_stderr_exit_code_env_stdin(microvm, vm1):
    r = microvm.exec(vm1, ["echo", "hi from the guest"])
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"hi from the guest\n", False)
    r = sh(microvm, vm1, 'echo "$CG_GREETING $X"; echo oops >&2; cat; exit 7', env={"X": "extra"}, stdin=b"in!")
    assert r.exit_code == 7 and r.stdout == b"hello-vm extra\nin!" and r.stderr == b"oops\n"
    assert sh(microvm, vm1, "pwd").stdout == b"/workspace\n"
    # a guest kernel, not the host's
    assert b"cloud-amd64" in microvm.exec(vm1, ["uname", "-r"]).stdout


@pytest.mark.slow
@pytest.mark.netns
def test_exec_timeout_kills_and_stream_stays_usable(microvm, vm1):
    r = sh(microvm, vm1, "sleep 30; echo never", timeout=1.0)
    assert r.timed_out and r.exit_code == 124 and b"never" not in r.stdout
    assert microvm.exec(vm1, ["echo", "after"]).stdout == b"after\n"


@pytest.mark.slow
@pytest.mark.netns
def test_a_late_stdin_eof_frame_does_not_desync_the_serial_stream(microvm, vm1):
    """The agent may finish an exec before it read the client's 'i' (stdin EOF) frame; that
    frame is then taken as the next request and answered with a stray 'F'. The channel's
    barrier after each exec must swallow it, so the next request still works."""
    from sandbox_runtime.agent.client import encode_exec, encode_frame, recv_frame

    ch = microvm._channel(vm1)

    def late_eof(_client):
        s = ch._connect()
        s.sendall(encode_frame(b"E", encode_exec(["true"], 5.0, {}, "/")))
        time.sleep(0.5)                      # `true` is long gone
        s.sendall(encode_frame(b"i"))
        while (kind := recv_frame(s)[0]) != b"X":
            assert kind in (b"S", b"O", b"R")     # S: the pid, agent 2
        return kind

    assert ch.exec(late_eof) == b"X"
    assert microvm.read_file(vm1, "/etc/hostname") == b"sandbox\n"
    assert microvm.exec(vm1, ["echo", "in sync"]).stdout == b"in sync\n"


@pytest.mark.slow
@pytest.mark.netns
def test_files_written_read_and_given_at_creation(microvm, vm1):
    assert microvm.read_file(vm1, "/workspace/in/data.txt") == b"payload\n"
    blob = os.urandom(200_000)
    microvm.write_file(vm1, "/workspace/out/blob.bin", blob, 0o600)
    assert microvm.read_file(vm1, "/workspace/out/blob.bin") == blob
    assert sh(microvm, vm1, "stat -c %a /workspace/out/blob.bin").stdout == b"600\n"
    with pytest.raises(SandboxError):
        microvm.read_file(vm1, "/workspace/does-not-exist")
    # the CA bundle given to the backend is installed
    ca = Path(microvm.ca_bundle).read_bytes().strip()
    assert ca in microvm.read_file(vm1, "/etc/ssl/certs/ca-certificates.crt")


@pytest.mark.slow
@pytest.mark.netns
def test_guest_owns_the_sandbox_address_and_mac(microvm, vm1, vmlab):
    _, _, net = vmlab
    out = sh(microvm, vm1, "ip -o addr show dev eth0; ip link show dev eth0; ip route; cat /etc/resolv.conf").stdout
    assert f"inet {net.ip}/32".encode() in out and net.mac.lower().encode() in out.lower()
    assert f"default via {HUB_IP}".encode() in out and f"nameserver {HUB_IP}".encode() in out
    # the namespace itself no longer carries the address: only the guest speaks on the link
    import subprocess
    ns = subprocess.run(["ip", "-n", net.netns, "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    assert net.ip not in ns


@pytest.mark.slow
@pytest.mark.netns
def test_traffic_goes_through_switch_and_transparent_gateway(microvm, vm1, vmlab, lab):
    gw, _, net = vmlab
    # allowed: name resolved by the gateway's DNS (resolv.conf), TCP 80 steered to the gateway
    r = sh(microvm, vm1, "timeout 10 wget -q -O - http://api.allowed.test/t-vm-allow", timeout=20)
    assert r.exit_code == 0 and b'"path": "/t-vm-allow"' in r.stdout, (r, gw.log())
    rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/t-vm-allow")
    assert rec["sandbox"] == SANDBOX and rec["decision"] == "allow" and rec["client"].startswith(net.ip + ":")
    # denied: dialling an IP with a denied Host header is decided (and audited) by the gateway
    r = sh(microvm, vm1, "timeout 10 wget -q -O - --header 'Host: denied.test' http://198.18.0.12/t-vm-deny",
           timeout=20)
    assert r.exit_code != 0, r
    rec = gw.wait_record(lambda x: x.get("sandbox") == SANDBOX and x.get("host") == "denied.test"
                         and x.get("decision") == "deny")
    assert rec["reason"] == "default_deny"
    # no path around the gateway: other ports are dropped by the switch
    r = sh(microvm, vm1, "nc -w 3 198.18.0.10 8443 </dev/null && echo CONNECTED", timeout=15)
    assert b"CONNECTED" not in r.stdout
    assert "t-vm-deny" not in lab.logs("upstream")
    # the guest never sent a frame the switch took for a spoof or a foreign protocol
    bad = [x for x in gw.audit_records() if x.get("event") == "net_drop" and x.get("sandbox") == SANDBOX
           and x.get("reason") in ("spoof_mac", "spoof_ip", "arp_spoof", "ipv6", "ethertype", "malformed")]
    assert not bad, [(x["ts"], x["reason"], x.get("extra")) for x in bad]


@pytest.mark.slow
@pytest.mark.netns
def test_memory_hog_is_killed_inside_the_guest_and_the_vm_lives_on(microvm, vm1):
    # guest RAM is the limit (256 MB): a 300 MB buffer cannot be had
    r = microvm.exec(vm1, ["dd", "if=/dev/zero", "of=/dev/null", "bs=300M", "count=1"], timeout=30)
    assert r.exit_code != 0 and not r.timed_out, r
    assert microvm.alive(vm1) and microvm.exec(vm1, ["echo", "still here"]).stdout == b"still here\n"


@pytest.mark.slow
@pytest.mark.netns
def test_pause_resume_alive_usage(microvm, vm1):
    u = microvm.usage(vm1)
    assert u["rss_bytes"] > 32 << 20 and u["cgroup_memory_bytes"] > 0 and u["pids"] >= 1
    microvm.pause(vm1)
    try:
        with pytest.raises(SandboxError):        # a stopped VM does not answer
            microvm.exec(vm1, ["true"], timeout=0.5)
    finally:
        microvm.resume(vm1)
    assert microvm.alive(vm1)
    assert microvm.exec(vm1, ["echo", "back"]).stdout == b"back\n"


@pytest.mark.slow
@pytest.mark.netns
def test_vm_survives_its_backend_and_a_new_one_finds_it(microvm, vm1):
    """Daemon restart: qemu runs in its own session; a fresh backend with the stored handle
    (JSON round trip) reaches the same VM."""
    import json

    from sandbox_runtime.backend import Handle
    from sandbox_runtime.microvm import MicrovmBackend

    microvm.exec(vm1, ["sh", "-c", "echo 1 > /tmp/marker"])
    microvm.close()                       # the old daemon goes away
    h2 = Handle(**json.loads(json.dumps(vm1.__dict__)))
    other = MicrovmBackend(microvm.state_dir, microvm.assets_dir, agent_binary=microvm.agent_binary)
    try:
        assert other.alive(h2)
        assert other.exec(h2, ["cat", "/tmp/marker"]).stdout == b"1\n"
    finally:
        other.close()
    assert microvm.exec(vm1, ["echo", "old one again"]).exit_code == 0


@pytest.mark.slow
@pytest.mark.netns
def test_destroy_leaves_nothing_behind(microvm, vmlab):
    import subprocess

    from sandbox_runtime.microvm import netplumb, vm
    from sandbox_runtime.uids import sandbox_uid

    _, sw, _ = vmlab
    net = sw.attach_sandbox("sb-vm2")
    try:
        t0 = time.monotonic()
        h = microvm.create(SandboxSpec("sb-vm2", "t", "microvm", Limits()), net.netns, ip=net.ip, gateway_ip=HUB_IP)
        print(f"restore-to-ready: {time.monotonic() - t0:.2f} s")
        pid, run_dir = h.data["pid"], h.data["run_dir"]
        # qemu dropped root: its own uid, seccomp on (a guest escape lands unprivileged)
        status = Path(f"/proc/{pid}/status").read_text()
        uid_line = next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1:]
        assert set(uid_line) == {str(sandbox_uid(net.ip))}
        assert next(l for l in status.splitlines() if l.startswith("Seccomp:")).split()[1] == "2"
        cgs = list(h.data["cgroups"]["paths"].values())
        assert vm.pid_alive(pid) and all(os.path.isdir(p) for p in cgs)
        assert netplumb.leftovers(net.netns) == [netplumb.TAP, "eth0:clsact"]
        microvm.destroy(h)
        assert not vm.pid_alive(pid)
        assert not any(os.path.exists(p) for p in cgs)
        assert not os.path.exists(run_dir)
        assert netplumb.leftovers(net.netns) == []
        # the namespace is handed back as cubevs made it
        out = subprocess.run(["ip", "-n", net.netns, "-o", "addr", "show", "dev", "eth0"], capture_output=True,
                             text=True, timeout=10).stdout
        assert f"{net.ip}/32" in out
        assert not microvm.alive(h)
        microvm.destroy(h)                      # idempotent
    finally:
        sw.detach_sandbox("sb-vm2")
