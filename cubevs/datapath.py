"""The switch's control plane: load and pin switch.o, attach it, own its maps.

Pins (all under one bpffs directory, so a daemon restart reuses them):
  <dir>/sandboxes, config, hub_addrs, l4_allow, counters, events   maps
  <dir>/prog_ingress                                               program
Attach default is clsact + a direct-action filter (0.2 ms per veth against
5-20 ms for tcx, which waits for an RCU grace period); both persist without a
process holding them.
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import time
from pathlib import Path

from . import libbpf
from . import netns as _netns
from .libbpf import BpfError
from .switch_schema import (L4_KEY_PREFIX_BITS, MAPS, MAX_GW_PORTS, PROG_NAME, PROG_PIN,
                            REASON_CODES, SB_F_ENABLED, ConfigVal, CounterKey, Event, L4Key,
                            SandboxVal, be32_to_ip, ip_to_be32, reason_name)

__all__ = ["Datapath", "BpfError", "remove_pins"]


class Datapath:
    """The loaded program + its pinned maps under one bpffs directory."""

    def __init__(self, pin_dir: str | os.PathLike, obj_path: str | os.PathLike | None = None):
        self.pin_dir = Path(pin_dir)
        libbpf.ensure_bpffs(self.pin_dir)
        prog_pin = self.pin_dir / PROG_PIN
        self.load_ms: float | None = None
        if not prog_pin.exists():
            if obj_path is None:
                raise BpfError(2, f"no pinned program at {prog_pin} and no object to load")
            t0 = time.perf_counter()
            libbpf.load_and_pin_program(obj_path, self.pin_dir, PROG_NAME, prog_pin)
            self.load_ms = (time.perf_counter() - t0) * 1000
        self.prog_fd = libbpf.obj_get(prog_pin)
        self.prog_id = libbpf.prog_id(self.prog_fd)
        self.maps: dict[str, libbpf.Map] = {}
        for name, spec in MAPS.items():
            if spec.key is not None:
                fd = libbpf.obj_get(self.pin_dir / name)
                self.maps[name] = libbpf.Map(fd, spec.key, spec.value, spec.percpu)
        self.events_fd = libbpf.obj_get(self.pin_dir / "events")
        self._events: libbpf.RingBuffer | None = None

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        for m in self.maps.values():
            m.close()
        for attr in ("prog_fd", "events_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    # -- attach (ifindex is relative to netns `ns`; the syscalls use the thread's netns)
    def attach(self, ifindex: int, ns: str | None, mode: str = "auto") -> str:
        """Attach to ingress of ifindex. "tc" = clsact + direct-action filter (persistent,
        ~0.2 ms); "tcx" = tcx mprog attach (kernel >= 6.6, ~5-20 ms here: it waits for an
        RCU grace period); "auto" = tc, tcx if clsact fails."""
        if mode not in ("auto", "tc", "tcx"):
            raise ValueError(f"attach mode {mode!r}")
        with _netns.entered(ns):
            if mode == "tcx":
                libbpf.tcx_attach(self.prog_fd, ifindex)
                return "tcx"
            try:
                libbpf.tc_attach(self.prog_fd, ifindex)
                return "tc"
            except BpfError:
                if mode == "tc":
                    raise
                libbpf.tcx_attach(self.prog_fd, ifindex)
                return "tcx"

    def detach(self, ifindex: int, ns: str | None) -> None:
        """Best effort, both hooks; deleting the veth detaches anyway."""
        with _netns.entered(ns):
            libbpf.tcx_detach(self.prog_fd, ifindex)
            if self.attached(ifindex, None) == "tc":   # we own the veth: drop its clsact
                libbpf.tc_destroy_clsact(ifindex)

    def attached(self, ifindex: int, ns: str | None) -> str | None:
        """"tc" or "tcx" if our program is on ifindex's ingress, else None."""
        with _netns.entered(ns):
            if self.prog_id in libbpf.tcx_prog_ids(ifindex):
                return "tcx"
            return "tc" if libbpf.tc_prog_id(ifindex) == self.prog_id else None

    def attached_prog_ids(self, ifindex: int, ns: str | None) -> list[int]:
        """Program ids on tcx ingress of ifindex (tc-clsact attachments are not listed)."""
        with _netns.entered(ns):
            return libbpf.tcx_prog_ids(ifindex)

    # -- policy maps
    def set_config(self, *, gateway_ip: str, pool: str, gateway_ports, dns_port: int,
                   web_ports=(80, 443)) -> None:
        net = ipaddress.IPv4Network(pool)
        ports = list(gateway_ports)
        if len(ports) > MAX_GW_PORTS:
            raise ValueError(f"at most {MAX_GW_PORTS} gateway ports")
        c = ConfigVal(gateway_ip=ip_to_be32(gateway_ip), pool_net=ip_to_be32(net.network_address),
                      pool_mask=ip_to_be32(net.netmask), dns_port=dns_port, n_gw_ports=len(ports))
        for i, p in enumerate(ports):
            c.gw_ports[i] = p
        c.web_ports[0], c.web_ports[1] = web_ports
        self.maps["config"].update(ctypes.c_uint32(0), c)

    def add_hub_addr(self, ip: str) -> None:
        self.maps["hub_addrs"].update(ctypes.c_uint32(ip_to_be32(ip)), ctypes.c_uint8(1))

    def put_sandbox(self, ifindex: int, *, ip: str, mac: str, sandbox_no: int) -> None:
        v = SandboxVal(ip=ip_to_be32(ip), sandbox_no=sandbox_no, flags=SB_F_ENABLED)
        for i, b in enumerate(bytes.fromhex(mac.replace(":", ""))):
            v.mac[i] = b
        self.maps["sandboxes"].update(ctypes.c_uint32(ifindex), v)

    def get_sandbox(self, ifindex: int) -> SandboxVal | None:
        return self.maps["sandboxes"].lookup(ctypes.c_uint32(ifindex))

    def del_sandbox(self, ifindex: int) -> None:
        self.maps["sandboxes"].delete(ctypes.c_uint32(ifindex))

    @staticmethod
    def _l4key(sandbox_no: int, cidr: str, port: int, proto: int) -> L4Key:
        net = ipaddress.IPv4Network(cidr, strict=False)
        return L4Key(prefixlen=L4_KEY_PREFIX_BITS + net.prefixlen, sandbox_no=sandbox_no, port=port,
                     proto=proto, daddr=ip_to_be32(net.network_address))

    def put_l4(self, sandbox_no: int, cidr: str, port: int, proto: int) -> None:
        self.maps["l4_allow"].update(self._l4key(sandbox_no, cidr, port, proto), ctypes.c_uint8(1))

    def del_l4_for(self, sandbox_no: int) -> int:
        m = self.maps["l4_allow"]
        victims = [k for k in m.keys() if k.sandbox_no == sandbox_no]
        for k in victims:
            m.delete(k)
        return len(victims)

    def l4_entries(self, sandbox_no: int | None = None) -> list[tuple[int, str, int, int]]:
        out = []
        for k in self.maps["l4_allow"].keys():
            if sandbox_no is None or k.sandbox_no == sandbox_no:
                cidr = f"{be32_to_ip(k.daddr)}/{k.prefixlen - L4_KEY_PREFIX_BITS}"
                out.append((k.sandbox_no, cidr, k.port, k.proto))
        return out

    # -- counters
    def read_counters(self, sandbox_no: int | None = None) -> dict[tuple[int, str], tuple[int, int]]:
        """{(sandbox_no, reason): (packets, bytes)} summed over CPUs."""
        m = self.maps["counters"]
        out = {}
        for k in list(m.keys()):
            if sandbox_no is not None and k.sandbox_no != sandbox_no:
                continue
            v = m.lookup(k)
            if v is None:
                continue
            out[(k.sandbox_no, reason_name(k.reason))] = (sum(c.packets for c in v),
                                                          sum(c.bytes for c in v))
        return out

    def del_counters_for(self, sandbox_no: int) -> None:
        m = self.maps["counters"]
        for code in REASON_CODES.values():
            m.delete(CounterKey(sandbox_no=sandbox_no, reason=code))

    # -- ring buffer
    def drain_events(self, max_events: int = 1000) -> list[Event]:
        if max_events <= 0:
            return []
        if self._events is None:
            self._events = libbpf.RingBuffer(self.events_fd)
        size = ctypes.sizeof(Event)
        return [Event.from_buffer_copy(r[:size].ljust(size, b"\0"))
                for r in self._events.drain(max_events)]


def remove_pins(pin_dir: str | os.PathLike) -> None:
    """Unpin program and maps (the kernel frees them once nothing references them)."""
    for name in (PROG_PIN, *MAPS):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(Path(pin_dir) / name)
