"""Prometheus metrics of the gateway, in a registry of its own.

Label values are ids, reasons and actions only: never hosts' secrets, never
header values. Sandbox ids are bounded by the identity store.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "cubegate_decisions_total", "Policy decisions", ["sandbox", "action", "reason", "stage"], registry=r
        )
        self.decision_latency = Histogram(
            "cubegate_decision_seconds", "Time to reach a decision (policy + identity)", ["stage"],
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1), registry=r,
        )
        self.request_latency = Histogram(
            "cubegate_request_seconds", "Intercepted/plain HTTP request duration through the gateway", ["sandbox"],
            registry=r,
        )
        self.connection_duration = Histogram(
            "cubegate_connection_seconds", "Client connection lifetime", ["kind"], registry=r,
        )
        self.bytes = Counter(
            "cubegate_bytes_total", "Bytes relayed", ["sandbox", "direction"], registry=r
        )
        self.active_connections = Gauge(
            "cubegate_active_connections", "Open client connections", registry=r
        )
        self.audit_errors = Counter(
            "cubegate_audit_write_errors_total", "Audit appends that failed (flow refused)", registry=r
        )
        self.fast_path = Counter(
            "cubegate_fast_path_connections_total",
            "Connections the fast path finished itself (relayed, refused) or handed to mitmproxy", ["outcome"],
            registry=r,
        )
        self.policy_reloads = Counter(
            "cubegate_policy_reloads_total", "Policy reload attempts", ["result"], registry=r
        )
        self.injections = Counter(
            "cubegate_injections_total", "Credential injections", ["sandbox", "secret"], registry=r
        )
        self.leaks_blocked = Counter(
            "cubegate_credential_leaks_blocked_total", "Requests blocked because they carried a secret or placeholder to an unbound host",
            ["sandbox"], registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
