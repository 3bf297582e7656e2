"""Learn mode: the smallest allow policy for what report mode recorded as would-deny.

Pure core (`suggest_policy`): exact hosts, one rule per host with the ports
seen; names are folded into `*.parent` only where at least `min_siblings`
distinct names under the same parent (of two labels or more: never `*.com`)
were seen, the most specific such parent first. IP literals become /32 (/128) cidrs rules. The reader
(`would_deny_records`) takes the records from the audit index.
"""
from __future__ import annotations

import ipaddress
import re
from collections import defaultdict

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text or "")
    if not m:
        raise ValueError(f"duration must look like 30m, 8h or 7d, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _rule_name(prefix: str, text: str) -> str:
    return (prefix + re.sub(r"[^A-Za-z0-9_.:-]", "-", text.replace("*.", "any.")))[:128]


def suggest_policy(records, *, sandbox: str | None = None, label: tuple[str, str] | None = None,
                   name: str | None = None, min_siblings: int = 4) -> dict:
    ports_by_host: dict[str, set[int]] = defaultdict(set)
    ports_by_ip: dict[str, set[int]] = defaultdict(set)
    for rec in records:
        if not rec.get("would_deny") or not rec.get("host") or not rec.get("port"):
            continue
        host, port = rec["host"], int(rec["port"])
        try:
            ports_by_ip[str(ipaddress.ip_address(host))].add(port)
        except ValueError:
            ports_by_host[host.lower().rstrip(".")].add(port)
    below: dict[str, set[str]] = defaultdict(set)     # parent domain -> names seen under it (any depth)
    for host in ports_by_host:
        labels = host.split(".")
        for i in range(1, len(labels) - 1):                 # parents of two labels or more
            below[".".join(labels[i:])].add(host)
    folded: dict[str, str] = {}      # host -> the wildcard that covers it: the most specific parent with enough
    for parent in sorted(below, key=lambda p: -p.count(".")):
        if len(below[parent]) >= min_siblings:
            for h in below[parent]:
                folded.setdefault(h, "*." + parent)
    groups: dict[str, set[int]] = defaultdict(set)
    for host, ports in ports_by_host.items():
        groups[folded.get(host, host)] |= ports
    rules = [{"name": _rule_name("learned-", pattern), "action": "allow",
              "match": {"hosts": [pattern], "ports": sorted(ports)}}
             for pattern, ports in sorted(groups.items(), key=lambda kv: (kv[0].lstrip("*."), kv[0]))]
    for ip, ports in sorted(ports_by_ip.items()):
        net = ipaddress.ip_network(ip)
        rules.append({"name": _rule_name("learned-ip-", ip), "action": "allow",
                      "match": {"cidrs": [str(net)], "ports": sorted(ports)}})
    who = sandbox or (f"{label[0]}-{label[1]}" if label else "sandboxes")
    doc: dict = {"name": name or _rule_name("learned-", who)}
    if sandbox:
        doc["applies_to"] = {"sandboxes": [sandbox]}
    elif label:
        doc["applies_to"] = {"labels": {label[0]: label[1]}}
    doc.update(mode="enforce", default="deny", rules=rules)
    return doc


def would_deny_records(settings, *, sandbox: str | None, label: tuple[str, str] | None, since: str,
                       limit: int = 100_000) -> list[dict]:
    """Report-mode would-deny decisions of the sandbox (or of every sandbox with the label) since then."""
    from egress.audit.index import AuditIndex
    from egress.identity import IdentityStore

    if sandbox:
        sandboxes = [sandbox]
    else:
        store = IdentityStore(settings.identity_db)
        try:
            sandboxes = [i.sandbox_id for i in store.list() if i.labels.get(label[0]) == label[1]]
        finally:
            store.close()
    out: list[dict] = []
    with AuditIndex(settings.state_dir + "/audit-index.db" if isinstance(settings.state_dir, str)
                    else settings.state_dir / "audit-index.db", settings.audit_dir) as index:
        index.sync()
        for sb in sandboxes:
            for event in ("decision", "request"):
                out += [r for r in index.query(sandbox=sb, event=event, decision="allow", since=since, limit=limit)
                        if r.get("would_deny")]
    return out
