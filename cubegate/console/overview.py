"""Overview: readiness check by check, host capacity from the kernel, the last 15 minutes in charts."""
from __future__ import annotations

import os

from sandbox_runtime.capacity import meminfo_mb

from .base import ConsoleHandler
from .charts import series

MB = 1024 * 1024


def host_capacity(manager=None) -> dict:
    """Budget, reservations and what the kernel says now (MemTotal/MemAvailable, CPUs we may use)."""
    mem = meminfo_mb()
    out = {"mem_total_mb": mem.get("MemTotal"), "mem_available_mb": mem.get("MemAvailable"),
           "cpus": len(os.sched_getaffinity(0)), "runtime": manager is not None}
    if manager is not None:
        snap = manager.snapshot_for_metrics()
        b, r = snap["budget"], snap["reserved"]
        out.update(budget={"memory_mb": b.memory_mb, "cpus": b.cpus, "sandboxes": b.max_sandboxes,
                           "host_reserve_mb": b.host_reserve_mb},
                   reserved={"memory_mb": r.memory_mb, "cpus": r.cpus, "sandboxes": r.sandboxes},
                   measured_memory_bytes=sum(m[2] for m in snap["memory"]))
    return out


async def overview_data(handler: ConsoleHandler) -> dict:
    ctx = handler.ctx
    ready, checks = ctx.readiness.evaluate()
    capacity = await handler.run(ctx.capacity)
    top = await handler.run(ctx.audit_index.top_hosts, decision="deny", since="15m", limit=10)
    return {"ready": ready, "checks": checks, "capacity": capacity, "series": series(ctx.ring.samples(), top),
            "sample_seconds": ctx.ring.interval}


class OverviewPage(ConsoleHandler):
    action = "console.overview"
    template = "overview.html"

    async def get(self) -> None:
        await self.render_page("overview.html", **await overview_data(self))


class OverviewData(ConsoleHandler):
    """What the Overview's script polls (does not count as activity: an open tab expires)."""
    action = "console.overview.data"
    kind, touch = "api", False

    async def get(self) -> None:
        self.send_json(await overview_data(self))
