"""The E2B control plane: REST+JSON with `X-API-Key`, as the SDK's generated client calls it.

    POST   /sandboxes, /v2/sandboxes              create (201)
    GET    /sandboxes                             list (all, older SDKs)
    GET    /v2/sandboxes?state=&metadata=&limit=&nextToken=   one page, X-Next-Token
    GET    /sandboxes/{id}                        info          DELETE /sandboxes/{id}  kill (204)
    POST   /sandboxes/{id}/timeout                set the end time from now (204)
    POST   /sandboxes/{id}/pause                  freeze (204; 409 already paused)
    POST   /sandboxes/{id}/resume                 thaw (201, older SDKs)
    POST   /sandboxes/{id}/connect, /v2/...       resume if paused (201) or extend (200)
    GET    /sandboxes/{id}/metrics                one sample

API keys are the daemon's tokens (the runtime token file or a vault admin token); the
tenant is the one `e2b.token_tenants` names for the token, else `e2b.tenant`. Another
tenant's sandboxes are 404. Errors: `{"code": status, "message": ...}` (the SDK's shape).
Every string of a create body is checked for real secret values before it is validated.
"""
from __future__ import annotations

import urllib.parse

import httpkit
from httpkit import ApiError, JsonHandler, operation

from cubegate.runtime_api import json_strings
from sandbox_runtime.manager import SecretRefused

from . import models as m
from .core import E2bError, control_error

STATES = {"running", "paused"}


def api_key(headers) -> str:
    """The E2B API key a request carries: X-API-Key, else a bearer token ("" when none)."""
    token = headers.get("X-API-Key", "").strip()
    if not token:
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
    return token


class ControlBase(JsonHandler):
    realm = "e2b"

    def initialize(self, core, tokens, lanes, tenants: dict, default_tenant: str, audit_hook=None, **_) -> None:
        super().initialize(audit_hook)
        self.core, self.tokens, self.lanes = core, tokens, lanes
        self.tenants, self.default_tenant = tenants, default_tenant
        self.tenant: str | None = None
        self.secret_refused = False

    def prepare(self):
        self.action = f"e2b.{type(self).action}.{self.request.method.lower()}"
        if self.public:
            return None
        token = api_key(self.request.headers)
        self.actor = self.tokens.actor(token) if token else None
        if self.actor is None:
            raise ApiError(401, "unauthorized", "missing or invalid API key (X-API-Key)")
        self.tenant = self.tenants.get(self.actor, self.default_tenant)
        # inherited methods too (SandboxesV2.post): every body is screened, whichever route took it
        op = getattr(getattr(type(self), self.request.method.lower(), None), "operation", None)
        if op is not None and op.body is not None or self.request.body:
            return self._screen()
        return None

    async def _screen(self) -> None:
        texts = json_strings(self.request.body)
        await self.run(self.core.manager.refuse_real_secrets, "e2b-request", texts, tenant=self.tenant)

    async def run(self, fn, *args, **kw):
        """In the control plane's own pool, at most CONTROL_LIMITS["tenant"] calls per tenant."""
        return await self.lanes.run([("tenant", self.tenant or "-")], lambda: fn(*args, **kw))

    def _handle_request_exception(self, e: BaseException) -> None:
        self.secret_refused = isinstance(e, SecretRefused)
        err = e if isinstance(e, E2bError) else control_error(e)
        if err is not None:
            e = ApiError(err.status, "e2b", err.message)
        super()._handle_request_exception(e)

    def reply(self, status: int, doc=None, *, compact: bool = False) -> None:
        if status >= 400 and isinstance(doc, dict) and "error" in doc:
            doc = {"code": status, "message": doc.get("message", "")}    # the SDK reads code + message
        super().reply(status, doc, compact=compact)

    def audit_record(self) -> dict | None:
        if self.request.method == "GET":
            return None
        return {"action": self.action, "actor": self.actor, "tenant": self.tenant, "status": self.get_status(),
                "outcome": self.outcome(), "reason": None if self.secret_refused else self.reason,
                "remote": self.request.remote_ip, **self.audit}


