"""The switch program's decisions, frame by frame, with BPF_PROG_TEST_RUN: no sandbox
namespaces, no switch veths.  The maps are populated by the real control plane (EbpfBackend, as the Switch
does) in a private bpffs; each crafted frame is run once in the kernel and must give
the expected verdict (TC_ACT_OK / TC_ACT_SHOT), count exactly one packet of its length
under the expected reason, and, for drops, report one event with that reason.

What the kernel here (6.18) allows for a tc test run: ctx = a zeroed __sk_buff prefix
where only mark, priority, ingress_ifindex and ifindex may be set (EINVAL otherwise);
ifindex must exist in the caller's netns (ENODEV; default lo), so the sandbox entry is
keyed by lo's ifindex; an IPv4 frame must hold a full IP header (>= 34 bytes), an IPv6
one >= 54, other ethertypes >= 14; at most 3712 bytes (a page minus head/tailroom);
data_out smaller than the packet fails with ENOSPC.

The runs happen in a namespace of this module's own (lo forwarding, a veth pair routing the
"internet" ranges, the hub's address HUB_OWN on it): an l4-allowed packet is looked up in
the FIB of the caller's netns (hub_delivers_locally), which must be the hub's stand-in."""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile

import secrets
import subprocess

import pytest

from cubevs import build, datapath, libbpf, netns
from cubevs.ebpf_backend import EbpfBackend
from cubevs.libbpf import TC_ACT_OK, TC_ACT_SHOT, BpfError, SkBuffCtx, prog_test_run
from cubevs.policy import normalize_l4
from cubevs.registry import Entry
from cubevs.switch_schema import REASON_CODES, SandboxVal, verdict_of

from cubevs_pkt import (ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, arp_request, eth, ipv4, ipv4_icmp_echo,
                        ipv4_tcp, ipv4_udp, ipv6_udp)

LO = 1                      # the test-run device; stands in for a sandbox's hub-side veth
GW = "10.200.0.1"
HUB_ADDR = "192.0.2.53"     # an extra hub address (hub_addrs)
A, A_MAC, A_NO = "10.200.0.5", "02:00:00:00:00:05", 7
B, B_MAC = "10.200.0.6", "02:00:00:00:00:06"      # another sandbox's address
HUB_MAC, BCAST = "02:00:00:00:00:01", "ff:ff:ff:ff:ff:ff"
EVIL_MAC = "02:00:de:ad:be:ef"
INET, INET_NET = "198.51.100.10", "198.51.100.0/24"
ANY_UDP_NET, ANY_UDP = "203.0.113.0/24", "203.0.113.9"
L4_RULES = [(f"{INET}/32", 5432, "tcp"), (ANY_UDP_NET, 0, "udp"), (INET_NET, 0, "icmp")]
HUB_OWN = "198.51.100.1"    # the hub's own address in an allowed range (its uplink, say)
MF = 0x2000                 # IPv4 "more fragments" flag


def ip_frame(l3: bytes, src_mac: str = A_MAC) -> bytes:
    return eth(HUB_MAC, src_mac, ETH_P_IP) + l3


def arp_frame(sha: str, spa: str, tpa: str, *, src_mac: str | None = None, **kw) -> bytes:
    return eth(BCAST, src_mac or sha, ETH_P_ARP) + arp_request(sha, spa, tpa, **kw)


def udp(dst, dport, src=A, **kw):
    return ip_frame(ipv4_udp(src, dst, 40000, dport, b"payload", **kw))


def tcp(dst, dport, src=A, **kw):
    return ip_frame(ipv4_tcp(src, dst, 40000, dport, **kw))


