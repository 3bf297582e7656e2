"""Fault 1: kill -9 the gateway in the middle of a transfer (explicit and transparent mode).

What must hold:
  - the transfer in flight fails (the client sees a truncated body, never a complete one);
  - while the gateway is dead the sandbox has no egress at all (transparent: no direct
    TCP to an upstream IP, no DNS, neither ours nor a foreign resolver; explicit: proxy refused);
  - every request the client got an answer for has its audit record on disk;
  - after a restart (index file corrupted, torn last audit line) `cubegate audit query`
    finds all of them;
  - traffic resumes after the restart, without re-attaching the sandbox.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import time
import uuid

import pytest

from testbed import netns
from tests.faults.helpers import eventually, report
from tests.gateway.harness import Gateway
from tests.gateway.switchlab import HUB_IP, switch_lab

TPORT = 18079
SANDBOX_T = "sb-k9t"
POLICY = """\
name: kill9
default: deny
rules:
  - name: lab-api
    action: allow
    match: {hosts: [api.allowed.test], ports: [443, 80]}
"""
TRANSFER = 40_000_000           # bytes; at 4 MB/s the transfer lasts ~10 s: the kill lands mid-way
RATE = "4M"
_NO_PROXY_ENV = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


def _kill9(gw: Gateway) -> None:
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)


def _kill_mid_transfer(transfer, out, gw) -> tuple[int, int, float]:
    """SIGKILL the gateway once the download is under way; (client rc, bytes got, s to fail)."""
    try:
        assert _wait_growing(out, 1_000_000), "transfer did not start"
        t_kill = time.monotonic()
        _kill9(gw)
        rc = transfer.wait(20)
        fail_s = time.monotonic() - t_kill
    finally:
        if transfer.poll() is None:
            transfer.kill()
            transfer.wait(5)
        transfer.stderr.close()
    return rc, out.stat().st_size, fail_s


def _tear_audit_and_index(gw: Gateway) -> None:
    """What a crash can leave: a half-written last line, and a broken index file."""
    with open(gw.audit_dir / "audit-current.jsonl", "ab") as f:
        f.write(b'{"id":"torn","ts":"2026-')
    # Both indexes: the daemon's (state/audit-index.db) and the one `cubegate audit query` keeps.
    indexes = [gw.state_dir / "audit-index.db", gw.audit_dir / "index.sqlite3"]
    assert all(p.exists() for p in indexes), indexes
    for idx in indexes:
        with open(idx, "r+b") as f:
            f.write(b"garbage, not sqlite" * 10)


def _query_paths(gw: Gateway, sandbox: str) -> set[str]:
    out = gw.cli("audit", "query", "--sandbox", sandbox, "--event", "request", "--limit", "10000", "--json")
    return {json.loads(l).get("path") for l in out.splitlines() if l.strip()}


def _on_disk_paths(gw: Gateway) -> set[str]:
    out = set()
    for f in gw.audit_dir.glob("*.jsonl"):
        for line in f.read_bytes().split(b"\n"):
            try:
                out.add(json.loads(line).get("path"))
            except ValueError:
                pass  # the torn line
    return out


def _wait_growing(path, min_bytes: int, timeout: float = 10.0) -> int:
    return eventually(lambda: (path.stat().st_size if path.exists() else 0) >= min_bytes and path.stat().st_size,
                      timeout)


# ---------------------------------------------------------------- explicit mode
@pytest.fixture
def egw(lab, tmp_path):
    gw = Gateway(lab, tmp_path / "gw", {"p.yaml": POLICY}, sandboxes={"sb-k9": {}})
    gw.start()
    yield gw
    gw.stop()


def test_kill9_explicit_mode(egw, lab, tmp_path):
    tag = uuid.uuid4().hex[:8]
    acked = []
    for i in range(20):
        r = egw.curl(f"http://api.allowed.test/ack-{tag}-{i}", sandbox="sb-k9")
        assert r.status == 200, r
        acked.append(f"/ack-{tag}-{i}")
    assert eventually(lambda: set(acked) <= _query_paths(egw, "sb-k9"), 5)   # builds the CLI index
    out = tmp_path / "transfer.bin"
    argv = ["curl", "-sS", "--max-time", "30", "--limit-rate", RATE, "--cacert", str(lab.ca.bundle_path),
            "-x", egw.proxy_url("sb-k9"), "-o", str(out), f"https://api.allowed.test/bytes?n={TRANSFER}"]
    transfer = lab.spawn_gw(argv, lab_dns=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rc, got, fail_s = _kill_mid_transfer(transfer, out, egw)
    assert rc != 0 and got < TRANSFER, (rc, got)
    # Dead gateway: the proxy port refuses, nothing gets out through it.
    r = egw.curl("http://api.allowed.test/while-dead", sandbox="sb-k9", timeout=3)
    assert r.rc != 0 and r.status == 0, r
    # Acknowledged requests are on disk already (one write() per record before the answer).
    assert set(acked) <= _on_disk_paths(egw)
    _tear_audit_and_index(egw)
    t0 = time.monotonic()
    egw.start()
    restart_s = time.monotonic() - t0
    assert set(acked) <= _query_paths(egw, "sb-k9")
    r = egw.curl(f"http://api.allowed.test/after-{tag}", sandbox="sb-k9")
    assert r.status == 200, r
    assert f"/after-{tag}" in eventually(lambda: f"/after-{tag}" in _query_paths(egw, "sb-k9")
                                         and _query_paths(egw, "sb-k9"), 5)
    # The restart cut the torn line off: new records did not glue onto it.
    for line in (egw.audit_dir / "audit-current.jsonl").read_bytes().splitlines():
        json.loads(line)
    report("kill9-explicit", transfer_bytes_before_kill=got, client_failed_after_s=round(fail_s, 2),
           acked=len(acked), acked_found=len(set(acked) & _query_paths(egw, "sb-k9")),
           restart_to_ready_s=round(restart_s, 2))


# ------------------------------------------------------------- transparent mode
def _dns_query(server: str, name: str = "api.allowed.test", timeout: float = 1.5) -> bytes | None:
    qid = os.getpid() & 0xFFFF
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(q, (server, 53))
        return s.recv(512)
    except OSError:
        return None
    finally:
        s.close()


def _tcp_connect(ip: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as s:
            # A REDIRECT to a closed port resets; an accepted connection must also carry data.
            s.sendall(b"GET / HTTP/1.0\r\nHost: api.allowed.test\r\n\r\n")
            s.settimeout(timeout)
            return bool(s.recv(1))
    except OSError:
        return False


def _sandbox_curl(lab, net, *args, timeout=10):
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "curl", "-sS", "--max-time", str(timeout),
            "--cacert", str(lab.ca.bundle_path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5, env=_NO_PROXY_ENV)


@pytest.fixture
def tgw(lab, tmp_path):
    with switch_lab(lab, tmp_path, POLICY, sandbox=SANDBOX_T, tport=TPORT, prefix="ck",
                    settings_extra={"dns": {"listen_host": HUB_IP, "port": 53}}) as env:
        yield env


def test_kill9_transparent_mode(tgw, lab, tmp_path):
    gw, sw, net = tgw
    tag = uuid.uuid4().hex[:8]
    resolve = ("--resolve", "api.allowed.test:80:198.18.0.10", "--resolve", "api.allowed.test:443:198.18.0.10")
    acked = []
    for i in range(10):
        r = _sandbox_curl(lab, net, *resolve, "-o", "/dev/null", "-w", "%{http_code}",
                          f"http://api.allowed.test/tack-{tag}-{i}")
        assert r.stdout == "200", (r, gw.log())
        acked.append(f"/tack-{tag}-{i}")
    assert eventually(lambda: set(acked) <= _query_paths(gw, SANDBOX_T), 5)
    assert netns.call_in_netns(net.netns, _dns_query, HUB_IP), "sandbox DNS should answer before the kill"
    out = tmp_path / "t-transfer.bin"
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "curl", "-sS", "--max-time", "30", "--limit-rate", RATE,
            "--cacert", str(lab.ca.bundle_path), *resolve, "-o", str(out),
            f"https://api.allowed.test/bytes?n={TRANSFER}"]
    transfer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_NO_PROXY_ENV)
    rc, got, _ = _kill_mid_transfer(transfer, out, gw)
    assert rc != 0 and got < TRANSFER, (rc, got)
    # No egress at all with the gateway dead: steered ports, other ports, our DNS, a foreign DNS.
    probes = {
        "tcp 198.18.0.10:443": netns.call_in_netns(net.netns, _tcp_connect, "198.18.0.10", 443),
        "tcp 198.18.0.10:80": netns.call_in_netns(net.netns, _tcp_connect, "198.18.0.10", 80),
        "tcp 198.18.0.10:8443": netns.call_in_netns(net.netns, _tcp_connect, "198.18.0.10", 8443),
        "dns hub": netns.call_in_netns(net.netns, _dns_query, HUB_IP) is not None,
        "dns foreign": netns.call_in_netns(net.netns, _dns_query, lab.net_addr) is not None,
    }
    assert not any(probes.values()), probes
    assert set(acked) <= _on_disk_paths(gw)
    _tear_audit_and_index(gw)
    gw.start()
    assert set(acked) <= _query_paths(gw, SANDBOX_T)
    # Same sandbox, same namespace, not re-attached: traffic and DNS are back.
    assert sw.sandbox(SANDBOX_T) is not None
    r = _sandbox_curl(lab, net, *resolve, "-o", "/dev/null", "-w", "%{http_code}",
                      f"https://api.allowed.test/tafter-{tag}")
    assert r.stdout == "200", (r, gw.log())
    assert netns.call_in_netns(net.netns, _dns_query, HUB_IP)
    report("kill9-transparent", transfer_bytes_before_kill=got, acked=len(acked),
           egress_probes_while_dead=len(probes), egress_probes_succeeding=sum(probes.values()))