class Sandboxes(ControlBase):
    action = "sandboxes"

    @operation("List the tenant's sandboxes (all of them)", reply=m.DetailList)
    async def get(self) -> None:
        items, _ = await self.run(self.core.list, self.tenant, states=STATES, metadata={}, limit=100_000,
                                  next_token=None)
        self.reply(200, items)

    @operation("Create a sandbox from a template", body=m.NewSandbox, status=201, reply=m.Created,
               errors=(404, 409, 429, 500, 501, 503))
    async def post(self, body: m.NewSandbox) -> None:
        doc = body.model_dump(exclude_none=True)
        created = await self.run(self.core.create, self.tenant, doc)
        self.audit.update(sandbox=created["sandboxID"], template=created["templateID"])
        self.reply(201, created)


class SandboxesV2(Sandboxes):
    @operation("List one page of the tenant's sandboxes (X-Next-Token: the next page)", query=m.ListQuery,
               reply=m.DetailList)
    async def get(self, query: m.ListQuery) -> None:
        states = set((query.state or "running,paused").split(","))
        if not states <= STATES:
            raise ApiError(400, "e2b", "state must be running and/or paused")
        meta = dict(urllib.parse.parse_qsl(query.metadata or "", keep_blank_values=True))
        items, token = await self.run(self.core.list, self.tenant, states=states, metadata=meta,
                                      limit=query.limit or 100, next_token=query.nextToken)
        if token:
            self.set_header("X-Next-Token", token)
        self.reply(200, items)


class Sandbox(ControlBase):
    action = "sandbox"

    @operation("Sandbox info", reply=m.Detail, errors=(404,))
    async def get(self, id: str) -> None:
        rec = await self.run(self.core.owned, self.tenant, id)
        self.reply(200, await self.run(self.core.detail, rec))

    @operation("Kill", status=204, errors=(404,))
    async def delete(self, id: str) -> None:
        self.audit["sandbox"] = id
        await self.run(self.core.kill, self.tenant, id)
        self.reply(204)


class SetTimeout(ControlBase):
    action = "sandbox.timeout"

    @operation("Set the end time to now + timeout seconds", body=m.Timeout, status=204, errors=(404,))
    async def post(self, id: str, body: m.Timeout) -> None:
        self.audit["sandbox"] = id
        await self.run(self.core.set_timeout, self.tenant, id, body.timeout)
        self.reply(204)


class Pause(ControlBase):
    action = "sandbox.pause"

    @operation("Pause (freeze every process); resume through connect", body=m.PauseBody, status=204,
               errors=(404, 409, 501))
    async def post(self, id: str, body: m.PauseBody) -> None:
        self.audit["sandbox"] = id
        await self.run(self.core.pause, self.tenant, id)
        self.reply(204)


class Resume(ControlBase):
    action = "sandbox.resume"

    @operation("Resume a paused sandbox (older SDKs)", body=m.ConnectBody, status=201, reply=m.Created,
               errors=(404, 409))
    async def post(self, id: str, body: m.ConnectBody) -> None:
        self.audit["sandbox"] = id
        self.reply(201, await self.run(self.core.resume, self.tenant, id, body.timeout))


class Connect(ControlBase):
    action = "sandbox.connect"

    @operation("Connect: resume if paused (201), else extend the end time (200)", body=m.ConnectBody,
               reply=m.Created, errors=(404,))
    async def post(self, id: str, body: m.ConnectBody) -> None:
        self.audit["sandbox"] = id
        status, created = await self.run(self.core.connect, self.tenant, id, body.timeout)
        self.reply(status, created)


class SandboxMetrics(ControlBase):
    action = "sandbox.metrics"

    @operation("Resource usage now (one sample)", reply=m.Metrics, errors=(404,))
    async def get(self, id: str) -> None:
        self.reply(200, await self.run(self.core.metrics, self.tenant, id))


ROUTES = [
    ("/sandboxes", Sandboxes),
    ("/v2/sandboxes", SandboxesV2),
    ("/sandboxes/{id}", Sandbox),
    ("/sandboxes/{id}/timeout", SetTimeout),
    ("/sandboxes/{id}/pause", Pause),
    ("/sandboxes/{id}/resume", Resume),
    ("/sandboxes/{id}/connect", Connect),
    ("/v2/sandboxes/{id}/connect", Connect),
    ("/sandboxes/{id}/metrics", SandboxMetrics),
]

