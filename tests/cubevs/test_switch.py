"""cubevs end to end: real namespaces, veths, the eBPF program / nftables
backend, real sockets and crafted frames from inside the sandbox."""
from __future__ import annotations

import pytest
from pyroute2 import IPRoute

from cubevs import Registry, netns
from cubevs.switch import Switch

from cubevs_lab import GW, INET_IP
from cubevs_pkt import (ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, arp_request, eth, ipv4_udp, ipv6_udp,
                  send_frames, tcp_fetch, udp_exchange)

pytestmark = pytest.mark.netns

HUB_MAC = "02:00:00:00:00:01"   # dst MAC is not checked by the switch


def pk(sw, sid, reason):
    for (s, r, _v), (p, _b) in sw.counters(sid).items():
        if s == sid and r == reason:
            return p
    return 0


def val(sw, sid, reason):
    return next((v for (s, r, _), v in sw.counters(sid).items() if s == sid and r == reason), (0, 0))


@pytest.fixture
def pair(lab, request):
    sw = lab.sw
    base = request.node.name.replace("[", "-").replace("]", "")
    a = sw.attach_sandbox(base + "-a")
    b = sw.attach_sandbox(base + "-b")
    try:
        yield a, b
    finally:
        sw.detach_sandbox(a.sandbox_id)
        sw.detach_sandbox(b.sandbox_id)


def test_backend_in_use(lab):
    assert lab.sw.backend == lab.backend
    st = lab.sw.status()
    assert st["backend"] == lab.backend and st["steering"] is True


def test_web_is_steered_to_transparent_listener(lab, pair):
    a, _ = pair
    for port in (443, 80):
        got = tcp_fetch(a.netns, (INET_IP, port))
        assert got == f"HELLO 8081 from {a.ip} orig {INET_IP}:{port}".encode()
    assert lab.listeners.hits[("tcp", lab.inet, 443)] == 0   # never reached directly
    assert pk(lab.sw, a.sandbox_id, "web") >= 6              # SYN, ACK, FIN... per connection
    assert lab.sw.lookup_by_ip(a.ip) == a.sandbox_id          # how the gateway names the client


def test_gateway_ports_and_our_dns_allowed_and_counted_exactly(lab, pair):
    a, _ = pair
    assert tcp_fetch(a.netns, (GW, 8080)) == f"HELLO 8080 from {a.ip}".encode()
    replies = udp_exchange(a.netns, (GW, 53), b"q" * 100, count=3)
    assert replies == [b"ECHO:" + b"q" * 100] * 3
    assert val(lab.sw, a.sandbox_id, "dns") == (3, 3 * (14 + 20 + 8 + 100))
    assert pk(lab.sw, a.sandbox_id, "gateway") >= 3


def test_host_services_dropped(lab, pair):
    a, _ = pair
    assert udp_exchange(a.netns, (GW, 5353), count=4, timeout=0.3) == []
    assert pk(lab.sw, a.sandbox_id, "host_service") == 4
    assert tcp_fetch(a.netns, (GW, 2222), timeout=0.3) is None
    assert pk(lab.sw, a.sandbox_id, "host_service") >= 5
    assert lab.listeners.hits[("tcp", lab.hub, 2222)] == 0


def test_quic_dropped_counted_exactly(lab, pair):
    a, _ = pair
    assert udp_exchange(a.netns, (INET_IP, 443), b"x" * 100, count=5, timeout=0.3) == []
    assert val(lab.sw, a.sandbox_id, "quic") == (5, 5 * 142)
    assert lab.listeners.hits[("udp", lab.inet, 443)] == 0


def test_foreign_dns_dropped(lab, pair):
    a, _ = pair
    assert udp_exchange(a.netns, (INET_IP, 53), count=3, timeout=0.3) == []
    assert tcp_fetch(a.netns, (INET_IP, 53), timeout=0.3) is None
    assert pk(lab.sw, a.sandbox_id, "foreign_dns") >= 4
    assert lab.listeners.hits[("udp", lab.inet, 53)] == 0


def test_sandbox_to_sandbox_dropped(lab, pair):
    a, b = pair
    assert udp_exchange(a.netns, (b.ip, 53), count=2, timeout=0.3) == []
    assert tcp_fetch(a.netns, (b.ip, 443), timeout=0.3) is None   # not even via the steering
    assert pk(lab.sw, a.sandbox_id, "sandbox_to_sandbox") >= 3
    assert pk(lab.sw, a.sandbox_id, "web") == 0


