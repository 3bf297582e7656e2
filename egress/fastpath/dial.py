"""Connect to the first of the guarded addresses that answers, within one deadline for all."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Dialled:
    transport: asyncio.Transport | None = None
    ip: str | None = None
    timed_out: bool = False
    error: str = "no allowed address"

    @property
    def reason(self) -> str:
        return "upstream_connect_timeout" if self.timed_out else "upstream_connect_failed"


async def dial(protocol_factory: Callable[[], asyncio.Protocol], addresses, port: int,
               connect_timeout: float | None, client_lost: Callable[[], bool]) -> Dialled:
    """`addresses`: (family, ip) the guard already allowed, tried in order; stops when the
    deadline passes or the client is gone."""
    loop = asyncio.get_running_loop()
    out = Dialled()
    deadline = loop.time() + connect_timeout if connect_timeout else None
    for _family, ip in addresses:
        try:
            remaining = None if deadline is None else max(0.001, deadline - loop.time())
            out.transport, _ = await asyncio.wait_for(loop.create_connection(protocol_factory, ip, port), remaining)
            out.ip = ip
            return out
        except (asyncio.TimeoutError, TimeoutError):
            out.timed_out, out.error = True, f"no TCP connection within {connect_timeout}s"
            return out
        except OSError as e:
            out.error = (e.strerror or type(e).__name__)[:300]
        if client_lost():
            return out
    return out
