"""Switch observability through the gateway (issue 4): per-sandbox datapath
counters on /metrics and drop events from the eBPF ring buffer as `net_drop`
audit records. Same setup as test_transparent: a cubevs switch in the lab's gw
namespace and the real gateway in transparent mode, which reopens that switch."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.gateway.test_transparent import SANDBOX, tlab  # noqa: F401 - fixture, set up anew for this module

pytestmark = pytest.mark.netns

_SEND_UDP = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
             "[s.sendto(b'q' * 32, ('198.18.0.10', 443)) for _ in range(3)]")


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rfind("}") + 1]))
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _send_quic(net) -> None:
    subprocess.run(["nsenter", f"--net=/run/netns/{net.netns}", sys.executable, "-c", _SEND_UDP],
                   check=True, capture_output=True, timeout=10)


def test_quic_drop_is_counted_on_metrics_and_audited(tlab):  # noqa: F811
    gw, sw, net = tlab
    _send_quic(net)
    deadline, value = time.monotonic() + 5, 0.0
    while time.monotonic() < deadline:
        code, body = gw.ops_status("/metrics")
        assert code == 200
        value = _metric(body, "cubegate_switch_packets_total", sandbox=SANDBOX, reason="quic", verdict="drop")
        if value > 0:
            break
        time.sleep(0.2)
    assert value > 0, (body, gw.log())
    assert _metric(body, "cubegate_switch_bytes_total", sandbox=SANDBOX, reason="quic") > 0
    if sw.status()["backend"] != "ebpf":
        pytest.skip("drop events need the eBPF backend (nftables has no event reader)")
    rec = gw.wait_record(lambda x: x["event"] == "net_drop" and x.get("reason") == "quic"
                         and x.get("sandbox") == SANDBOX)
    assert rec["decision"] == "deny" and rec["host"] == "198.18.0.10" and rec["port"] == 443
    assert rec["client"] == net.ip and rec["extra"] == {"proto": "udp"}
    code, body = gw.ops_status("/metrics")
    assert _metric(body, "cubegate_switch_events_dropped_total") == 0


def test_drop_events_over_the_poll_limit_are_counted_not_audited():
    from cubegate.netwatch import NetWatch
    from prometheus_client import CollectorRegistry, generate_latest

    class FakeSwitch:
        def __init__(self, n):
            self.pending = [{"sandbox": "sb-x", "reason": "quic", "src": "10.200.0.2", "dst": "1.2.3.4",
                             "proto": "udp", "dport": 443} for _ in range(n)]

        def drain_events(self, max):  # noqa: A002
            out, self.pending = self.pending[:max], self.pending[max:]
            return out

        def counters(self):
            return {("sb-x", "quic", "drop"): (7, 700), (None, "unknown_sandbox", "drop"): (1, 60)}

        def close(self):
            pass

    class Audit:
        def __init__(self):
            self.records = []

        def append(self, rec):
            self.records.append(rec)

    reg, audit = CollectorRegistry(), Audit()
    nw = NetWatch(FakeSwitch(25), reg, audit, max_events=10)
    events = nw._drain()
    assert len(events) == 10 and nw.collector.events_dropped == 15
    text = generate_latest(reg).decode()
    assert _metric(text, "cubegate_switch_packets_total", sandbox="sb-x", reason="quic", verdict="drop") == 7
    assert _metric(text, "cubegate_switch_packets_total", sandbox="-", reason="unknown_sandbox") == 1
    assert _metric(text, "cubegate_switch_events_dropped_total") == 15


def test_net_status_cli_shows_backend_sandboxes_and_counters(tlab):  # noqa: F811
    gw, sw, net = tlab
    _send_quic(net)
    out = json.loads(gw.cli("net", "status", "--json"))
    assert out["backend"] == sw.backend
    [entry] = [s for s in out["sandboxes"] if s["sandbox_id"] == net.sandbox_id]
    assert entry["attached"] and entry["ip"] == net.ip
    quic = [c for c in out["counters"] if c["sandbox"] == net.sandbox_id and c["reason"] == "quic"]
    assert quic and quic[0]["verdict"] == "drop" and quic[0]["packets"] > 0
    table = gw.cli("net", "status")
    assert f"backend: {sw.backend}" in table and net.sandbox_id in table


L4_RULE = """\
  - name: db
    action: allow
    match: {cidrs: [198.18.0.20/32], ports: [5432]}
"""


def test_policy_cidr_rules_are_pushed_into_the_switch(tlab):  # noqa: F811
    import time

    gw, sw, net = tlab
    path = gw.policy_dir / "main.yaml"
    original = path.read_text()

    def l4():
        st = json.loads(gw.cli("net", "status", "--json"))
        return [s["l4_allow"] for s in st["sandboxes"] if s["sandbox_id"] == net.sandbox_id][0]

    try:
        path.write_text(original.rstrip("\n") + "\n" + L4_RULE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ["198.18.0.20/32", 5432, "tcp"] not in l4():
            time.sleep(0.3)
        assert ["198.18.0.20/32", 5432, "tcp"] in l4()
    finally:
        path.write_text(original)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ["198.18.0.20/32", 5432, "tcp"] in l4():
        time.sleep(0.3)
    assert ["198.18.0.20/32", 5432, "tcp"] not in l4()


def test_l4_allow_for_translates_only_ipv4_allow_rules(tmp_path):
    from cubegate.l4sync import l4_allow_for
    from egress.policy import load_policy_files

    p = tmp_path / "p.yaml"
    p.write_text("""\
name: p
default: deny
rules:
  - {name: a, action: allow, match: {cidrs: [10.9.0.0/24], ports: [5432, 6379]}}
  - {name: b, action: allow, match: {cidrs: [10.8.0.1/32]}}
  - {name: c, action: deny, match: {cidrs: [10.7.0.0/16], ports: [22]}}
  - {name: d, action: allow, match: {hosts: [api.example.com]}}
""")
    from egress.netguard import AddressGuard
    rules = l4_allow_for(load_policy_files([p]), "any", {}, guard=AddressGuard(allow_cidrs=["10.0.0.0/8"]))
    assert rules == [("10.8.0.1/32", 0, "tcp"), ("10.9.0.0/24", 5432, "tcp"), ("10.9.0.0/24", 6379, "tcp")]
