"""Lab for cubevs tests: a hub netns (stand-in gateway listeners), an
"internet" netns behind it, and a Switch attaching sandboxes to the hub.
Everything is created here (names cg<random>...) and removed in teardown."""
from __future__ import annotations

import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
from contextlib import suppress

from pyroute2 import IPRoute

from cubevs import datapath, libbpf, netns
from cubevs.switch import Switch

INET_IP = "198.51.100.10"
HUB_UPLINK_IP = "198.51.100.1"
GW = "10.200.0.1"
SO_ORIGINAL_DST = 80


def in_ns(ns, family, kind, proto=0):
    with netns.entered(ns):
        return socket.socket(family, kind, proto)


class Listeners:
    """Tiny TCP/UDP servers bound inside a namespace, served from one thread."""

    def __init__(self):
        self.socks: dict = {}
        self.hits: dict = {}
        self._stop = threading.Event()
        self._t = None

    def tcp(self, ns, ip, port, reply_original_dst=False):
        s = in_ns(ns, socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(64)
        s.setblocking(False)
        self.socks[s] = ("tcp", ns, ip, port, reply_original_dst)
        self.hits[("tcp", ns, port)] = 0
        return s

    def udp(self, ns, ip, port):
        s = in_ns(ns, socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((ip, port))
        s.setblocking(False)
        self.socks[s] = ("udp", ns, ip, port, False)
        self.hits[("udp", ns, port)] = 0
        return s

    def start(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            r, _, _ = select.select(list(self.socks), [], [], 0.05)
            for s in r:
                kind, ns, ip, port, orig = self.socks[s]
                self.hits[(kind, ns, port)] += 1
                if kind == "udp":
                    with suppress(OSError):
                        data, peer = s.recvfrom(65535)
                        s.sendto(b"ECHO:" + data, peer)
                    continue
                with suppress(OSError):
                    c, peer = s.accept()
                    c.settimeout(1)
                    msg = f"HELLO {port} from {peer[0]}"
                    if orig:
                        raw = c.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
                        dport, = struct.unpack_from("!H", raw, 2)
                        msg += f" orig {socket.inet_ntoa(raw[4:8])}:{dport}"
                    c.sendall(msg.encode())
                    c.close()

    def stop(self):
        self._stop.set()
        if self._t:
            self._t.join(2)
        for s in self.socks:
            s.close()


class Lab:
    def __init__(self, backend: str):
        self.tag = "cg" + secrets.token_hex(3)
        self.hub = self.tag + "h"
        self.inet = self.tag + "i"
        self.tmp = tempfile.mkdtemp(prefix=self.tag)
        self.bpffs = os.path.join(self.tmp, "bpf")
        self.state = os.path.join(self.tmp, "state")
        self.backend = backend
        self.sw: Switch | None = None
        self.listeners = Listeners()

    def setup(self):
        netns.create(self.hub)
        netns.create(self.inet)
        with netns.entered(self.hub):
            ipr = IPRoute()
        try:
            ipr.link("add", ifname="up0", kind="veth",
                     peer={"ifname": "eth0", "net_ns_fd": netns.path(self.inet)})
            up = ipr.link_lookup(ifname="up0")[0]
            ipr.addr("add", index=up, address=HUB_UPLINK_IP, prefixlen=24)
            ipr.link("set", index=up, state="up")
        finally:
            ipr.close()
        netns.write_sysctl(self.hub, "net.ipv4.ip_forward", 1)
        with netns.entered(self.inet):
            ipr = IPRoute()
        try:
            eth = ipr.link_lookup(ifname="eth0")[0]
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            ipr.addr("add", index=eth, address=INET_IP, prefixlen=24)
            ipr.link("set", index=eth, state="up")
            ipr.route("add", dst="10.200.0.0/16", gateway=HUB_UPLINK_IP)
        finally:
            ipr.close()
        self.sw = self.open_switch()
        L = self.listeners
        L.tcp(self.hub, "0.0.0.0", 8081, reply_original_dst=True)   # transparent listener
        L.tcp(self.hub, GW, 8080)                                    # explicit proxy port
        L.tcp(self.hub, GW, 2222)                                    # a host service
        L.udp(self.hub, GW, 53)                                      # our DNS
        L.udp(self.hub, GW, 5353)                                    # a host UDP service
        for p in (80, 443, 5432, 5433):
            L.tcp(self.inet, INET_IP, p)
        for p in (53, 443, 5432):
            L.udp(self.inet, INET_IP, p)
        L.start()

    def open_switch(self, **kw):
        return Switch(hub_netns=self.hub, state_dir=self.state, bpffs_dir=self.bpffs,
                      backend=self.backend, netns_prefix=self.tag + "s", **kw)

    def teardown(self):
        self.listeners.stop()
        if self.sw is not None:
            with suppress(Exception):
                for sb in self.sw.sandboxes():
                    self.sw.detach_sandbox(sb.sandbox_id)
            with suppress(Exception):
                self.sw.close()
        for name in os.listdir(netns.NETNS_RUN_DIR) if os.path.isdir(netns.NETNS_RUN_DIR) else []:
            if name.startswith(self.tag):
                netns.remove(name)
        if os.path.isdir(self.bpffs):
            datapath.remove_pins(self.bpffs)
            libbpf.umount_bpffs(self.bpffs)
        shutil.rmtree(self.tmp, ignore_errors=True)