# (case, frame, reason); the verdict follows from the reason (verdict_of)
TABLE = [
    ("dns udp to the gateway", udp(GW, 53), "dns"),
    ("dns tcp to the gateway", tcp(GW, 53), "dns"),
    ("explicit proxy port", tcp(GW, 8080), "gateway"),
    ("transparent port", tcp(GW, 8081), "gateway"),
    ("gateway port on a hub address", tcp(HUB_ADDR, 8080), "gateway"),
    ("dns to a hub address that is not the gateway", udp(HUB_ADDR, 53), "host_service"),
    ("udp host service", udp(GW, 5353), "host_service"),
    ("tcp host service", tcp(GW, 2222), "host_service"),
    ("gateway port over udp", udp(GW, 8080), "host_service"),
    ("loopback destination", tcp("127.0.0.1", 80), "host_service"),
    ("this-network destination", udp("0.0.0.0", 53), "host_service"),
    ("multicast", udp("224.0.0.251", 5353), "host_service"),
    ("limited broadcast", udp("255.255.255.255", 67), "host_service"),
    ("tcp 443 out", tcp(INET, 443), "web"),
    ("tcp 80 out", tcp(INET, 80), "web"),
    ("udp 443 (quic)", udp(INET, 443), "quic"),
    ("dns udp to a foreign resolver", udp(INET, 53), "foreign_dns"),
    ("dns tcp to a foreign resolver", tcp("8.8.8.8", 53), "foreign_dns"),
    ("sandbox to sandbox udp", udp(B, 53), "sandbox_to_sandbox"),
    ("sandbox to sandbox tcp 443 (not steered)", tcp(B, 443), "sandbox_to_sandbox"),
    ("sandbox to the pool's far end", tcp("10.200.255.254", 8080), "sandbox_to_sandbox"),
    ("spoofed source ip (another sandbox)", udp(GW, 53, src=B), "spoof_ip"),
    ("spoofed source ip (outside the pool)", tcp(INET, 443, src="192.0.2.99"), "spoof_ip"),
    ("spoofed mac", ip_frame(ipv4_udp(A, GW, 40000, 53, b"q"), src_mac=EVIL_MAC), "spoof_mac"),
    ("spoofed mac and ip", ip_frame(ipv4_udp(B, GW, 40000, 53, b"q"), src_mac=B_MAC), "spoof_mac"),
    ("ipv6", eth("33:33:00:00:00:01", A_MAC, ETH_P_IPV6) + ipv6_udp(), "ipv6"),
    ("arp for the gateway", arp_frame(A_MAC, A, GW), "arp"),
    ("gratuitous arp", arp_frame(A_MAC, A, A), "arp"),
    ("arp claiming another sandbox's ip", arp_frame(A_MAC, B, GW), "arp_spoof"),
    ("arp with a foreign sender mac", arp_frame(EVIL_MAC, A, GW, src_mac=A_MAC), "arp_spoof"),
    ("arp from a foreign ethernet source", arp_frame(A_MAC, A, GW, src_mac=EVIL_MAC), "arp_spoof"),
    ("arp probing another sandbox", arp_frame(A_MAC, A, B), "arp_spoof"),
    ("arp with a non-ethernet hardware type", arp_frame(A_MAC, A, GW, htype=6), "malformed"),
    ("truncated arp", arp_frame(A_MAC, A, GW)[:30], "malformed"),
    ("l4-allowed tcp port", tcp(INET, 5432), "l4_allow"),
    ("l4 rule: neighbouring port", tcp(INET, 5433), "port_not_allowed"),
    ("l4 rule: other protocol", udp(INET, 5432), "port_not_allowed"),
    ("l4 rule: other address", tcp("198.51.100.11", 5432), "port_not_allowed"),
    ("l4 any-port udp rule", udp(ANY_UDP, 9999), "l4_allow"),
    ("l4 any-port udp rule, tcp", tcp(ANY_UDP, 9999), "port_not_allowed"),
    ("l4 icmp rule", ip_frame(ipv4_icmp_echo(A, "198.51.100.20")), "l4_allow"),
    ("l4 rule covering the hub's own address", ip_frame(ipv4_icmp_echo(A, HUB_OWN)), "host_service"),
    ("l4 rule covering a broadcast of the hub", ip_frame(ipv4_icmp_echo(A, "198.51.100.255")), "host_service"),
    ("l4 any-port rule to the hub's own address", udp("203.0.113.1", 9999), "host_service"),
    ("icmp not listed", ip_frame(ipv4_icmp_echo(A, ANY_UDP)), "port_not_allowed"),
    ("ssh out", tcp(INET, 22), "port_not_allowed"),
    ("first fragment", udp(INET, 443, frag=MF), "fragment"),
    ("later fragment", ip_frame(ipv4(A, INET, 17, b"x" * 16, frag=185)), "fragment"),
    ("ip version 6 in an ipv4 frame", ip_frame(ipv4_udp(A, GW, 1, 53, b"q", ver_ihl=0x65)), "malformed"),
    ("ip header length 4", ip_frame(ipv4_udp(A, GW, 1, 53, b"q", ver_ihl=0x44)), "malformed"),
    ("udp header cut off", ip_frame(ipv4(A, GW, 17, b"")), "malformed"),
    ("lldp", eth("01:80:c2:00:00:0e", A_MAC, 0x88CC) + b"\0" * 46, "ethertype"),
]


@pytest.fixture(scope="module")
def run_ns():
    """Where the frames run: lo forwards (as a hub-side veth does) and the hub routes the
    'internet' ranges over a veth pair that holds its own addresses there."""
    name = "cgvt" + secrets.token_hex(4)
    ip = ["ip", "-n", name]
    netns.create(name)
    try:
        for cmd in (["link", "set", "lo", "up"],
                    ["link", "add", "vt0", "type", "veth", "peer", "name", "vt1"],
                    ["addr", "add", f"{HUB_OWN}/24", "dev", "vt0"], ["addr", "add", "203.0.113.1/24", "dev", "vt0"],
                    ["link", "set", "vt0", "up"], ["link", "set", "vt1", "up"]):
            subprocess.run(ip + cmd, check=True, capture_output=True, timeout=10)
        netns.write_sysctl(name, "net.ipv4.conf.lo.forwarding", 1)
        yield name
    finally:
        netns.remove(name)


