"""Open connections that a policy change may revoke, whichever data path carries them.

The gate lists its own mitmproxy connections; another data path (a fast path
that splices sockets outside mitmproxy) registers each of its connections with
`register(conn, close)` and `unregister(conn_id)`. `PolicyGate.revoke_where`
then re-decides all of them the same way and closes the ones now denied.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from egress.identity import Identity
from egress.policy import RequestInfo


@dataclass(frozen=True)
class OpenConnection:
    conn_id: str
    sandbox_id: str
    host: str                     # the decided destination (normalised name or IP literal)
    port: int
    labels: Mapping[str, str] = field(default_factory=dict)
    ip_literal: bool = False
    kind: str = "tunnel"          # passthrough | intercept | http | tcp | the registering path's own name
    issued: float | None = None   # the identity's token (Identity.issued) it was authenticated with
    transparent: bool = False     # identified by its source address, not a token
    upstream_ip: str | None = None  # the address connected to, once known (a name's deny CIDRs apply to it)

    def request(self) -> RequestInfo:
        """The destination as the CONNECT/SNI stage decides it (method and path unknown)."""
        return RequestInfo(sandbox_id=self.sandbox_id, labels=self.labels, host=self.host, port=self.port,
                           is_ip_literal=self.ip_literal)


Closer = Callable[[str], None]   # close(reason)
Predicate = Callable[[OpenConnection], "str | None"]   # the denial reason, or None to keep it


BLIND_KINDS = frozenset({"passthrough", "tcp"})   # tunnels no request of which is ever decided


def denied_by(policy) -> Predicate:
    """The usual predicate: a connection whose destination `policy` now denies (at CONNECT stage),
    or a blind tunnel to a destination that now needs inspection (method/path rules): its
    requests would never be decided, so it is closed and the sandbox reconnects, inspected."""
    def check(conn: OpenConnection) -> str | None:
        d = policy.decide(conn.request())
        if not d.allowed:
            return d.reason
        if conn.upstream_ip is not None and not conn.ip_literal:
            denial = policy.address_denial(conn.sandbox_id, conn.upstream_ip, conn.port)
            if denial is not None:
                return denial[0]
        if d.needs_inspection and conn.kind in BLIND_KINDS:
            if conn.kind == "passthrough":   # TLS: rules that differ by scheme only settle (as the gate does)
                d = policy.decide(replace(conn.request(), scheme="https"))
                if not d.allowed:
                    return d.reason
            if d.needs_inspection:
                return "needs_inspection"
        return None
    return check


def identity_changed(current: Callable[[OpenConnection], "Identity | None"]) -> Predicate:
    """Connections whose identity is gone, or (explicit) whose token was re-issued — the answer
    to a leaked token revokes what was opened with it: `current(conn)` is what a new connection
    of that sandbox would be given now (None: refused). A transparent connection is identified by
    its address, not a token: a re-key alone leaves it to the relabel check (PolicyGate.relabel),
    which decides it again with the labels now in force."""
    def check(conn: OpenConnection) -> str | None:
        now = current(conn)
        if now is None or (not conn.transparent and now.issued != conn.issued):
            return "identity_changed"
        return None
    return check


def identity_unverifiable(conn: OpenConnection) -> str | None:
    """While the identity store cannot be read, no token can be checked: every explicit connection
    is closed (a removal or re-key in that time would go unseen). A transparent one is identified
    by its address (the switch's registry), not by the store."""
    return None if conn.transparent else "identity_store_unreadable"


class Registered:
    """Connections of other data paths: conn_id → (what, how to close it)."""

    def __init__(self) -> None:
        self._conns: dict[str, tuple[OpenConnection, Closer]] = {}

    def register(self, conn: OpenConnection, close: Closer) -> None:
        self._conns[conn.conn_id] = (conn, close)

    def unregister(self, conn_id: str) -> None:
        self._conns.pop(conn_id, None)

    def items(self) -> list[tuple[OpenConnection, Closer]]:
        return list(self._conns.values())

    def __len__(self) -> int:
        return len(self._conns)
