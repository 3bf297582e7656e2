"""Switch backend: the TC/tcx eBPF program (cubevs/bpf/switch.c)."""
from __future__ import annotations

import time

from . import build as _build
from .datapath import Datapath
from .policy import PROTO_NAMES, PROTOS
from .registry import Entry
from .switch_schema import be32_to_ip, reason_name


class EbpfBackend:
    name = "ebpf"

    def __init__(self, *, hub_netns, bpffs_dir, gateway_ip, pool, gateway_ports, dns_port,
                 hub_addrs=(), attach_mode="auto"):
        self.hub_netns = hub_netns
        self.attach_mode = attach_mode
        self.dp = Datapath(bpffs_dir, _build.build())
        self.dp.set_config(gateway_ip=gateway_ip, pool=pool, gateway_ports=gateway_ports,
                           dns_port=dns_port)
        for a in hub_addrs:
            self.dp.add_hub_addr(a)
        self.modes: dict[int, str] = {}

    def close(self) -> None:
        self.dp.close()

    def add(self, e: Entry) -> None:
        # map entry first: until it exists the program drops everything (fail closed)
        self.dp.put_sandbox(e.ifindex, ip=e.ip, mac=e.mac, sandbox_no=e.sandbox_no)
        self.set_l4(e, e.l4_allow)
        self.modes[e.ifindex] = self.dp.attach(e.ifindex, self.hub_netns, self.attach_mode)

    def ensure(self, e: Entry) -> None:
        """Re-install map entries and attachment (after a restart); idempotent."""
        self.dp.put_sandbox(e.ifindex, ip=e.ip, mac=e.mac, sandbox_no=e.sandbox_no)
        self.set_l4(e, e.l4_allow)
        mode = self.dp.attached(e.ifindex, self.hub_netns)
        self.modes[e.ifindex] = mode or self.dp.attach(e.ifindex, self.hub_netns, self.attach_mode)

    def remove(self, e: Entry, *, detach: bool = True) -> None:
        if detach:   # not needed when the veth is deleted right after (saves ~10 ms)
            self.dp.detach(e.ifindex, self.hub_netns)
        self.dp.del_sandbox(e.ifindex)
        self.dp.del_l4_for(e.sandbox_no)
        self.dp.del_counters_for(e.sandbox_no)
        self.modes.pop(e.ifindex, None)

    def set_l4(self, e: Entry, rules) -> None:
        self.dp.del_l4_for(e.sandbox_no)
        for cidr, port, proto in rules:
            self.dp.put_l4(e.sandbox_no, cidr, port, PROTOS[proto])

    def is_attached(self, e: Entry) -> bool:
        return self.dp.attached(e.ifindex, self.hub_netns) is not None

    def has_trace(self, e: Entry) -> bool:
        return (self.dp.get_sandbox(e.ifindex) is not None
                or bool(self.dp.l4_entries(e.sandbox_no))
                or bool(self.dp.read_counters(e.sandbox_no)))

    def counters(self, sandbox_no=None) -> dict[tuple[int, str], tuple[int, int]]:
        return self.dp.read_counters(sandbox_no)

    def drain_events(self, max_events: int) -> list[dict]:
        now_wall, now_mono = time.time(), time.clock_gettime(time.CLOCK_MONOTONIC)
        out = []
        for ev in self.dp.drain_events(max_events):
            out.append({
                "sandbox_no": ev.sandbox_no,
                "reason": reason_name(ev.reason),
                "src": be32_to_ip(ev.saddr), "dst": be32_to_ip(ev.daddr),
                "proto": PROTO_NAMES.get(ev.proto, str(ev.proto)) if ev.proto else None,
                "dport": ev.dport or None,
                "ts": now_wall - (now_mono - ev.ts_ns / 1e9),
                "ifindex": ev.ifindex,
            })
        return out

    def status(self) -> dict:
        return {"program_id": self.dp.prog_id, "pin_dir": str(self.dp.pin_dir),
                "pinned": sorted(p.name for p in self.dp.pin_dir.iterdir()),
                "attach_modes": sorted(set(self.modes.values())),
                "load_ms": self.dp.load_ms}