@pytest.fixture(scope="module")
def backend(run_ns):
    """The switch's control plane on a private bpffs, configured as Switch() does."""
    tmp = tempfile.mkdtemp(prefix="cgvt")
    pins = os.path.join(tmp, "bpf")
    be = None
    try:
        be = EbpfBackend(hub_netns=None, bpffs_dir=pins, gateway_ip=GW, pool="10.200.0.0/16",
                         gateway_ports=(8081, 8080), dns_port=53, hub_addrs=(HUB_ADDR,))
        entry = Entry("vt-a", A_NO, A, A_MAC, LO, "unused-netns", "unused-veth", normalize_l4(L4_RULES))
        be.dp.put_sandbox(entry.ifindex, ip=entry.ip, mac=entry.mac, sandbox_no=entry.sandbox_no)
        be.set_l4(entry, entry.l4_allow)   # what add() does before it attaches (not here)
        be.run_ns = run_ns
        yield be
    finally:
        if be is not None:
            be.close()
        if os.path.isdir(pins):
            datapath.remove_pins(pins)
            libbpf.umount_bpffs(pins)
        shutil.rmtree(tmp, ignore_errors=True)


def run(be: EbpfBackend, frame: bytes) -> tuple[int, dict, list]:
    """(tc verdict, counter increments, drop events) of one run of frame on LO."""
    be.drain_events(1000)
    before = be.counters()
    with netns.entered(be.run_ns):
        res = prog_test_run(be.dp.prog_fd, frame, ctx=SkBuffCtx(ifindex=LO), data_out_size=0)
    after = be.counters()
    delta = {k: (p - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1])
             for k, (p, b) in after.items() if (p, b) != before.get(k)}
    return res.retval, delta, be.drain_events(1000)


@pytest.mark.parametrize("case,frame,reason", TABLE, ids=[c for c, _, _ in TABLE])
def test_frame_verdict_and_reason(backend, case, frame, reason):
    retval, counted, events = run(backend, frame)
    assert counted == {(A_NO, reason): (1, len(frame))}
    expect = TC_ACT_OK if verdict_of(reason) == "allow" else TC_ACT_SHOT
    assert retval == expect
    if expect == TC_ACT_SHOT:
        assert [(e["sandbox_no"], e["reason"], e["ifindex"]) for e in events] == [(A_NO, reason, LO)]
    else:
        assert events == []


def test_table_covers_every_reason():
    assert {r for _, _, r in TABLE} | {"unknown_sandbox"} == set(REASON_CODES)


def test_drop_event_names_the_flow(backend):
    _, _, events = run(backend, udp(INET, 443))
    assert len(events) == 1
    ev = events[0]
    assert (ev["src"], ev["dst"], ev["proto"], ev["dport"]) == (A, INET, "udp", 443)


def test_unknown_or_disabled_sandbox_fails_closed(backend):
    dp, frame = backend.dp, udp(GW, 53)
    try:
        disabled = SandboxVal.from_buffer_copy(dp.get_sandbox(LO))
        disabled.flags = 0
        dp.maps["sandboxes"].update(ctypes.c_uint32(LO), disabled)
        for _ in range(2):
            retval, counted, events = run(backend, frame)
            assert retval == TC_ACT_SHOT
            assert counted == {(0, "unknown_sandbox"): (1, len(frame))}
            assert [(e["sandbox_no"], e["reason"]) for e in events] == [(0, "unknown_sandbox")]
            dp.del_sandbox(LO)   # second round: no entry at all
    finally:
        dp.put_sandbox(LO, ip=A, mac=A_MAC, sandbox_no=A_NO)
    assert run(backend, frame)[0] == TC_ACT_OK


def test_test_run_limits_surface_as_errors(backend):
    fd = backend.dp.prog_fd
    frame = udp(GW, 53)
    with pytest.raises(BpfError) as short:
        prog_test_run(fd, frame[:33], ctx=SkBuffCtx(ifindex=LO))    # IPv4 header cut
    assert short.value.errno == errno.EINVAL
    with pytest.raises(BpfError) as small_out:
        prog_test_run(fd, frame, ctx=SkBuffCtx(ifindex=LO), data_out_size=10)
    assert small_out.value.errno == errno.ENOSPC
    with pytest.raises(BpfError) as bad_ctx:
        prog_test_run(fd, frame, ctx=SkBuffCtx(ifindex=LO, len=10))   # not settable
    assert bad_ctx.value.errno == errno.EINVAL
    out = prog_test_run(fd, frame, ctx=SkBuffCtx(ifindex=LO))       # default data_out: the packet
    assert out.retval == TC_ACT_OK and out.data_out == frame
