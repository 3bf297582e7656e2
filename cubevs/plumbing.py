"""Per-sandbox network namespace + veth, via netlink (pyroute2 IPRoute for links; the
batched requests of one setup step through rtnl.py).

Layout per sandbox (point-to-point, no L2 shared between sandboxes):
  sandbox netns: eth0 = <ip>/32, MAC derived from ip, route <gw>/32 dev eth0,
                 default via <gw> onlink; IPv6 disabled; no forwarding.
  hub netns:     cgv<hash> = <gw>/32 (same address on every sandbox veth),
                 route <ip>/32 dev cgv<hash>; rp_filter strict; proxy_arp off;
                 forwarding on for this device only.
Links come up only after the caller attached the filter (`bring_up`).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from . import netns, rtnl

LOOPBACK_IFINDEX = 1     # the kernel gives lo index 1 in every network namespace
SCOPE_LINK = 253


@dataclass(frozen=True)
class Names:
    netns: str
    host_ifname: str


def names_for(sandbox_id: str, salt: str, ns_prefix: str = "cgs") -> Names:
    h = hashlib.sha256(f"{salt}\0{sandbox_id}".encode()).hexdigest()
    return Names(netns=f"{ns_prefix}{h[:10]}", host_ifname=f"cgv{h[:10]}")


def _wait_running(ns: str | None, ifindex: int, deadline: float) -> None:
    """Carrier-up is applied asynchronously (linkwatch): until then the device keeps the
    `noop` qdisc and silently drops what is sent -- the sandbox's first ARP would be lost
    and its first connection stall for a second.  Poll until operstate is UP."""
    while not rtnl.link(ns, index=ifindex).running:
        if time.monotonic() > deadline:
            raise TimeoutError(f"link {ifindex} in {ns or 'this namespace'} did not come up")
        time.sleep(0.0005)


def _sysctls(ns: str | None, values: dict[str, str | int]) -> None:
    with netns.entered(ns):
        for key, val in values.items():
            with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                f.write(str(val))


class _NsIPRoute:
    """IPRoute whose every call runs inside namespace `ns`.

    pyroute2 0.9 opens its netlink socket lazily, once per calling thread, in that
    thread's current namespace: an IPRoute made after setns() in one thread works
    in the root namespace when a worker thread uses it (veths landed there).
    IPRoute(netns=...) avoids that by fork(), which is unsafe in our threaded daemon."""

    def __init__(self, ns: str | None):
        self.ns = ns
        with netns.entered(ns):
            self._ipr = IPRoute()

    def __getattr__(self, name):
        attr = getattr(self._ipr, name)
        if self.ns is None or not callable(attr):
            return attr

        def in_ns(*args, **kw):
            with netns.entered(self.ns):
                return attr(*args, **kw)
        return in_ns


def _ipr(ns: str | None) -> _NsIPRoute:
    return _NsIPRoute(ns)


class Hub:
    """Netlink handle bound to the hub namespace (None = the caller's namespace)."""

    def __init__(self, hub_netns: str | None):
        self.ns = hub_netns
        self.ipr = _ipr(hub_netns)   # every call inside the hub namespace, from any thread
        # sandbox netns -> its eth0's ifindex, from create() to bring_up()
        self._pending: dict[str, int] = {}

    def close(self) -> None:
        self._pending.clear()
        self.ipr.close()

    def ensure_gateway_addr(self, gateway_ip: str) -> None:
        """Gateway ip on the hub's lo too, so the gateway can bind it before any sandbox
        exists (the dummy driver is not available on every host)."""
        lo = self.ipr.link_lookup(ifname="lo")[0]
        self.ipr.link("set", index=lo, state="up")
        try:
            self.ipr.addr("add", index=lo, address=gateway_ip, prefixlen=32)
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise

    def ifindex(self, ifname: str) -> int | None:
        idx = self.ipr.link_lookup(ifname=ifname)
        return idx[0] if idx else None

    def link_names(self) -> list[str]:
        return [l.get("ifname") for l in self.ipr.get_links()]

    def create(self, n: Names, *, ip: str, mac: str, gateway_ip: str) -> int:
        """Create netns + veth; configure both ends (links left down). Returns hub ifindex."""
        netns.create(n.netns)
        try:
            fd = os.open(netns.path(n.netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                rtnl.run(self.ns, [rtnl.veth_add(n.host_ifname, peer="eth0", peer_mac=mac, peer_netns_fd=fd)])
            finally:
                os.close(fd)
            # the hub end's ifindex and (IFLA_LINK) eth0's in the sandbox netns, in one request
            hub_end = rtnl.link(self.ns, ifname=n.host_ifname)
            idx = hub_end.index
            _sysctls(self.ns, {
                f"net.ipv4.conf.{n.host_ifname}.rp_filter": 1,
                f"net.ipv4.conf.{n.host_ifname}.proxy_arp": 0,
                f"net.ipv4.conf.{n.host_ifname}.send_redirects": 0,
                f"net.ipv4.conf.{n.host_ifname}.forwarding": 1,
                f"net.ipv6.conf.{n.host_ifname}.disable_ipv6": 1,
            })
            rtnl.run(self.ns, [rtnl.addr_add(idx, gateway_ip, 32)])
            self._pending[n.netns] = self._configure_sandbox(n, hub_end.peer_index, ip=ip, gateway_ip=gateway_ip)
            return idx
        except BaseException:
            self.destroy(n)
            raise

    @staticmethod
    def _configure_sandbox(n: Names, eth: int | None, *, ip: str, gateway_ip: str) -> int:
        """eth: eth0's ifindex if known. Returns eth0's ifindex (for bring_up)."""
        _sysctls(n.netns, {
            "net.ipv6.conf.all.disable_ipv6": 1,
            "net.ipv6.conf.default.disable_ipv6": 1,
            "net.ipv4.ip_forward": 0,
            "net.ipv4.conf.all.rp_filter": 1,
            "net.ipv4.conf.default.rp_filter": 1,
            # ARP from the sandbox's own address only; otherwise a packet from a secondary
            # address would be announced with it and the switch would drop the ARP instead
            "net.ipv4.conf.all.arp_announce": 2,
        })
        if eth is None:
            eth = rtnl.link(n.netns, ifname="eth0").index
        rtnl.run(n.netns, [       # in this order: a route needs its device up
            rtnl.link_up(LOOPBACK_IFINDEX),
            rtnl.addr_add(eth, ip, 32),
            rtnl.link_up(eth),
            rtnl.route_add(gateway_ip, 32, oif=eth, scope=SCOPE_LINK),
            rtnl.route_add("0.0.0.0", 0, oif=eth, gateway=gateway_ip),
        ])
        return eth

    def bring_up(self, n: Names, ifindex: int, ip: str, wait_s: float = 2.0) -> None:
        """Up the hub side (after the filter is attached), route the sandbox ip to it, and
        wait until both ends really pass packets (see _wait_running)."""
        rtnl.run(self.ns, [rtnl.link_up(ifindex),
                           rtnl.route_add(ip, 32, oif=ifindex, scope=SCOPE_LINK, tolerate=(errno.EEXIST,))])
        eth = self._pending.pop(n.netns, None)
        if eth is None:
            eth = rtnl.link(n.netns, ifname="eth0").index
        deadline = time.monotonic() + wait_s
        _wait_running(self.ns, ifindex, deadline)
        _wait_running(n.netns, eth, deadline)

    def destroy(self, n: Names) -> None:
        """Delete the veth (both ends, synchronously) and the netns. Idempotent."""
        self._pending.pop(n.netns, None)
        idx = self.ipr.link_lookup(ifname=n.host_ifname)
        if idx:
            with contextlib.suppress(NetlinkError):
                self.ipr.link("del", index=idx[0])
        netns.remove(n.netns)
