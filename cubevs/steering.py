"""Steer sandbox TCP 80/443 to the gateway's transparent listener.

nftables NAT in the hub namespace: REDIRECT rewrites the destination to the
incoming veth's address (the gateway ip) and the transparent port; the gateway
recovers the original destination with SO_ORIGINAL_DST.  Idempotent: the
table is replaced atomically on every call.
"""
from __future__ import annotations

from . import nft

TABLE = "cubegate_steer"


def ruleset(transparent_port: int, ports=(80, 443), iif_prefix: str = "cgv") -> str:
    plist = ", ".join(str(p) for p in ports)
    return f"""
table ip {TABLE}
delete table ip {TABLE}
table ip {TABLE} {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{iif_prefix}*" tcp dport {{ {plist} }} redirect to :{transparent_port}
    }}
}}
"""


def install(hub_netns: str | None, transparent_port: int, ports=(80, 443)) -> None:
    nft.run(hub_netns, ruleset(transparent_port, ports))


def remove(hub_netns: str | None) -> None:
    nft.run(hub_netns, f"table ip {TABLE}\ndelete table ip {TABLE}\n")


def installed(hub_netns: str | None) -> bool:
    data = nft.run(hub_netns, "list tables", as_json=True)
    return any(o.get("table", {}).get("name") == TABLE for o in data.get("nftables", []))
