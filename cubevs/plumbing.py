"""Per-sandbox network namespace + veth, via netlink (pyroute2 IPRoute, no NDB).

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
import time
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from . import netns

LOOPBACK_IFINDEX = 1     # the kernel gives lo index 1 in every network namespace


@dataclass(frozen=True)
class Names:
    netns: str
    host_ifname: str


def names_for(sandbox_id: str, salt: str, ns_prefix: str = "cgs") -> Names:
    h = hashlib.sha256(f"{salt}\0{sandbox_id}".encode()).hexdigest()
    return Names(netns=f"{ns_prefix}{h[:10]}", host_ifname=f"cgv{h[:10]}")


def _wait_running(ipr: IPRoute, ifindex: int, deadline: float) -> None:
    """Carrier-up is applied asynchronously (linkwatch): until then the device keeps the
    `noop` qdisc and silently drops what is sent -- the sandbox's first ARP would be lost
    and its first connection stall for a second.  Poll until operstate is UP."""
    while True:
        link = ipr.get_links(ifindex)[0]
        if link.get("IFLA_OPERSTATE") == "UP" and link.get("IFLA_QDISC") != "noop":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"link {link.get('IFLA_IFNAME')} did not come up")
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
        # sandbox netns -> (its netlink handle, eth0 ifindex), from create() to bring_up():
        # opening a handle costs ~1.5 ms of CPU, as much as a few netlink calls
        self._pending: dict[str, tuple[_NsIPRoute, int]] = {}

    def close(self) -> None:
        for ipr, _eth in self._pending.values():
            ipr.close()
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
            self.ipr.link("add", ifname=n.host_ifname, kind="veth",
                          peer={"ifname": "eth0", "address": mac,
                                "net_ns_fd": netns.path(n.netns)})
            # one dump of the hub end gives both ifindexes: its own and (IFLA_LINK) eth0's in
            # the sandbox netns, which then needs no lookup of its own (~0.5 ms per netlink call)
            hub_end = self.ipr.get_links(ifname=n.host_ifname)[0]
            idx, eth = hub_end["index"], hub_end.get("IFLA_LINK")
            _sysctls(self.ns, {
                f"net.ipv4.conf.{n.host_ifname}.rp_filter": 1,
                f"net.ipv4.conf.{n.host_ifname}.proxy_arp": 0,
                f"net.ipv4.conf.{n.host_ifname}.send_redirects": 0,
                f"net.ipv4.conf.{n.host_ifname}.forwarding": 1,
                f"net.ipv6.conf.{n.host_ifname}.disable_ipv6": 1,
            })
            self.ipr.addr("add", index=idx, address=gateway_ip, prefixlen=32)
            self._pending[n.netns] = self._configure_sandbox(n, eth, ip=ip, gateway_ip=gateway_ip)
            return idx
        except BaseException:
            self.destroy(n)
            raise

    @staticmethod
    def _configure_sandbox(n: Names, eth: int | None, *, ip: str, gateway_ip: str) -> tuple[_NsIPRoute, int]:
        """eth: eth0's ifindex if known. Returns the sandbox netns's open netlink handle and
        eth0's ifindex (for bring_up)."""
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
        ipr = _ipr(n.netns)
        try:
            if eth is None:
                eth = ipr.link_lookup(ifname="eth0")[0]
            ipr.link("set", index=LOOPBACK_IFINDEX, state="up")
            ipr.addr("add", index=eth, address=ip, prefixlen=32)
            ipr.link("set", index=eth, state="up")
            ipr.route("add", dst=f"{gateway_ip}/32", oif=eth, scope=253)   # scope link
            ipr.route("add", dst="0.0.0.0/0", gateway=gateway_ip, oif=eth)
        except BaseException:
            ipr.close()
            raise
        return ipr, eth

    def bring_up(self, n: Names, ifindex: int, ip: str, wait_s: float = 2.0) -> None:
        """Up the hub side (after the filter is attached), route the sandbox ip to it, and
        wait until both ends really pass packets (see _wait_running)."""
        self.ipr.link("set", index=ifindex, state="up")
        try:
            self.ipr.route("add", dst=f"{ip}/32", oif=ifindex, scope=253)
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise
        pending = self._pending.pop(n.netns, None)
        sipr, eth = pending if pending else (None, None)
        if sipr is None:
            sipr = _ipr(n.netns)
        try:
            deadline = time.monotonic() + wait_s
            _wait_running(self.ipr, ifindex, deadline)
            _wait_running(sipr, eth if eth is not None else sipr.link_lookup(ifname="eth0")[0], deadline)
        finally:
            sipr.close()

    def destroy(self, n: Names) -> None:
        """Delete the veth (both ends, synchronously) and the netns. Idempotent."""
        pending = self._pending.pop(n.netns, None)
        if pending:
            pending[0].close()
        idx = self.ipr.link_lookup(ifname=n.host_ifname)
        if idx:
            with contextlib.suppress(NetlinkError):
                self.ipr.link("del", index=idx[0])
        netns.remove(n.netns)