def test_spoofed_source_ip_dropped(lab, pair):
    a, b = pair
    with netns.entered(a.netns):
        with IPRoute() as ipr:
            ipr.addr("add", index=ipr.link_lookup(ifname="eth0")[0], address="10.200.0.250",
                     prefixlen=32)
    assert udp_exchange(a.netns, (GW, 53)) == [b"ECHO:ping"]   # legit traffic still fine
    assert udp_exchange(a.netns, (GW, 53), count=2, src="10.200.0.250", timeout=0.3) == []
    assert tcp_fetch(a.netns, (INET_IP, 443), src="10.200.0.250", timeout=0.3) is None
    assert pk(lab.sw, a.sandbox_id, "spoof_ip") >= 3
    # impersonating the other sandbox with a crafted frame
    frame = eth(HUB_MAC, a.mac, ETH_P_IP) + ipv4_udp(b.ip, GW, 5000, 53, b"z" * 10)
    before = pk(lab.sw, a.sandbox_id, "spoof_ip")
    send_frames(a.netns, [frame] * 3)
    assert pk(lab.sw, a.sandbox_id, "spoof_ip") == before + 3
    assert pk(lab.sw, a.sandbox_id, "dns") == 1   # only the legit warm-up


def test_spoofed_mac_dropped(lab, pair):
    a, _ = pair
    frame = eth(HUB_MAC, "02:00:de:ad:be:ef", ETH_P_IP) + ipv4_udp(a.ip, GW, 5000, 53, b"m")
    send_frames(a.netns, [frame] * 3)
    assert pk(lab.sw, a.sandbox_id, "spoof_mac") == 3
    # the real thing: learn the gateway's MAC, then change ours
    assert udp_exchange(a.netns, (GW, 53)) == [b"ECHO:ping"]
    with netns.entered(a.netns):
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="eth0")[0], address="02:00:de:ad:be:ee")
    assert udp_exchange(a.netns, (GW, 53), timeout=0.3) == []
    # the MAC change flushes the neighbour cache: the kernel re-ARPs with the new MAC first
    assert pk(lab.sw, a.sandbox_id, "spoof_mac") + pk(lab.sw, a.sandbox_id, "arp_spoof") >= 4
    assert pk(lab.sw, a.sandbox_id, "dns") == 1


def test_arp_spoofing_dropped(lab, pair):
    a, b = pair
    bad = [
        eth("ff:ff:ff:ff:ff:ff", a.mac, ETH_P_ARP) + arp_request(a.mac, b.ip, GW),      # other ip
        eth("ff:ff:ff:ff:ff:ff", a.mac, ETH_P_ARP) + arp_request("02:00:00:00:be:ef", a.ip, GW),
        eth("ff:ff:ff:ff:ff:ff", "02:00:00:00:be:ef", ETH_P_ARP) + arp_request(a.mac, a.ip, GW),
        eth("ff:ff:ff:ff:ff:ff", a.mac, ETH_P_ARP) + arp_request(a.mac, a.ip, b.ip),   # probing
    ]
    send_frames(a.netns, bad)
    assert pk(lab.sw, a.sandbox_id, "arp_spoof") == 4
    before = pk(lab.sw, a.sandbox_id, "arp")
    send_frames(a.netns, [eth("ff:ff:ff:ff:ff:ff", a.mac, ETH_P_ARP) + arp_request(a.mac, a.ip, GW)])
    assert pk(lab.sw, a.sandbox_id, "arp") == before + 1
    # the hub never learnt b's address behind a's veth
    with netns.entered(lab.hub):
        with IPRoute() as ipr:
            learnt = [n.get("NDA_DST") for n in ipr.get_neighbours(ifindex=a.ifindex)]
    assert b.ip not in learnt


def test_ipv6_disabled_and_dropped(lab, pair):
    a, _ = pair
    assert netns.read_sysctl(a.netns, "net.ipv6.conf.all.disable_ipv6") == "1"
    send_frames(a.netns, [eth("33:33:00:00:00:01", a.mac, ETH_P_IPV6) + ipv6_udp()] * 2)
    assert pk(lab.sw, a.sandbox_id, "ipv6") == 2


