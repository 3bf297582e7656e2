"""Hand the sandbox's cubevs address to the guest.

cubevs made the namespace with eth0 = <ip>/32 and the MAC the switch expects (it checks
both on every frame). The VM must own them, so inside that namespace eth0 loses its
address (and ARP/multicast, so the namespace's own stack stays silent), a tap is created
for qemu, and tc joins the two like a wire: whatever arrives on one leaves on the other
(u32 match-all + mirred redirect, both directions; no bridge, no MAC learning). The guest
NIC takes eth0's MAC and the sandbox IP.
"""
from __future__ import annotations

import json
import os
import subprocess

from sandbox_runtime.backend import SandboxError

TAP = "cgtap0"


def _batch(tool: str, netns: str, cmds: list[str], *, force: bool = False) -> subprocess.CompletedProcess:
    argv = [tool, "-n", netns, *(["-force"] if force else []), "-batch", "-"]
    return subprocess.run(argv, input="\n".join(cmds) + "\n", capture_output=True, text=True, timeout=15)


def ip_setup_cmds(uid: int | None = None) -> list[str]:
    owner = f" user {uid} group {uid}" if uid is not None else ""   # qemu runs as that uid
    return ["addr flush dev eth0", "route flush dev eth0", "link set eth0 arp off multicast off",
            f"tuntap add dev {TAP} mode tap{owner}", f"link set {TAP} arp off multicast off", f"link set {TAP} up"]


def _wire(a: str, b: str) -> str:
    return f"filter add dev {a} ingress protocol all pref 1 u32 match u32 0 0 action mirred egress redirect dev {b}"


def tc_setup_cmds() -> list[str]:
    return ["qdisc add dev eth0 clsact", f"qdisc add dev {TAP} clsact", _wire("eth0", TAP), _wire(TAP, "eth0")]


def teardown_cmds(ip: str | None, gateway_ip: str | None) -> tuple[list[str], list[str]]:
    """(tc, ip) commands; deleting the tap also removes its qdisc and filter."""
    ip_cmds = [f"link del {TAP}", "link set eth0 arp on multicast on"]
    if ip and gateway_ip:   # give cubevs its namespace back as it made it
        ip_cmds += [f"addr add {ip}/32 dev eth0", f"route add {gateway_ip}/32 dev eth0 scope link",
                    f"route add default via {gateway_ip} dev eth0 onlink"]
    return ["qdisc del dev eth0 clsact"], ip_cmds


def eth0_mac(netns: str) -> str:
    r = subprocess.run(["ip", "-n", netns, "-j", "link", "show", "dev", "eth0"],
                       capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise SandboxError(f"network namespace {netns}: no eth0")
    return json.loads(r.stdout)[0]["address"]


def setup(netns: str, uid: int | None = None) -> str:
    """Wire eth0 to a fresh tap (owned by `uid`); returns the MAC the guest must use (eth0's)."""
    if not os.path.exists(f"/run/netns/{netns}"):
        raise SandboxError(f"network namespace {netns} does not exist")
    mac = eth0_mac(netns)
    for tool, cmds in (("ip", ip_setup_cmds(uid)), ("tc", tc_setup_cmds())):
        r = _batch(tool, netns, cmds)
        if r.returncode != 0:
            teardown(netns)
            raise SandboxError(f"tap setup in {netns} failed: {r.stderr.strip()[-300:]}")
    return mac


def teardown(netns: str, ip: str | None = None, gateway_ip: str | None = None) -> None:
    """Idempotent; a missing namespace means nothing is left."""
    if netns and os.path.exists(f"/run/netns/{netns}"):
        tc_cmds, ip_cmds = teardown_cmds(ip, gateway_ip)
        _batch("tc", netns, tc_cmds, force=True)
        _batch("ip", netns, ip_cmds, force=True)


def leftovers(netns: str) -> list[str]:
    """What of ours is still in the namespace (the tap, eth0's clsact qdisc)."""
    out = []
    r = subprocess.run(["ip", "-n", netns, "-j", "link", "show"], capture_output=True, text=True, timeout=10)
    if r.returncode == 0 and any(l["ifname"] == TAP for l in json.loads(r.stdout)):
        out.append(TAP)
    r = subprocess.run(["tc", "-n", netns, "qdisc", "show", "dev", "eth0"], capture_output=True, text=True,
                       timeout=10)
    if "clsact" in r.stdout:
        out.append("eth0:clsact")
    return out
