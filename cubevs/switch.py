"""cubevs facade: one Switch per hub namespace.

    sw = Switch(hub_netns="cghub", state_dir=..., bpffs_dir=...)
    net = sw.attach_sandbox("sb-1", l4_allow=[("10.9.0.0/24", 5432, "tcp")])
    sw.lookup_by_ip(net.ip) == "sb-1"
    sw.detach_sandbox("sb-1")

Settings are stored in the registry, so `Switch.reopen(state_dir)` after a
daemon restart finds the same hub, pins and sandboxes and repairs anything
missing (map entries, attachment, steering) without recreating sandboxes.
"""
from __future__ import annotations

import ipaddress
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from . import netns, plumbing, steering
from .policy import normalize_l4
from .registry import Entry, Registry
from .switch_schema import verdict_of


class SwitchError(RuntimeError):
    pass


@dataclass(frozen=True)
class SandboxNet:
    sandbox_id: str
    netns: str
    ip: str
    mac: str
    ifindex: int
    host_ifname: str
    sandbox_no: int = 0   # datapath id (counter/map key); never reused


def _entry_net(e: Entry) -> SandboxNet:
    return SandboxNet(e.sandbox_id, e.netns, e.ip, e.mac, e.ifindex, e.host_ifname, e.sandbox_no)


