"""Load, pin and attach the cubevs TC program; read/write its maps.

ctypes over Debian's libbpf.so.1 (1.1.x).  That libbpf predates tcx helpers,
so tcx attach goes through bpf_prog_attach() with the raw attach type
(kernel >= 6.6).  Default is clsact + bpf_tc_attach() (0.2 ms per veth against
5-20 ms for tcx, which waits for an RCU grace period); both persist without a
process holding them.

Pins (all under one bpffs directory, so a daemon restart reuses them):
  <dir>/sandboxes, config, hub_addrs, l4_allow, counters, events   maps
  <dir>/prog_ingress                                               program
Struct layouts mirror cubevs/bpf/switch.c -- keep them in sync.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import os
import struct
import time
from pathlib import Path
from typing import Iterator

from . import netns as _netns

# Reason names, index == enum reason in switch.c.
REASONS = (
    "unknown_sandbox", "gateway", "dns", "web", "l4_allow", "arp",
    "spoof_ip", "spoof_mac", "arp_spoof", "ipv6", "sandbox_to_sandbox",
    "host_service", "quic", "foreign_dns", "port_not_allowed", "fragment",
    "malformed", "ethertype",
)
ALLOW_REASONS = frozenset({"gateway", "dns", "web", "l4_allow", "arp"})
MAX_GW_PORTS = 8
SB_F_ENABLED = 1

BPF_TCX_INGRESS = 46          # enum bpf_attach_type (uapi 6.6); Debian 12 headers predate it
BPF_TC_INGRESS, BPF_TC_EGRESS = 1, 2   # enum bpf_tc_attach_point
BPF_FS_MAGIC = 0xCAFE4A11
BPF_ANY, BPF_NOEXIST = 0, 1
PROG_PIN = "prog_ingress"
MAP_NAMES = ("sandboxes", "config", "hub_addrs", "l4_allow", "counters", "events")
PROG_NAME = b"cubevs_ingress"


class BpfError(OSError):
    pass


# ---------------------------------------------------------------- C structs
class SandboxVal(ctypes.Structure):
    _fields_ = [("ip", ctypes.c_uint32), ("mac", ctypes.c_uint8 * 6), ("_pad", ctypes.c_uint16),
                ("sandbox_no", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class ConfigVal(ctypes.Structure):
    _fields_ = [("gateway_ip", ctypes.c_uint32), ("pool_net", ctypes.c_uint32),
                ("pool_mask", ctypes.c_uint32), ("dns_port", ctypes.c_uint16),
                ("n_gw_ports", ctypes.c_uint16), ("gw_ports", ctypes.c_uint16 * MAX_GW_PORTS),
                ("web_ports", ctypes.c_uint16 * 2)]


class L4Key(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("sandbox_no", ctypes.c_uint32),
                ("port", ctypes.c_uint16), ("proto", ctypes.c_uint8), ("_pad", ctypes.c_uint8),
                ("daddr", ctypes.c_uint32)]


class CounterKey(ctypes.Structure):
    _fields_ = [("sandbox_no", ctypes.c_uint32), ("reason", ctypes.c_uint32)]


class CounterVal(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class Event(ctypes.Structure):
    _fields_ = [("ts_ns", ctypes.c_uint64), ("ifindex", ctypes.c_uint32),
                ("sandbox_no", ctypes.c_uint32), ("reason", ctypes.c_uint32),
                ("saddr", ctypes.c_uint32), ("daddr", ctypes.c_uint32),
                ("dport", ctypes.c_uint16), ("proto", ctypes.c_uint8), ("_pad", ctypes.c_uint8)]


class _OpenOpts(ctypes.Structure):  # struct bpf_object_open_opts, prefix up to pin_root_path
    _fields_ = [("sz", ctypes.c_size_t), ("object_name", ctypes.c_char_p),
                ("relaxed_maps", ctypes.c_bool), ("pin_root_path", ctypes.c_char_p)]


class _TcHook(ctypes.Structure):
    _fields_ = [("sz", ctypes.c_size_t), ("ifindex", ctypes.c_int),
                ("attach_point", ctypes.c_int), ("parent", ctypes.c_uint32)]


class _TcOpts(ctypes.Structure):
    _fields_ = [("sz", ctypes.c_size_t), ("prog_fd", ctypes.c_int), ("flags", ctypes.c_uint32),
                ("prog_id", ctypes.c_uint32), ("handle", ctypes.c_uint32),
                ("priority", ctypes.c_uint32)]


class _ProgInfo(ctypes.Structure):  # struct bpf_prog_info prefix: type, id
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("rest", ctypes.c_uint8 * 240)]


_RB_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


# ---------------------------------------------------------------- libbpf
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    vp, ci, cu, cs = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
    sig = {
        "bpf_object__open_file": (vp, [cs, vp]),
        "bpf_object__load": (ci, [vp]),
        "bpf_object__close": (None, [vp]),
        "bpf_object__find_program_by_name": (vp, [vp, cs]),
        "bpf_program__fd": (ci, [vp]),
        "bpf_program__pin": (ci, [vp, cs]),
        "bpf_obj_get": (ci, [cs]),
        "bpf_obj_pin": (ci, [ci, cs]),
        "bpf_obj_get_info_by_fd": (ci, [ci, vp, ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_map_update_elem": (ci, [ci, vp, vp, ctypes.c_uint64]),
        "bpf_map_lookup_elem": (ci, [ci, vp, vp]),
        "bpf_map_delete_elem": (ci, [ci, vp]),
        "bpf_map_get_next_key": (ci, [ci, vp, vp]),
        "bpf_prog_attach": (ci, [ci, ci, ci, cu]),
        "bpf_prog_detach2": (ci, [ci, ci, ci]),
        "bpf_prog_query": (ci, [ci, ci, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32),
                                ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_tc_hook_create": (ci, [vp]),
        "bpf_tc_hook_destroy": (ci, [vp]),
        "bpf_tc_attach": (ci, [vp, vp]),
        "bpf_tc_detach": (ci, [vp, vp]),
        "bpf_tc_query": (ci, [vp, vp]),
        "libbpf_num_possible_cpus": (ci, []),
        "libbpf_get_error": (ctypes.c_long, [vp]),
        "ring_buffer__new": (vp, [ci, _RB_CB, vp, vp]),
        "ring_buffer__consume": (ci, [vp]),
        "ring_buffer__free": (None, [vp]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


_LIB: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        _LIB = _lib()
    return _LIB


def _err(rc: int, what: str) -> BpfError:
    e = -rc if rc < 0 else ctypes.get_errno()
    return BpfError(e, f"{what}: {os.strerror(e)}")


def ip_to_be32(ip: str | ipaddress.IPv4Address) -> int:
    """IPv4 address -> u32 whose in-memory bytes are network order."""
    return struct.unpack("=I", ipaddress.IPv4Address(ip).packed)[0]


def be32_to_ip(v: int) -> str:
    return str(ipaddress.IPv4Address(struct.pack("=I", v)))


# ---------------------------------------------------------------- bpffs
def is_bpffs(path: str | os.PathLike) -> bool:
    """True if `path` is on a bpffs (statfs f_type; os.statvfs does not expose it)."""
    buf = ctypes.create_string_buffer(128)   # struct statfs; f_type is the first long
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return struct.unpack_from("=q", buf, 0)[0] & 0xFFFFFFFF == BPF_FS_MAGIC


def ensure_bpffs(path: str | os.PathLike) -> None:
    """Mount a bpffs at `path` unless one is already there (or path is inside one)."""
    p = Path(path)
    if is_bpffs(p):
        return
    p.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(b"bpf", os.fsencode(p), b"bpf", 0, None) != 0:
        e = ctypes.get_errno()
        raise BpfError(e, f"mount bpffs at {p}: {os.strerror(e)}")


def umount_bpffs(path: str | os.PathLike) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.umount2(os.fsencode(path), 2)


# ---------------------------------------------------------------- maps
class Map:
    """A pinned BPF map accessed by fd through libbpf's syscall wrappers."""

    def __init__(self, fd: int, key_type, value_type, percpu: bool = False):
        self.fd, self.key_type, self.value_type, self.percpu = fd, key_type, value_type, percpu
        self.ncpu = lib().libbpf_num_possible_cpus() if percpu else 1

    def _vbuf(self):
        return (self.value_type * self.ncpu)() if self.percpu else self.value_type()

    def update(self, key, value, flags: int = BPF_ANY) -> None:
        rc = lib().bpf_map_update_elem(self.fd, ctypes.byref(key), ctypes.byref(value), flags)
        if rc != 0:
            raise _err(rc, "bpf_map_update_elem")

    def lookup(self, key):
        v = self._vbuf()
        rc = lib().bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(v))
        if rc != 0:
            if -rc == 2 or ctypes.get_errno() == 2:
                return None
            raise _err(rc, "bpf_map_lookup_elem")
        return v

    def delete(self, key) -> bool:
        rc = lib().bpf_map_delete_elem(self.fd, ctypes.byref(key))
        return rc == 0

    def keys(self) -> Iterator:
        prev = None
        while True:
            nk = self.key_type()
            rc = lib().bpf_map_get_next_key(self.fd, ctypes.byref(prev) if prev is not None else None,
                                            ctypes.byref(nk))
            if rc != 0:
                return
            yield nk
            prev = nk

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


