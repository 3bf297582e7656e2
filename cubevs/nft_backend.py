"""Switch backend where eBPF is unavailable: nftables netdev ingress per sandbox veth.

Same policy and reason names as switch.c.  Table `netdev cubegate` in the hub
namespace; per sandbox one base chain bound to its veth (policy drop) and one
named counter per reason (`sb<no>_<reason>`).  Drops can be logged to an NFLOG
group (`log_group`), for an external consumer; `drain_events` returns nothing.
Byte counts are reported as L2 frame bytes (netdev ingress sees the packet
without its 14-byte Ethernet header; we add it back) so both backends agree.
"""
from __future__ import annotations

from . import nft
from .policy import WEB_PORTS
from .registry import Entry
from .switch_schema import REASON_CODES, verdict_of

TABLE = "cubegate"
ETH_HLEN = 14
_REASONS = [r for r in REASON_CODES if r != "unknown_sandbox"]


class NftBackend:
    name = "nftables"

    def __init__(self, *, hub_netns, gateway_ip, pool, gateway_ports, dns_port, hub_addrs=(),
                 log_group: int | None = None):
        self.ns = hub_netns
        self.gateway_ip, self.pool = gateway_ip, pool
        self.gateway_ports, self.dns_port = tuple(gateway_ports), dns_port
        self.hub = [gateway_ip, *hub_addrs, "127.0.0.0/8", "0.0.0.0/8", "224.0.0.0/4",
                    "255.255.255.255"]
        self.log_group = log_group
        nft.run(self.ns, f"add table netdev {TABLE}\n")

    def close(self) -> None:
        pass

    # -- ruleset generation (pure)
    def _act(self, no: int, reason: str) -> str:
        stmt = f'counter name "sb{no}_{reason}"'
        if verdict_of(reason) == "allow":
            return stmt + " accept"
        if self.log_group is not None:
            stmt += f' log group {self.log_group} prefix "cg {no} {reason} "'
        return stmt + " drop"

    def chain_rules(self, e: Entry, rules=None) -> list[str]:
        no, ip, mac, gw = e.sandbox_no, e.ip, e.mac, self.gateway_ip
        a = lambda r: self._act(no, r)  # noqa: E731
        hub = "{ " + ", ".join(self.hub) + " }"
        gwp = "{ " + ", ".join(str(p) for p in self.gateway_ports) + " }"
        web = "{ " + ", ".join(str(p) for p in WEB_PORTS) + " }"
        dns = "{ " + ", ".join(sorted({"53", str(self.dns_port)})) + " }"
        out = [
            f"ether type ip6 {a('ipv6')}",
            f"ether type arp ether saddr != {mac} {a('arp_spoof')}",
            f"ether type arp arp htype != 1 {a('malformed')}",
            f"ether type arp arp ptype != ip {a('malformed')}",
            f"ether type arp arp saddr ether != {mac} {a('arp_spoof')}",
            f"ether type arp arp saddr ip != {ip} {a('arp_spoof')}",
            f"ether type arp arp daddr ip != {{ {gw}, {ip} }} {a('arp_spoof')}",
            f"ether type arp {a('arp')}",
            f"ether type != ip {a('ethertype')}",
            f"ether saddr != {mac} {a('spoof_mac')}",
            f"ip saddr != {ip} {a('spoof_ip')}",
            f"ip frag-off & 0x3fff != 0 {a('fragment')}",
            f"ip daddr {hub} tcp dport {gwp} {a('gateway')}",
            f"ip daddr {gw} meta l4proto {{ tcp, udp }} th dport {self.dns_port} {a('dns')}",
            f"ip daddr {hub} {a('host_service')}",
            f"ip daddr {self.pool} {a('sandbox_to_sandbox')}",
            f"tcp dport {web} {a('web')}",
            f"udp dport 443 {a('quic')}",
            f"meta l4proto {{ tcp, udp }} th dport {dns} {a('foreign_dns')}",
            # what the hub routes to itself (any of its addresses, now or later): never a direct path
            f"fib daddr type {{ local, broadcast, multicast }} {a('host_service')}",
        ]
        for cidr, port, proto in (e.l4_allow if rules is None else rules):
            if proto == "icmp":
                out.append(f"ip daddr {cidr} meta l4proto icmp {a('l4_allow')}")
            elif port == 0:
                out.append(f"ip daddr {cidr} meta l4proto {proto} {a('l4_allow')}")
            else:
                out.append(f"ip daddr {cidr} {proto} dport {port} {a('l4_allow')}")
        out.append(a("port_not_allowed"))
        return out

    def _chain(self, e: Entry, rules=None) -> str:
        body = "\n        ".join(self.chain_rules(e, rules))
        return (f"    chain sb{e.sandbox_no} {{\n"
                f'        type filter hook ingress device "{e.host_ifname}" priority -500; policy drop;\n'
                f"        {body}\n    }}\n")

    # -- backend interface
    def add(self, e: Entry) -> None:
        counters = "".join(f"    counter sb{e.sandbox_no}_{r} {{ }}\n" for r in _REASONS)
        nft.run(self.ns, f"table netdev {TABLE} {{\n{counters}{self._chain(e)}}}\n")

    def ensure(self, e: Entry) -> None:
        if not self.is_attached(e):
            self.add(e)

    def set_l4(self, e: Entry, rules) -> None:
        nft.run(self.ns, f"flush chain netdev {TABLE} sb{e.sandbox_no}\n"
                         f"table netdev {TABLE} {{\n{self._chain(e, rules)}}}\n")

    def _objects(self) -> list[dict]:
        data = nft.run(self.ns, f"list table netdev {TABLE}", as_json=True)
        return data.get("nftables", [])

    def remove(self, e: Entry, *, detach: bool = True) -> None:  # noqa: ARG002
        no = e.sandbox_no
        cmds = [f"delete chain netdev {TABLE} sb{no}"]
        cmds += [f"delete counter netdev {TABLE} sb{no}_{r}" for r in _REASONS]
        try:   # one atomic transaction in the common case (everything exists)
            nft.run(self.ns, "\n".join(cmds) + "\n")
            return
        except nft.NftError:
            pass
        objs = self._objects()   # partial state (e.g. a failed attach): delete what exists
        names = {("chain", o["chain"]["name"]) for o in objs if "chain" in o}
        names |= {("counter", o["counter"]["name"]) for o in objs if "counter" in o}
        left = [c for c in cmds if (c.split()[1], c.split()[-1]) in names]
        if left:
            nft.run(self.ns, "\n".join(left) + "\n")

    def is_attached(self, e: Entry) -> bool:
        return any("chain" in o and o["chain"]["name"] == f"sb{e.sandbox_no}"
                   for o in self._objects())

    def has_trace(self, e: Entry) -> bool:
        pre = f"sb{e.sandbox_no}"
        return any(("chain" in o and o["chain"]["name"] == pre) or
                   ("counter" in o and o["counter"]["name"].startswith(pre + "_"))
                   for o in self._objects())

    def counters(self, sandbox_no=None) -> dict[tuple[int, str], tuple[int, int]]:
        out = {}
        for o in self._objects():
            c = o.get("counter")
            if not c or not c["name"].startswith("sb"):
                continue
            no_s, _, reason = c["name"][2:].partition("_")
            no = int(no_s)
            if sandbox_no is not None and no != sandbox_no:
                continue
            if c["packets"]:
                out[(no, reason)] = (c["packets"], c["bytes"] + ETH_HLEN * c["packets"])
        return out

    def drain_events(self, max_events: int) -> list[dict]:
        return []

    def status(self) -> dict:
        return {"table": f"netdev {TABLE}", "log_group": self.log_group}
