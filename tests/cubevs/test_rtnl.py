"""cubevs.rtnl: batched rtnetlink requests on a plain socket, in a namespace of the test's own."""
from __future__ import annotations

import errno
import os
import secrets
import subprocess
import time

import pytest
from pyroute2.netlink.exceptions import NetlinkError

from cubevs import netns, rtnl


@pytest.fixture
def two_ns():
    a, b = "cgt" + secrets.token_hex(4), "cgt" + secrets.token_hex(4)
    netns.create(a)
    netns.create(b)
    try:
        yield a, b
    finally:
        netns.remove(a)
        netns.remove(b)


def _ip(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, text=True).stdout


def _veth(a: str, b: str) -> None:
    """va in a, vb in b, both down."""
    subprocess.run(["ip", "-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b], check=True)


def test_a_batch_is_applied_in_order_in_its_namespace(two_ns):
    a, b = two_ns
    _veth(a, b)
    va = rtnl.link(a, ifname="va").index
    rtnl.run(a, [rtnl.link_up(1), rtnl.addr_add(va, "10.77.0.2", 32), rtnl.link_up(va),
                 rtnl.route_add("10.77.0.1", 32, oif=va, scope=253),        # needs va up: after it
                 rtnl.route_add("0.0.0.0", 0, oif=va, gateway="10.77.0.1")])
    assert "inet 10.77.0.2/32" in _ip(a, "addr", "show", "va")
    routes = _ip(a, "route")
    assert "default via 10.77.0.1 dev va" in routes and "10.77.0.1 dev va scope link" in routes
    assert "UP" in _ip(a, "link", "show", "lo").split(">")[0]
    assert "10.77.0.2" not in _ip(b, "addr")         # nothing landed in the other namespace


def test_an_error_in_a_batch_is_raised_and_a_tolerated_one_is_not(two_ns):
    a, _b = two_ns
    rtnl.run(a, [rtnl.link_up(1), rtnl.route_add("10.78.0.0", 16, oif=1, scope=253)])
    with pytest.raises(NetlinkError) as e:
        rtnl.run(a, [rtnl.route_add("10.78.0.0", 16, oif=1, scope=253)])
    assert e.value.code == errno.EEXIST
    rtnl.run(a, [rtnl.route_add("10.78.0.0", 16, oif=1, scope=253, tolerate=(errno.EEXIST,))])
    with pytest.raises(NetlinkError) as e:       # the later request's error, after a good one
        rtnl.run(a, [rtnl.addr_add(1, "10.78.0.9", 32), rtnl.route_add("10.79.0.0", 16, oif=999, scope=253)])
    assert e.value.code == errno.ENODEV
    assert "10.78.0.9" in _ip(a, "addr", "show", "lo")   # the kernel applied the first one anyway


def test_link_reads_index_peer_and_running(two_ns):
    a, b = two_ns
    _veth(a, b)
    va, vb = rtnl.link(a, ifname="va"), rtnl.link(b, ifname="vb")
    assert va.peer_index == vb.index and vb.peer_index == va.index      # across namespaces
    assert rtnl.link(a, index=va.index) == va
    assert not va.running and not vb.running
    rtnl.run(a, [rtnl.link_up(va.index)])
    assert not rtnl.link(a, index=va.index).running                 # no carrier: the peer is down
    rtnl.run(b, [rtnl.link_up(vb.index)])
    for _ in range(2000):                                             # linkwatch is asynchronous
        if rtnl.link(a, index=va.index).running and rtnl.link(b, index=vb.index).running:
            break
        time.sleep(0.001)
    assert rtnl.link(a, index=va.index).running and rtnl.link(b, index=vb.index).running
    with pytest.raises(NetlinkError) as e:
        rtnl.link(a, ifname="vb")                                     # it is in the other one
    assert e.value.code == errno.ENODEV


def test_veth_add_puts_the_peer_in_the_other_namespace_with_its_mac(two_ns):
    a, b = two_ns
    fd = os.open(netns.path(b), os.O_RDONLY)
    try:
        rtnl.run(a, [rtnl.veth_add("vh", peer="eth0", peer_mac="02:aa:bb:cc:dd:ee", peer_netns_fd=fd)])
        with pytest.raises(NetlinkError) as e:          # the name is taken now
            rtnl.run(a, [rtnl.veth_add("vh", peer="eth1", peer_mac="02:aa:bb:cc:dd:ef", peer_netns_fd=fd)])
        assert e.value.code == errno.EEXIST
    finally:
        os.close(fd)
    vh, eth = rtnl.link(a, ifname="vh"), rtnl.link(b, ifname="eth0")
    assert vh.peer_index == eth.index and eth.peer_index == vh.index
    shown = _ip(b, "link", "show", "eth0")
    assert "link/ether 02:aa:bb:cc:dd:ee" in shown and "state DOWN" in shown
    assert "eth0" not in _ip(a, "link") and "eth1" not in _ip(b, "link")