MAP_TYPES = {
    "sandboxes": (ctypes.c_uint32, SandboxVal, False),
    "config": (ctypes.c_uint32, ConfigVal, False),
    "hub_addrs": (ctypes.c_uint32, ctypes.c_uint8, False),
    "l4_allow": (L4Key, ctypes.c_uint8, False),
    "counters": (CounterKey, CounterVal, True),
}


# ---------------------------------------------------------------- datapath
class Datapath:
    """The loaded program + its pinned maps under one bpffs directory."""

    def __init__(self, pin_dir: str | os.PathLike, obj_path: str | os.PathLike | None = None):
        self.pin_dir = Path(pin_dir)
        ensure_bpffs(self.pin_dir)
        prog_pin = self.pin_dir / PROG_PIN
        if not prog_pin.exists():
            if obj_path is None:
                raise BpfError(2, f"no pinned program at {prog_pin} and no object to load")
            self._load_and_pin(Path(obj_path))
        self.load_ms: float | None = getattr(self, "load_ms", None)
        self.prog_fd = self._obj_get(prog_pin)
        self.prog_id = self._prog_id(self.prog_fd)
        self.maps: dict[str, Map] = {}
        for name, (kt, vt, percpu) in MAP_TYPES.items():
            self.maps[name] = Map(self._obj_get(self.pin_dir / name), kt, vt, percpu)
        self.events_fd = self._obj_get(self.pin_dir / "events")
        self._rb = None
        self._rb_cb = None
        self._rb_sink: list | None = None
        self._rb_max = 0

    # -- loading
    def _load_and_pin(self, obj_path: Path) -> None:
        t0 = time.perf_counter()
        L = lib()
        opts = _OpenOpts(sz=ctypes.sizeof(_OpenOpts), pin_root_path=os.fsencode(self.pin_dir))
        obj = L.bpf_object__open_file(os.fsencode(obj_path), ctypes.byref(opts))
        if not obj or L.libbpf_get_error(obj):
            raise BpfError(ctypes.get_errno() or 22, f"bpf_object__open_file({obj_path}) failed")
        try:
            rc = L.bpf_object__load(obj)   # creates maps or reuses pins (LIBBPF_PIN_BY_NAME)
            if rc != 0:
                raise _err(rc, "bpf_object__load (verifier log on stderr)")
            prog = L.bpf_object__find_program_by_name(obj, PROG_NAME)
            if not prog:
                raise BpfError(2, "program cubevs_ingress not in object")
            rc = L.bpf_program__pin(prog, os.fsencode(self.pin_dir / PROG_PIN))
            if rc != 0:
                raise _err(rc, "bpf_program__pin")
        finally:
            L.bpf_object__close(obj)  # pins keep program and maps alive
        self.load_ms = (time.perf_counter() - t0) * 1000

    @staticmethod
    def _obj_get(path: Path) -> int:
        fd = lib().bpf_obj_get(os.fsencode(path))
        if fd < 0:
            raise _err(fd, f"bpf_obj_get({path})")
        return fd

    @staticmethod
    def _prog_id(fd: int) -> int:
        info = _ProgInfo()
        ln = ctypes.c_uint32(ctypes.sizeof(info))
        rc = lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(ln))
        if rc != 0:
            raise _err(rc, "bpf_obj_get_info_by_fd")
        return info.id

    def close(self) -> None:
        if self._rb:
            lib().ring_buffer__free(self._rb)
            self._rb = None
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
        L = lib()
        with _netns.entered(ns):
            if mode == "tcx":
                rc = L.bpf_prog_attach(self.prog_fd, ifindex, BPF_TCX_INGRESS, 0)
                if rc == 0 or -rc == 17:  # EEXIST: already attached (idempotent)
                    return "tcx"
                raise _err(rc, f"tcx attach to ifindex {ifindex}")
            try:
                return self._attach_tc(ifindex)
            except BpfError:
                if mode == "tc":
                    raise
                rc = L.bpf_prog_attach(self.prog_fd, ifindex, BPF_TCX_INGRESS, 0)
                if rc == 0 or -rc == 17:
                    return "tcx"
                raise

    def _attach_tc(self, ifindex: int) -> str:
        """clsact qdisc + direct-action filter (handle 1, prio 1); caller is in the netns."""
        L = lib()
        hook = _TcHook(sz=ctypes.sizeof(_TcHook), ifindex=ifindex, attach_point=BPF_TC_INGRESS)
        rc = L.bpf_tc_hook_create(ctypes.byref(hook))
        if rc != 0 and -rc != 17:   # EEXIST: clsact already there
            raise _err(rc, f"clsact on ifindex {ifindex}")
        opts = _TcOpts(sz=ctypes.sizeof(_TcOpts), prog_fd=self.prog_fd, handle=1, priority=1,
                       flags=1)  # BPF_TC_F_REPLACE: idempotent
        rc = L.bpf_tc_attach(ctypes.byref(hook), ctypes.byref(opts))
        if rc != 0:
            raise _err(rc, f"bpf_tc_attach ifindex {ifindex}")
        return "tc"

    def detach(self, ifindex: int, ns: str | None) -> None:
        """Best effort, both hooks; deleting the veth detaches anyway."""
        with _netns.entered(ns):
            lib().bpf_prog_detach2(self.prog_fd, ifindex, BPF_TCX_INGRESS)
            if self.attached(ifindex, None) == "tc":   # we own the veth: drop its clsact
                hook = _TcHook(sz=ctypes.sizeof(_TcHook), ifindex=ifindex,
                               attach_point=BPF_TC_INGRESS | BPF_TC_EGRESS)
                lib().bpf_tc_hook_destroy(ctypes.byref(hook))

    def attached(self, ifindex: int, ns: str | None) -> str | None:
        """"tc" or "tcx" if our program is on ifindex's ingress, else None."""
        if self.prog_id in self.attached_prog_ids(ifindex, ns):
            return "tcx"
        hook = _TcHook(sz=ctypes.sizeof(_TcHook), ifindex=ifindex, attach_point=BPF_TC_INGRESS)
        opts = _TcOpts(sz=ctypes.sizeof(_TcOpts), handle=1, priority=1)
        with _netns.entered(ns):
            rc = lib().bpf_tc_query(ctypes.byref(hook), ctypes.byref(opts))
        return "tc" if rc == 0 and opts.prog_id == self.prog_id else None

    def attached_prog_ids(self, ifindex: int, ns: str | None) -> list[int]:
        """Program ids on tcx ingress of ifindex (tc-clsact attachments are not listed)."""
        ids = (ctypes.c_uint32 * 16)()
        cnt = ctypes.c_uint32(16)
        flags = ctypes.c_uint32(0)
        with _netns.entered(ns):
            rc = lib().bpf_prog_query(ifindex, BPF_TCX_INGRESS, 0, ctypes.byref(flags), ids,
                                      ctypes.byref(cnt))
        if rc != 0:
            return []
        return list(ids[: cnt.value])

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
        return L4Key(prefixlen=64 + net.prefixlen, sandbox_no=sandbox_no, port=port, proto=proto,
                     daddr=ip_to_be32(net.network_address))

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
                out.append((k.sandbox_no, f"{be32_to_ip(k.daddr)}/{k.prefixlen - 64}", k.port, k.proto))
        return out

    # -- counters
    def read_counters(self, sandbox_no: int | None = None) -> dict[tuple[int, str], tuple[int, int]]:
        m = self.maps["counters"]
        out = {}
        for k in list(m.keys()):
            if sandbox_no is not None and k.sandbox_no != sandbox_no:
                continue
            v = m.lookup(k)
            if v is None:
                continue
            pk = sum(c.packets for c in v)
            by = sum(c.bytes for c in v)
            reason = REASONS[k.reason] if k.reason < len(REASONS) else f"reason_{k.reason}"
            out[(k.sandbox_no, reason)] = (pk, by)
        return out

    def del_counters_for(self, sandbox_no: int) -> None:
        m = self.maps["counters"]
        for r in range(len(REASONS)):
            m.delete(CounterKey(sandbox_no=sandbox_no, reason=r))

    # -- ring buffer
    def drain_events(self, max_events: int = 1000) -> list[Event]:
        sink: list[Event] = []
        if max_events <= 0:
            return sink
        if self._rb is None:
            def _cb(_ctx, data, size):
                ev = Event.from_buffer_copy(ctypes.string_at(data, min(size, ctypes.sizeof(Event))))
                self._rb_sink.append(ev)
                return -1 if len(self._rb_sink) >= self._rb_max else 0  # <0 stops after this one
            self._rb_cb = _RB_CB(_cb)
            rb = lib().ring_buffer__new(self.events_fd, self._rb_cb, None, None)
            if not rb or lib().libbpf_get_error(rb):
                raise BpfError(ctypes.get_errno() or 22, "ring_buffer__new failed")
            self._rb = rb
        self._rb_sink, self._rb_max = sink, max_events
        lib().ring_buffer__consume(self._rb)
        self._rb_sink = None
        return sink


def remove_pins(pin_dir: str | os.PathLike) -> None:
    """Unpin program and maps (the kernel frees them once nothing references them)."""
    for name in (PROG_PIN, *MAP_NAMES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(Path(pin_dir) / name)
