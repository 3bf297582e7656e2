"""New access requests POSTed as JSON to a configured URL (access.webhook_url), off the request path.

A bounded queue, one supervised sender loop, a timeout per POST; a full queue
drops the newest notification (logged and counted): a slow receiver never
holds up the gateway. Only request metadata is sent (id, sandbox, host, port,
the sandbox's reason text), never a credential.
"""
from __future__ import annotations

import asyncio
import logging

import httpx

log = logging.getLogger("cubegate.webhook")
QUEUE = 1000


class Webhook:
    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE)
        self.sent = self.failed = self.dropped = 0

    def notify(self, request: dict) -> None:
        doc = {"event": "access_request", "request": {k: request.get(k) for k in
                                                      ("id", "sandbox", "labels", "host", "port", "reason",
                                                       "state", "created")}}
        try:
            self.queue.put_nowait(doc)
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("access webhook queue full: notification for %s dropped", request.get("id"))

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout, trust_env=False) as client:
            while True:
                doc = await self.queue.get()
                try:
                    r = await client.post(self.url, json=doc)
                    if r.status_code >= 400:
                        raise httpx.HTTPStatusError(f"status {r.status_code}", request=r.request, response=r)
                    self.sent += 1
                except httpx.HTTPError as e:
                    self.failed += 1
                    log.warning("access webhook POST failed: %s", type(e).__name__)