class Switch:
    def __init__(self, *, hub_netns: str | None, state_dir, bpffs_dir,
                 pool: str = "10.200.0.0/16", gateway_ip: str = "10.200.0.1",
                 gateway_ports=(8081, 8080), dns_port: int = 53, transparent_port: int = 8081,
                 backend: str = "auto", hub_addrs=(), netns_prefix: str = "cgs",
                 nft_log_group: int | None = None, attach_mode: str = "auto"):
        if backend not in ("auto", "ebpf", "nftables"):
            raise ValueError(f"backend must be auto, ebpf or nftables, not {backend!r}")
        net = ipaddress.IPv4Network(pool)
        if ipaddress.IPv4Address(gateway_ip) not in net:
            raise ValueError(f"gateway_ip {gateway_ip} is not in pool {pool}")
        if hub_netns is not None and not netns.exists(hub_netns):
            raise SwitchError(f"hub network namespace {hub_netns!r} does not exist")
        self.hub_netns = hub_netns
        self.state_dir = Path(state_dir)
        self.bpffs_dir = Path(bpffs_dir)
        self.pool, self.gateway_ip = str(net), gateway_ip
        self.gateway_ports = tuple(int(p) for p in gateway_ports)
        self.dns_port, self.transparent_port = int(dns_port), int(transparent_port)
        self.hub_addrs = tuple(hub_addrs)
        self.netns_prefix = netns_prefix
        self.attach_mode = attach_mode
        self._lock = threading.RLock()
        self._pending: dict[str, str] = {}   # sandbox id -> address, while its attach is under way
        self._attach_serial = threading.Lock()
        self.registry = Registry(self.state_dir)
        self._salt = f"{hub_netns}|{self.state_dir.resolve()}"
        self.hub = plumbing.Hub(hub_netns)
        self.hub.ensure_gateway_addr(gateway_ip)
        self._backend_error: str | None = None
        self._impl = self._make_backend(backend, nft_log_group)
        self.backend: str = self._impl.name
        steering.install(hub_netns, self.transparent_port)
        self.registry.set_meta("settings", {
            "hub_netns": hub_netns, "bpffs_dir": str(self.bpffs_dir), "pool": self.pool,
            "gateway_ip": gateway_ip, "gateway_ports": list(self.gateway_ports),
            "dns_port": self.dns_port, "transparent_port": self.transparent_port,
            "backend": self.backend, "hub_addrs": list(self.hub_addrs),
            "netns_prefix": netns_prefix, "nft_log_group": nft_log_group,
            "attach_mode": attach_mode,
        })
        for e in self.registry.all():   # after a restart: repair what the kernel lost
            if self.hub.ifindex(e.host_ifname) == e.ifindex:
                self._impl.ensure(e)

    def _make_backend(self, backend: str, log_group):
        common = dict(hub_netns=self.hub_netns, gateway_ip=self.gateway_ip, pool=self.pool,
                      gateway_ports=self.gateway_ports, dns_port=self.dns_port,
                      hub_addrs=self.hub_addrs)
        if backend in ("auto", "ebpf"):
            try:
                from .ebpf_backend import EbpfBackend
                return EbpfBackend(bpffs_dir=self.bpffs_dir, attach_mode=self.attach_mode, **common)
            except Exception as exc:  # noqa: BLE001 - reported in status(), fail over in auto
                if backend == "ebpf":
                    raise SwitchError(f"eBPF backend unavailable: {exc}") from exc
                self._backend_error = f"{type(exc).__name__}: {exc}"
        from .nft_backend import NftBackend
        return NftBackend(log_group=log_group, **common)

    @classmethod
    def reopen(cls, state_dir, **overrides) -> "Switch":
        """Rebuild a Switch from the settings a previous instance stored in state_dir."""
        reg = Registry(state_dir)
        try:
            settings = reg.get_meta("settings")
        finally:
            reg.close()
        if not settings:
            raise SwitchError(f"no cubevs state in {state_dir}")
        settings.update(overrides)
        return cls(state_dir=state_dir, **settings)

    def close(self) -> None:
        """Release fds and sockets; sandboxes, pins and rules stay in place."""
        self._impl.close()
        self.hub.close()
        self.registry.close()

    # ---------------------------------------------------------------- sandboxes
    def attach_sandbox(self, sandbox_id: str, *, l4_allow=()) -> SandboxNet:
        """Attaches run one at a time (_attach_serial: interleaved netlink work makes every
        attach as slow as all of them together), but the switch lock covers only the address
        reservation and the map/registry writes, so claims of prepared slots never wait
        for an attach in progress."""
        with self._attach_serial:
            return self._attach(sandbox_id, l4_allow)

    def _attach(self, sandbox_id: str, l4_allow) -> SandboxNet:
        rules = normalize_l4(l4_allow)
        names = plumbing.names_for(sandbox_id, self._salt, self.netns_prefix)
        with self._lock:
            if self.registry.get(sandbox_id) or sandbox_id in self._pending:
                raise SwitchError(f"sandbox {sandbox_id!r} is already attached")
            reserved = {self.gateway_ip, *self.hub_addrs, *self._pending.values()}
            no, ip, mac = self.registry.allocate(sandbox_id, self.pool, reserved)
            self._pending[sandbox_id] = ip
        try:
            ifindex = self.hub.create(names, ip=ip, mac=mac, gateway_ip=self.gateway_ip)
            e = Entry(sandbox_id, no, ip, mac, ifindex, names.netns, names.host_ifname, rules)
            try:
                with self._lock:
                    self._impl.add(e)            # filter in place before the link comes up
                self.hub.bring_up(names, ifindex, ip)
                with self._lock:
                    self.registry.add(e)
            except BaseException:
                with self._lock:
                    self._impl.remove(e)
                self.hub.destroy(names)
                raise
        finally:
            with self._lock:
                self._pending.pop(sandbox_id, None)
        return _entry_net(e)

    # ---------------------------------------------------------------- prepared slots
    SLOT_PREFIX = "slot-"

    def prepare_slot(self) -> SandboxNet:
        """Namespace + veth + address + map entries for a sandbox not yet named, under a
        random one-use token (unknown to the gateway: its traffic, if any, is refused).
        claim_slot gives it its sandbox id; a slot is never handed out twice."""
        return self.attach_sandbox(self.SLOT_PREFIX + secrets.token_hex(8))

    def claim_slot(self, token: str, sandbox_id: str, *, l4_allow=()) -> SandboxNet:
        if not token.startswith(self.SLOT_PREFIX) or sandbox_id.startswith(self.SLOT_PREFIX):
            raise SwitchError("not a slot token / a sandbox id cannot look like one")
        rules = normalize_l4(l4_allow)
        with self._lock:
            e = self.registry.get(token)
            if e is None:
                raise SwitchError(f"no prepared slot {token!r}")
            if self.registry.get(sandbox_id):
                raise SwitchError(f"sandbox {sandbox_id!r} is already attached")
            if not self.registry.rename(token, sandbox_id):
                raise SwitchError(f"slot {token!r} was claimed concurrently")
            e = self.registry.get(sandbox_id)
            self._impl.set_l4(e, rules)
            self.registry.set_l4(sandbox_id, rules)
            return _entry_net(self.registry.get(sandbox_id))

    def slots(self) -> list[str]:
        """Tokens of prepared, unclaimed slots (e.g. left by a previous daemon)."""
        return [e.sandbox_id for e in self.registry.all() if e.sandbox_id.startswith(self.SLOT_PREFIX)]

    def set_l4_allow(self, sandbox_id: str, l4_allow) -> None:
        rules = normalize_l4(l4_allow)
        with self._lock:
            e = self._get(sandbox_id)
            self._impl.set_l4(e, rules)
            self.registry.set_l4(sandbox_id, rules)

    def detach_sandbox(self, sandbox_id: str) -> None:
        with self._lock:
            e = self.registry.get(sandbox_id)
            if e is None:
                return
            self._impl.remove(e, detach=False)   # deleting the veth detaches the filter
            self.hub.destroy(plumbing.Names(e.netns, e.host_ifname))
            self.registry.remove(sandbox_id)

    def _get(self, sandbox_id: str) -> Entry:
        e = self.registry.get(sandbox_id)
        if e is None:
            raise SwitchError(f"unknown sandbox {sandbox_id!r}")
        return e

    def sandbox(self, sandbox_id: str) -> SandboxNet | None:
        e = self.registry.get(sandbox_id)
        return _entry_net(e) if e else None

    def sandboxes(self) -> list[SandboxNet]:
        return [_entry_net(e) for e in self.registry.all()]

    def lookup_by_ip(self, ip: str) -> str | None:
        return self.registry.lookup_by_ip(ip)

    # ---------------------------------------------------------------- observability
    def counters(self, sandbox_id: str | None = None) -> dict:
        """{(sandbox_id, reason, verdict): (packets, bytes)}; bytes are L2 frame bytes."""
        names = self.registry.by_no()
        no = None
        if sandbox_id is not None:
            no = self._get(sandbox_id).sandbox_no
        out = {}
        for (sno, reason), val in self._impl.counters(no).items():
            sid = names.get(sno) if sno else None   # sandbox_no 0: traffic from an unknown veth
            out[(sid, reason, verdict_of(reason))] = val
        return out

    def drain_events(self, max: int = 1000) -> list[dict]:  # noqa: A002 - name fixed by the API
        names = self.registry.by_no()
        out = []
        for ev in self._impl.drain_events(max):
            ev["sandbox"] = names.get(ev.pop("sandbox_no"))
            out.append(ev)
        return out

    def status(self) -> dict:
        st = {
            "backend": self.backend,
            "backend_fallback_reason": self._backend_error,
            "hub_netns": self.hub_netns,
            "pool": self.pool, "gateway_ip": self.gateway_ip,
            "gateway_ports": list(self.gateway_ports), "dns_port": self.dns_port,
            "transparent_port": self.transparent_port,
            "steering": steering.installed(self.hub_netns),
            "registry": str(self.registry.path),
            "sandboxes": [],
        }
        st.update(self._impl.status())
        for e in self.registry.all():
            st["sandboxes"].append({
                "sandbox_id": e.sandbox_id, "ip": e.ip, "mac": e.mac, "ifindex": e.ifindex,
                "host_ifname": e.host_ifname, "netns": e.netns,
                "attached": self.hub.ifindex(e.host_ifname) == e.ifindex and self._impl.is_attached(e),
                "l4_allow": [list(r) for r in e.l4_allow],
            })
        return st

    def has_trace(self, net: SandboxNet | Entry) -> dict:
        """Which traces of a (detached) sandbox remain; all False after detach_sandbox."""
        e = net if isinstance(net, Entry) else Entry(
            net.sandbox_id, net.sandbox_no, net.ip, net.mac, net.ifindex, net.netns,
            net.host_ifname, ())
        return {
            "link": net.host_ifname in self.hub.link_names(),
            "netns": netns.exists(net.netns),
            "registry": self.registry.get(net.sandbox_id) is not None,
            "datapath": self._impl.has_trace(e),
        }
