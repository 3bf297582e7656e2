"""The switch datapath's schema: mirrors of cubevs/bpf/switch.c.  Pure data, no I/O.

The reason enum, the struct layouts and the map key/value types here are checked
against the BTF of the built object by tests/cubevs/test_switch_schema.py; change
them together with switch.c.
"""
from __future__ import annotations

import ctypes
import ipaddress
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

# ---------------------------------------------------------------- reasons
# enum reason in switch.c: name = the C name without R_, lower case; value = its code.
# The one registry of the switch's verdict reasons (both backends count by these names).
REASON_CODES: Mapping[str, int] = MappingProxyType({
    "unknown_sandbox": 0,     # drop: ifindex has no sandbox entry (fail closed)
    "gateway": 1,             # allow: TCP to gateway ip : gateway port
    "dns": 2,                 # allow: UDP/TCP dns_port to the gateway ip
    "web": 3,                 # allow: TCP 80/443 to the outside (steered)
    "l4_allow": 4,            # allow: listed in l4_allow
    "arp": 5,                 # allow: valid ARP from the sandbox
    "spoof_ip": 6,
    "spoof_mac": 7,
    "arp_spoof": 8,
    "ipv6": 9,
    "sandbox_to_sandbox": 10,
    "host_service": 11,
    "quic": 12,
    "foreign_dns": 13,
    "port_not_allowed": 14,
    "fragment": 15,
    "malformed": 16,
    "ethertype": 17,
})
REASON_ENUM = "reason"                # the C enum's tag
REASON_C_PREFIX = "R_"
REASON_C_SENTINEL = "R_MAX"           # = number of reasons; not a reason itself
ALLOW_REASONS = frozenset({"gateway", "dns", "web", "l4_allow", "arp"})   # is_allow() in switch.c
DROP_REASONS = frozenset(REASON_CODES) - ALLOW_REASONS
_REASON_NAMES = {code: name for name, code in REASON_CODES.items()}


def reason_name(code: int) -> str:
    """Name of a reason code read from a map or event; unknown codes stay visible."""
    return _REASON_NAMES.get(code, f"reason_{code}")


def verdict_of(reason: str) -> str:
    return "allow" if reason in ALLOW_REASONS else "drop"


# ---------------------------------------------------------------- structs
MAX_GW_PORTS = 8
SB_F_ENABLED = 1
L4_KEY_PREFIX_BITS = 64   # l4_key: prefixlen counts sandbox_no + port + proto + _pad first


class SandboxVal(ctypes.Structure):   # struct sandbox
    _fields_ = [("ip", ctypes.c_uint32), ("mac", ctypes.c_uint8 * 6), ("_pad", ctypes.c_uint16),
                ("sandbox_no", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class ConfigVal(ctypes.Structure):    # struct config
    _fields_ = [("gateway_ip", ctypes.c_uint32), ("pool_net", ctypes.c_uint32),
                ("pool_mask", ctypes.c_uint32), ("dns_port", ctypes.c_uint16),
                ("n_gw_ports", ctypes.c_uint16), ("gw_ports", ctypes.c_uint16 * MAX_GW_PORTS),
                ("web_ports", ctypes.c_uint16 * 2)]


class L4Key(ctypes.Structure):        # struct l4_key
    _fields_ = [("prefixlen", ctypes.c_uint32), ("sandbox_no", ctypes.c_uint32),
                ("port", ctypes.c_uint16), ("proto", ctypes.c_uint8), ("_pad", ctypes.c_uint8),
                ("daddr", ctypes.c_uint32)]


class CounterKey(ctypes.Structure):   # struct counter_key
    _fields_ = [("sandbox_no", ctypes.c_uint32), ("reason", ctypes.c_uint32)]


class CounterVal(ctypes.Structure):   # struct counter_val (per CPU)
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class Event(ctypes.Structure):        # struct event (ring buffer record)
    _fields_ = [("ts_ns", ctypes.c_uint64), ("ifindex", ctypes.c_uint32),
                ("sandbox_no", ctypes.c_uint32), ("reason", ctypes.c_uint32),
                ("saddr", ctypes.c_uint32), ("daddr", ctypes.c_uint32),
                ("dport", ctypes.c_uint16), ("proto", ctypes.c_uint8), ("_pad", ctypes.c_uint8)]


# C struct name -> ctypes mirror
STRUCTS: Mapping[str, type[ctypes.Structure]] = MappingProxyType({
    "sandbox": SandboxVal, "config": ConfigVal, "l4_key": L4Key,
    "counter_key": CounterKey, "counter_val": CounterVal, "event": Event,
})


# ---------------------------------------------------------------- maps and program
@dataclass(frozen=True)
class MapSpec:
    key: type | None        # ctypes type; None for a ring buffer
    value: type | None
    percpu: bool = False


MAPS: Mapping[str, MapSpec] = MappingProxyType({
    "sandboxes": MapSpec(ctypes.c_uint32, SandboxVal),        # key: hub-side ifindex
    "config": MapSpec(ctypes.c_uint32, ConfigVal),            # one entry, key 0
    "hub_addrs": MapSpec(ctypes.c_uint32, ctypes.c_uint8),    # key: address (network order)
    "l4_allow": MapSpec(L4Key, ctypes.c_uint8),
    "counters": MapSpec(CounterKey, CounterVal, percpu=True),
    "events": MapSpec(None, None),                            # ring buffer of Event
})
PROG_NAME = "cubevs_ingress"
PROG_PIN = "prog_ingress"


# ---------------------------------------------------------------- field encodings
def ip_to_be32(ip: str | ipaddress.IPv4Address) -> int:
    """IPv4 address -> u32 whose in-memory bytes are network order (the maps' ip fields)."""
    return struct.unpack("=I", ipaddress.IPv4Address(ip).packed)[0]


def be32_to_ip(v: int) -> str:
    return str(ipaddress.IPv4Address(struct.pack("=I", v)))