def test_l4_allow_opens_exactly_one_port(lab, pair):
    a, _ = pair
    sw = lab.sw
    b = sw.attach_sandbox(a.sandbox_id + "-db", l4_allow=[(f"{INET_IP}/32", 5432, "tcp")])
    try:
        assert tcp_fetch(b.netns, (INET_IP, 5432)) == f"HELLO 5432 from {b.ip}".encode()
        assert tcp_fetch(b.netns, (INET_IP, 5433), timeout=0.3) is None
        assert udp_exchange(b.netns, (INET_IP, 5432), timeout=0.3) == []    # proto matters
        assert tcp_fetch(a.netns, (INET_IP, 5432), timeout=0.3) is None     # per sandbox
        assert pk(sw, b.sandbox_id, "l4_allow") >= 3
        assert pk(sw, b.sandbox_id, "port_not_allowed") >= 2
        assert pk(sw, a.sandbox_id, "port_not_allowed") >= 1
        sw.set_l4_allow(b.sandbox_id, [])
        assert tcp_fetch(b.netns, (INET_IP, 5432), timeout=0.3) is None
    finally:
        sw.detach_sandbox(b.sandbox_id)


def test_registry_readable_by_another_reader(lab, pair):
    a, b = pair
    reg = Registry(lab.state)   # what the gateway does
    try:
        assert reg.lookup_by_ip(a.ip) == a.sandbox_id
        assert reg.lookup_by_ip(b.ip) == b.sandbox_id
        assert reg.lookup_by_ip("10.200.255.254") is None
    finally:
        reg.close()


def test_drop_events_reported(lab, pair):
    if lab.backend != "ebpf":
        pytest.skip("nftables backend logs drops to NFLOG only")
    a, _ = pair
    lab.sw.drain_events()
    udp_exchange(a.netns, (INET_IP, 443), count=2, timeout=0.2)
    evs = [e for e in lab.sw.drain_events() if e["sandbox"] == a.sandbox_id]
    assert len(evs) == 2
    assert {(e["reason"], e["src"], e["dst"], e["proto"], e["dport"]) for e in evs} == {
        ("quic", a.ip, INET_IP, "udp", 443)}
    assert lab.sw.drain_events(max=5) == []


def test_drain_events_respects_max(lab, pair):
    if lab.backend != "ebpf":
        pytest.skip("ebpf only")
    a, _ = pair
    lab.sw.drain_events()
    udp_exchange(a.netns, (INET_IP, 443), count=7, timeout=0.1)
    assert len(lab.sw.drain_events(max=3)) == 3
    assert len(lab.sw.drain_events(max=100)) == 4


@pytest.mark.parametrize("fresh_lab", ["ebpf", "nftables"], indirect=True)
def test_reopen_keeps_counters_attachment_and_policy(fresh_lab):
    lab = fresh_lab
    a = lab.sw.attach_sandbox("keep", l4_allow=[(f"{INET_IP}/32", 5432, "tcp")])
    udp_exchange(a.netns, (INET_IP, 443), count=3, timeout=0.2)
    assert pk(lab.sw, "keep", "quic") == 3
    lab.sw.close()
    lab.sw = None
    lab.sw = Switch.reopen(lab.state)           # a restarted daemon
    assert lab.sw.backend == lab.backend
    assert pk(lab.sw, "keep", "quic") == 3      # counters survived
    st = lab.sw.status()
    assert [s["attached"] for s in st["sandboxes"]] == [True]
    udp_exchange(a.netns, (INET_IP, 443), count=2, timeout=0.2)
    assert pk(lab.sw, "keep", "quic") == 5
    assert tcp_fetch(a.netns, (INET_IP, 5432)) is not None   # l4 policy survived
    assert lab.sw.lookup_by_ip(a.ip) == "keep"


def test_program_stays_attached_without_the_daemon(fresh_lab):
    lab = fresh_lab
    a = lab.sw.attach_sandbox("orphan")
    lab.sw.close()
    lab.sw = None       # no process holds program or maps now: pins + tcx keep them
    assert udp_exchange(a.netns, (INET_IP, 443), count=2, timeout=0.2) == []
    assert udp_exchange(a.netns, (GW, 53)) == [b"ECHO:ping"]
    lab.sw = Switch.reopen(lab.state)
    assert pk(lab.sw, "orphan", "quic") == 2 and pk(lab.sw, "orphan", "dns") == 1


