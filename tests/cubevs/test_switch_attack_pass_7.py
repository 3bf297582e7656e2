"""Attack pass 7 on the switch's direct L4 paths: what a `cidrs` rule opens past the gateway.

FINDING: the switch's per-sandbox L4 allow list (cubegate/l4sync.py) followed the policy's
decision alone. The gateway's SSRF guard (private, loopback, link-local, CGNAT, reserved
ranges, its own listeners: refused "independently of policy" on every proxied connection)
was never asked, so an admin rule `cidrs: [0.0.0.0/0], ports: [22]` ("agents may ssh out")
opened 10/8, 172.16/12, 192.168/16, 100.64/10 and 169.254/16 (all but the metadata /32s) on
port 22 for every sandbox: the host's LAN, the docker bridge (the host itself), link-local
services. The same rule on 443 through the gateway is refused for those addresses."""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
from contextlib import contextmanager, suppress

import pytest
from pyroute2 import IPRoute

from cubegate.l4sync import l4_allow_for
from egress.netguard import AddressGuard
from egress.policy import load_policy_files

from cubevs import netns
from cubevs_lab import INET_IP

NEVER_DIRECT = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16",
                "127.0.0.0/8", "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4", "198.18.0.0/15", "192.0.2.0/24"]


def _policy(tmp_path, match: str):
    p = tmp_path / "p.yaml"
    p.write_text(f"name: a\ndefault: deny\nrules:\n  - {{name: out, action: allow, match: {match}}}\n")
    return load_policy_files([p])


def _overlaps(entries, cidr: str) -> list:
    net = ipaddress.ip_network(cidr)
    return [e for e in entries if ipaddress.ip_network(e[0]).overlaps(net)]


@pytest.mark.parametrize("match", ["{cidrs: [0.0.0.0/0], ports: [22]}", "{cidrs: [0.0.0.0/0]}",
                                   "{cidrs: [10.0.0.0/8, 169.254.0.0/16], ports: [5432]}"])
def test_a_wide_cidrs_rule_opens_no_private_or_special_range_past_the_gateway(tmp_path, match):
    entries = l4_allow_for(_policy(tmp_path, match), "sb", {}, guard=AddressGuard())
    for cidr in NEVER_DIRECT:
        assert not _overlaps(entries, cidr), (cidr, _overlaps(entries, cidr)[:5])
    if "0.0.0.0/0" in match:      # the public internet is still open on the rule's port
        assert any(ipaddress.ip_address("8.8.8.8") in ipaddress.ip_network(c) for c, _, _ in entries)


def test_upstream_allow_cidrs_exempt_exactly_what_they_name(tmp_path):
    guard = AddressGuard(allow_cidrs=["10.9.0.0/24"])
    entries = l4_allow_for(_policy(tmp_path, "{cidrs: [0.0.0.0/0], ports: [22]}"), "sb", {}, guard=guard)
    assert ("10.9.0.0/24", 22, "tcp") in entries
    assert _overlaps(entries, "10.0.0.0/8") == [("10.9.0.0/24", 22, "tcp")]


def test_the_gateways_own_listeners_are_no_direct_path(tmp_path):
    """A listener of ours on a public address (a wildcard bind expanded to the host's
    addresses): that address is no direct path on that port (nor on "any port": the switch
    cannot say "any port but 8080", so it stays closed); its neighbours follow the rule."""
    guard = AddressGuard(own_endpoints=[("203.0.114.7", 8080)])
    entries = l4_allow_for(_policy(tmp_path, "{cidrs: [203.0.114.0/24]}"), "sb", {}, guard=guard)
    own = [e for e in entries if ipaddress.ip_address("203.0.114.7") in ipaddress.ip_network(e[0])]
    assert all(port not in (0, 8080) for _, port, _ in own), own
    assert any(ipaddress.ip_address("203.0.114.8") in ipaddress.ip_network(c) and p == 0 for c, p, _ in entries)


# ------------------------------------------------------------------ the host's own addresses

HOST_PORT = 5434
LATE_ADDR = "203.0.113.77"       # an address the hub gets after the switch started (DHCP, an operator)


@contextmanager
def host_service(ns: str, ip: str, port: int):
    """A TCP service of the host (the hub namespace) on ip:port, answering b"HOST"."""
    from cubevs import netns as cnetns
    with cnetns.entered(ns):
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ip, port))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            with suppress(OSError):
                c.sendall(b"HOST")
            c.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(2)
        srv.close()


def test_a_direct_path_never_delivers_to_the_hosts_own_addresses(lab):
    """FINDING: the switch took as "the host" only the gateway address and the hub_addrs it
    was given, and the daemon gives none. An L4 entry covering an address of the hub itself
    (its uplink, the docker bridge, a public address: the admin opened a range for a
    database, the host is in it) delivered the sandbox's packets to the host's own services
    on that port, past the gateway. Now any destination the hub routes locally (its
    addresses, also ones added after the switch started, and broadcasts) is a host service:
    dropped, whatever the allow list says; the internet behind the hub is still reached."""
    from cubevs_lab import HUB_UPLINK_IP
    from cubevs_pkt import tcp_fetch
    with netns.entered(lab.hub):
        with IPRoute() as ipr:
            ipr.addr("add", index=ipr.link_lookup(ifname="lo")[0], address=LATE_ADDR, prefixlen=32)
    a = None
    try:
        with host_service(lab.hub, "0.0.0.0", HOST_PORT):
            a = lab.sw.attach_sandbox("a7-host", l4_allow=[("198.51.100.0/24", 0, "tcp"),
                                                           (f"{LATE_ADDR}/32", 0, "tcp")])
            assert tcp_fetch(a.netns, (INET_IP, 5432)) is not None          # the range is open (the control)
            for ip in (HUB_UPLINK_IP, LATE_ADDR):
                assert tcp_fetch(a.netns, (ip, HOST_PORT), timeout=0.5) is None, ip   # before: b"HOST"
            counts = {r: p for (s, r, _v), (p, _b) in lab.sw.counters(a.sandbox_id).items() if s == a.sandbox_id}
            assert counts.get("host_service", 0) >= 2, counts
    finally:
        if a is not None:
            lab.sw.detach_sandbox(a.sandbox_id)
        with netns.entered(lab.hub):
            with IPRoute() as ipr:
                with suppress(Exception):
                    ipr.addr("del", index=ipr.link_lookup(ifname="lo")[0], address=LATE_ADDR, prefixlen=32)
