"""One client connection's state, and the per-sandbox connection budget.

Shared by the mitmproxy gate (egress/gate.py) and the fast path (egress/fastpath/):
both count against the same budget and write the same records from this state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from egress.identity import Identity
from egress.policy import Decision


@dataclass
class ConnState:
    conn_id: str
    client: str
    started: float
    transparent: bool = False
    identity: Identity | None = None
    host: str | None = None          # normalised destination host (CONNECT, or SNI in transparent mode)
    port: int | None = None
    conn_port: int | None = None     # transparent: the port the sandbox dialled (80/443), fixed for the connection
    ip_literal: bool = False
    sni: str | None = None
    decision: Decision | None = None
    intercept: bool = False
    tunnel: bool = False             # an allowed CONNECT (or transparent TLS) fixed the destination
    kind: str = "pending"            # passthrough | intercept | http | denied | tcp
    denied_reason: str | None = None
    refusal_counted: bool = False    # its refusal went into a summary record (egress.refusal_budget), not its own
    upstream: str | None = None
    bytes_out: int = 0               # sandbox → upstream
    bytes_in: int = 0                # upstream → sandbox
    requests: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    counted_for: str | None = None   # sandbox whose connection budget this connection holds
    refused_pending: int = 0         # requests refused at their head whose body mitmproxy still reads
    refused_allowance: int = 0       # bytes the sandbox may still send for those bodies
    head_timer: Any = None           # slowloris: fires if the request head / ClientHello is not complete

    @property
    def sandbox(self) -> str:
        return self.identity.sandbox_id if self.identity else "-"


class ConnectionClaims:
    """Open client connections per sandbox, bounded by `limit` (None/0 = unbounded)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}

    def claim(self, st: ConnState, identity: Identity) -> bool:
        """Count `st` against its sandbox's budget; False when the budget is spent."""
        st.identity = identity
        sandbox = identity.sandbox_id
        if st.counted_for == sandbox:
            return True
        if st.counted_for is not None:
            self.release(st)
        n = self.open.get(sandbox, 0)
        if self.limit and n >= self.limit:
            return False
        self.open[sandbox] = n + 1
        st.counted_for = sandbox
        return True

    def release(self, st: ConnState) -> None:
        sandbox, st.counted_for = st.counted_for, None
        if sandbox is None:
            return
        n = self.open.get(sandbox, 1) - 1
        if n > 0:
            self.open[sandbox] = n
        else:
            self.open.pop(sandbox, None)