@pytest.mark.parametrize("fresh_lab", ["ebpf", "nftables"], indirect=True)
def test_detach_removes_every_trace(fresh_lab):
    lab = fresh_lab
    sw = lab.sw
    a = sw.attach_sandbox("gone", l4_allow=[(f"{INET_IP}/32", 5432, "tcp")])
    udp_exchange(a.netns, (INET_IP, 443), count=2, timeout=0.2)
    assert sw.has_trace(a) == {"link": True, "netns": True, "registry": True, "datapath": True}
    sw.detach_sandbox("gone")
    assert sw.has_trace(a) == {"link": False, "netns": False, "registry": False, "datapath": False}
    assert not netns.exists(a.netns)
    with netns.entered(lab.hub):
        with IPRoute() as ipr:
            names = [l.get("ifname") for l in ipr.get_links()]
            routes = [r.get("RTA_DST") for r in ipr.get_routes(family=2)]
    assert not [n for n in names if n.startswith("cgv")]
    assert a.ip not in routes
    assert sw.counters("gone" if sw.lookup_by_ip(a.ip) else None) == {} or \
        not any(k[0] == "gone" for k in sw.counters())
    assert sw.lookup_by_ip(a.ip) is None
    if lab.backend == "ebpf":
        dp = sw._impl.dp
        assert dp.get_sandbox(a.ifindex) is None
        assert dp.l4_entries(a.sandbox_no) == []
        assert dp.read_counters(a.sandbox_no) == {}
    sw.detach_sandbox("gone")   # idempotent


def test_unknown_interface_fails_closed(fresh_lab):
    """A veth with the program but no sandbox entry passes nothing."""
    lab = fresh_lab
    a = lab.sw.attach_sandbox("x")
    lab.sw._impl.dp.del_sandbox(a.ifindex)
    assert udp_exchange(a.netns, (GW, 53), timeout=0.3) == []
    assert pk(lab.sw, None, "unknown_sandbox") >= 1 or any(
        r == "unknown_sandbox" for (_s, r, _v) in lab.sw.counters())


@pytest.mark.parametrize("mode", ["tc", "tcx"])
def test_attach_modes_enforce_and_reopen(fresh_lab, mode):
    lab = fresh_lab
    lab.sw.close()
    lab.sw = lab.open_switch(attach_mode=mode)
    a = lab.sw.attach_sandbox("m")
    assert lab.sw._impl.dp.attached(a.ifindex, lab.hub) == mode
    assert udp_exchange(a.netns, (INET_IP, 443), timeout=0.2) == []
    assert udp_exchange(a.netns, (GW, 53)) == [b"ECHO:ping"]
    lab.sw.close()
    lab.sw = Switch.reopen(lab.state)
    assert lab.sw.attach_mode == mode
    assert lab.sw.status()["sandboxes"][0]["attached"] is True
    assert pk(lab.sw, "m", "quic") == 1 and pk(lab.sw, "m", "dns") == 1


def test_gateway_down_fails_closed_and_recovers(fresh_lab):
    """No transparent listener -> web traffic goes nowhere; it flows again when the
    gateway is back, without recreating the sandbox."""
    import socket
    from cubevs_lab import in_ns
    lab = fresh_lab
    a = lab.sw.attach_sandbox("fc")
    lab.listeners.stop()                         # the gateway process is gone
    assert tcp_fetch(a.netns, (INET_IP, 443), timeout=0.3) is None
    assert tcp_fetch(a.netns, (INET_IP, 80), timeout=0.3) is None
    srv = in_ns(lab.hub, socket.AF_INET, socket.SOCK_STREAM)   # gateway restarted
    try:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", 8081))
        srv.listen(4)
        cli = in_ns(a.netns, socket.AF_INET, socket.SOCK_STREAM)
        cli.settimeout(1)
        cli.connect((INET_IP, 443))
        conn, peer = srv.accept()
        assert peer[0] == a.ip and lab.sw.lookup_by_ip(peer[0]) == "fc"
        conn.close()
        cli.close()
    finally:
        srv.close()
